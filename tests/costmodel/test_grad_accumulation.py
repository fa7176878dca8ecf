"""Gradient accumulation (costmodel.rank_time.grad_accumulation_s): every micro-batch after the
first adds its gradients into the step's, at the profile's measured rate per dtype they come in;
whole gradients where they are held whole, the reduced shard where ZeRO-2/3 reduce every
micro-batch, only the embedding's where the framework fuses the adds into its GEMMs. And the
torch behaviour the bf16 price rests on: FSDP2 accumulates 16-bit gradients in an fp32 buffer."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from costmodel.estimate import estimate
from costmodel.frameworks import FRAMEWORKS
from costmodel.hardware import ClusterSpec, load_profile
from costmodel.kernels import embedding_kernel_times, memory_bound_s
from costmodel.params import edge_param_tensors, layer_param_tensors, rank_params
from costmodel.rank_time import grad_accumulation_s, rank_times, spans
from costmodel.registry import llama_spec
from costmodel.specs import DType, TrainSpec
from planner.space import Choice, build_plan

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"
MODEL = llama_spec("t-llama", layers=4, hidden=384, heads=6, kv_heads=2, ffn=1024, vocab=6000, max_pos=512,
                   source="test")
FP32_S, BF16_S = 3e-10, 5e-10   # seconds per parameter, fp32 += fp32 and fp32 += bf16


def _cluster(devices: int = 2, framework: str = "planner") -> ClusterSpec:
    dev = replace(load_profile(PROFILE), grad_accumulate_s_per_param=(("fp32", FP32_S), ("bf16", BF16_S)))
    return ClusterSpec(device=dev, num_nodes=1, devices_per_node=devices, framework=FRAMEWORKS[framework])


def _priced(dtype: DType = DType.FP32, framework: str = "planner", grad: DType = DType.FP32,
            **choice) -> tuple[list[float], object]:
    train = TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=dtype, grad_dtype=grad)
    cluster = _cluster(choice.get("dp", 1) * choice.get("pp", 1), framework)
    plan = build_plan(MODEL, train, cluster, Choice(**choice))
    return [grad_accumulation_s(MODEL, train, plan, cluster, rank_params(MODEL, plan, r), plan.layers_on_rank(r))
            for r in range(plan.pp)], plan


def _tensors(rank_held, layers: int) -> int:
    return layers * layer_param_tensors(MODEL) + edge_param_tensors(MODEL, rank_held.embedding, rank_held.head)


def test_the_adds_count_the_runtimes_tensors():
    """One add per parameter tensor: a Llama layer's two norms and seven projections, the
    embedding's one table, the head's norm and projection (the norm alone when tied)."""
    assert layer_param_tensors(MODEL, stacked_experts=True) == 9
    assert edge_param_tensors(MODEL, 1, 0) == 1
    assert edge_param_tensors(MODEL, 0, 10**6) == 2 and edge_param_tensors(MODEL, 0, MODEL.hidden_size) == 1


def test_one_micro_batch_accumulates_nothing():
    assert _priced(micro_batch_size=8)[0] == [0.0]


def test_whole_fp32_gradients_add_every_later_micro_batch_at_the_measured_rate():
    (got,), plan = _priced(micro_batch_size=2)          # one rank, 4 micro-batches, plain autograd adds
    held = rank_params(MODEL, plan, 0)
    overhead = _cluster().device.for_dtype(DType.FP32).efficiency.kernel_overhead_s
    assert got == pytest.approx(3 * (held.total * FP32_S + _tensors(held, 4) * overhead))


def test_bf16_gradients_are_cast_once_then_added_into_fp32_at_their_own_rate():
    (fp32,), _ = _priced(DType.FP32, micro_batch_size=2)
    (bf16,), plan = _priced(DType.BF16, micro_batch_size=2)
    held = rank_params(MODEL, plan, 0)
    overhead = _cluster().device.for_dtype(DType.BF16).efficiency.kernel_overhead_s
    adds = 3 * (held.total * BF16_S + _tensors(held, 4) * overhead)
    assert bf16 > adds and bf16 - adds < adds / 3 and bf16 != fp32   # the cast: one pass, cheaper than an add


def test_zero_2_adds_the_reduced_shard_and_a_pipeline_holds_gradients_whole():
    zero1, _ = _priced(dp=2, zero_stage=1, micro_batch_size=1)
    zero2, plan = _priced(dp=2, zero_stage=2, micro_batch_size=1)
    held = rank_params(MODEL, plan, 0)
    overhead = _cluster().device.for_dtype(DType.FP32).efficiency.kernel_overhead_s
    assert zero1[0] == pytest.approx(3 * (held.total * FP32_S + _tensors(held, 4) * overhead))
    assert zero2[0] == pytest.approx(3 * (held.total / 2 * FP32_S + _tensors(held, 4) * overhead))
    # torch pipelining turns FSDP's reduction off until the last micro-batch: whole gradients again
    piped, plan = _priced(pp=2, zero_stage=2, micro_batch_size=1)
    for r, got in enumerate(piped):
        held = rank_params(MODEL, plan, r)
        assert got == pytest.approx(7 * (held.total * FP32_S + _tensors(held, 2) * overhead))


def test_the_sharded_gradient_is_fp32_whatever_the_reduced_dtype():
    """FSDP2 casts the reduced shard to the sharded parameter's dtype (fp32 master weights) and
    adds there; and in fp32 the runtime takes no reduce dtype, so a bf16 grad dtype changes nothing."""
    overhead = _cluster().device.for_dtype(DType.BF16).efficiency.kernel_overhead_s
    (bf16_grads,), plan = _priced(DType.BF16, grad=DType.BF16, dp=2, zero_stage=2, micro_batch_size=1)
    held = rank_params(MODEL, plan, 0)
    assert bf16_grads == pytest.approx(3 * (held.total / 2 * FP32_S + _tensors(held, 4) * overhead))
    assert _priced(DType.FP32, grad=DType.BF16, micro_batch_size=2)[0] == _priced(DType.FP32, micro_batch_size=2)[0]


def test_offloaded_shards_add_on_the_host_which_the_host_copies_price():
    assert _priced(dp=2, zero_stage=2, micro_batch_size=1, offload_optimizer=True)[0] == [0.0]


def test_fused_accumulation_leaves_only_the_embedding_add_every_micro_batch():
    ours, _ = _priced(pp=2, micro_batch_size=1)
    fused, plan = _priced(framework="megatron-core", pp=2, micro_batch_size=1)
    assert fused[1] == 0.0 and 0 < fused[0] < ours[0] / 2   # the last rank's head is a GEMM
    embedding = rank_params(MODEL, plan, 0).embedding
    one_add = embedding * FP32_S + 1 * _cluster().device.efficiency.kernel_overhead_s
    assert fused[0] == pytest.approx(8 * one_add)   # Megatron's hook adds into main_grad, the first too
    assert _priced(framework="megatron-core", micro_batch_size=8)[0] == [pytest.approx(one_add)]


def test_the_embedding_backward_fills_its_vocabulary_shard():
    """torch's dense embedding gradient: a zero-filled vocab/tp x hidden table per micro-batch,
    however few tokens (the gather and scatter-add are the tokens' bytes)."""
    train = TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=DType.FP32)
    dev = _cluster().device.for_dtype(DType.FP32)
    for tp in (1, 2):
        plan = build_plan(MODEL, train, _cluster(tp), Choice(tp=tp, micro_batch_size=1))
        emb = embedding_kernel_times(MODEL, train, plan, dev)
        table = memory_bound_s(4 * -(-MODEL.vocab_size // tp) * MODEL.hidden_size, dev, 1)
        assert emb.backward_weight_s == pytest.approx(2 * emb.forward_s + table)
        assert table > emb.forward_s   # 6,000 words against 256 tokens


def test_the_estimate_books_the_slowest_ranks_accumulation_and_each_ranks_in_its_work():
    train = TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=DType.FP32)
    cluster = _cluster()
    plan = build_plan(MODEL, train, cluster, Choice(pp=2, micro_batch_size=1))
    est = estimate(MODEL, train, cluster, plan)
    accumulate, _ = _priced(pp=2, micro_batch_size=1)
    # the last rank's (its head, norm and optimizer step outweigh the first's embedding)
    assert est.time_breakdown_s["grads/accumulation"] == pytest.approx(accumulate[1])
    sp = spans(plan, cluster)
    stages = [8 * (t.total_s - t.pp_comm_s) for t in (rank_times(MODEL, train, plan, cluster, sp, r) for r in range(2))]
    assert est.rank_work_s == pytest.approx([w + a for w, a in zip(stages, accumulate)])


def test_fsdp2_accumulates_bf16_gradients_in_fp32_between_reductions(group):
    """What the bf16 price assumes of runtime.parallel's FSDP2 (bf16 parameters, fp32 reduce
    dtype): with the reduction off (ZeRO-0/1 between micro-batches, or under a pipeline), each
    micro-batch's bf16 gradient is added into an fp32 accumulator, cast from the first."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    layer.set_requires_gradient_sync(False)
    x = torch.randn(4, 16)
    layer(x).sum().backward()
    accumulated = [p.unsharded_accumulated_grad for p in layer._get_fsdp_state()._fsdp_param_group.fsdp_params]
    assert all(g is not None and g.dtype == torch.float32 for g in accumulated)
    first = accumulated[0].clone()
    layer(x).sum().backward()
    again = layer._get_fsdp_state()._fsdp_param_group.fsdp_params[0].unsharded_accumulated_grad
    assert again.dtype == torch.float32 and torch.allclose(again, 2 * first, rtol=1e-2)


def test_fsdp2_adds_each_reduced_shard_into_an_fp32_sharded_gradient(group):
    """ZeRO-2/3 reducing every micro-batch: the reduced shard, in bf16 here, lands in the fp32
    sharded gradient (the master weight's dtype) and the next one is added there."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    fully_shard(layer, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
    x = torch.randn(4, 16)
    layer(x).sum().backward()
    first = layer.weight.grad.to_local().clone()
    layer(x).sum().backward()
    assert layer.weight.grad.dtype == torch.float32
    assert torch.allclose(layer.weight.grad.to_local(), 2 * first, rtol=1e-2)
