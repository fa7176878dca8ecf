"""DeepSpeed's PipelineEngine sends the activation split over TP with the attention mask beside
it, and the gradient back whole from every TP rank, each send and each receive its own blocking
instruction (costmodel.frameworks `pipe_engine_sends`)."""
from dataclasses import replace

import pytest

from costmodel.comm import p2p_time_s
from costmodel.frameworks import FRAMEWORKS
from costmodel.hardware import parse_cluster, run_by
from costmodel.rank_time.layer_comm import pp_sends_s
from costmodel.rank_time.spans import spans
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan


def test_deepspeed_sends_the_gradient_whole_and_the_mask_forward():
    model, train = resolve_model("llama2-7b"), TrainSpec(seq_len=2048, global_batch_size=64)
    cluster = parse_cluster("2x8xA100")
    plan = build_plan(model, train, cluster, Choice(tp=2, pp=4, zero_stage=1, micro_batch_size=2))
    span = spans(plan, cluster).pp
    tier = cluster.pipeline_tier(span.num_nodes)
    whole = 2 * 2 * 2048 * model.hidden_size   # bf16, micro-batch 2
    # a send between nodes (the pipeline's 4 stages are 2 on each node)
    megatron = pp_sends_s(model, train, plan, run_by(cluster, FRAMEWORKS["megatron-core"]), span)[1]
    deepspeed = pp_sends_s(model, train, plan, run_by(cluster, FRAMEWORKS["megatron-deepspeed"]), span)[1]
    assert plan.sequence_parallel and megatron == pytest.approx(p2p_time_s(whole / 2, tier))
    # without SP every TP rank holds the whole activation, and Megatron-Core sends it whole
    # (get_tensor_shapes divides the sequence by TP only under SP)
    whole_plan = replace(plan, sequence_parallel=False)
    assert pp_sends_s(model, train, whole_plan, run_by(cluster, FRAMEWORKS["megatron-core"]), span)[1] == (
        pytest.approx(p2p_time_s(whole, tier)))
    # SC'21's Megatron-LM scattered it over TP (scatter_gather_tensors_in_pipeline)
    assert pp_sends_s(model, train, whole_plan, run_by(cluster, FRAMEWORKS["megatron-lm"]), span)[1] == (
        pytest.approx(p2p_time_s(whole / 2, tier)))
    # a stage blocks for what it receives as well as what it sends: both transfers each way
    assert deepspeed == pytest.approx(p2p_time_s(whole / 2 + 2 * 2048 * 2048, tier) + p2p_time_s(whole, tier))
    assert deepspeed > 2.8 * megatron


@pytest.mark.parametrize("grad_dtype,kind", [("fp32", "all_reduce"), ("bf16", "reduce_scatter")])
def test_deepspeed_bf16_zero1_all_reduces_fp32_gradients_after_the_backward(grad_dtype, kind):
    """bf16 with fp32 gradients at ZeRO-1 is DeepSpeed's BF16_Optimizer: the whole fp32 gradients
    all-reduced after the backward, exposed; with bf16 gradients its ZeRO optimizer reduce-scatters."""
    from costmodel.rank_time.dp_terms import dp_terms
    from costmodel.specs import DType
    model = resolve_model("llama2-7b")
    train = TrainSpec(seq_len=2048, global_batch_size=64, grad_dtype=DType(grad_dtype))
    cluster = run_by(parse_cluster("2x8xA100"), FRAMEWORKS["deepspeed"])
    plan = build_plan(model, train, cluster, Choice(tp=1, pp=1, zero_stage=1, micro_batch_size=2))
    reduce = next(t for t in dp_terms(model, train, plan, cluster) if t.scale == 1.0 and t.collectives[0][0] != "all_gather")
    assert str(reduce.collectives[0][0]) == kind
    # its ZeRO optimizer overlaps the reduce-scatter (our export's overlap_comm); BF16_Optimizer does not
    assert (reduce.collectives[0][1], reduce.window) == ((4, "none") if kind == "all_reduce" else (2, "backward"))
