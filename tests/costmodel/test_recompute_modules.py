"""Megatron-Core's selective recomputation by module (--recompute-modules; frameworks
`selective_modules`): each module keeps its inputs only, tensor by tensor as
costmodel.memory.activations counts them, and re-runs its forward in backward
(costmodel.kernels.recompute_modules); the runs table's column says which a run recomputed."""
from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.flops import attention_core_forward_flops, selective_layer_flops
from costmodel.frameworks import framework_traits
from costmodel.hardware import parse_cluster
from costmodel.inputs import UserError
from costmodel.kernels import expert_rows
from costmodel.kernels.recompute_modules import module_forward_s
from costmodel.memory import layer_activation_bytes
from costmodel.plan import Recompute
from costmodel.rank_time import rank_time_model, spans
from costmodel.rank_time.parts import TimeShape, rank_time_parts
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.measure.row_traits import _recompute_modules
from planner.space import Choice, build_plan

DEEPSEEK, LLAMA = resolve_model("deepseek-v3"), resolve_model("llama-70b")
TRAIN = TrainSpec(seq_len=4096, global_batch_size=1024)
MEGATRON = framework_traits("megatron-core")


def _cluster(modules: tuple[str, ...], nodes: int = 32):
    return replace(parse_cluster(f"{nodes}x8xH100"), framework=replace(MEGATRON, selective_modules=modules))


def _plan(model, cluster, **kw):
    choice = dict(tp=1, pp=8, ep=32, zero_stage=1, micro_batch_size=1, recompute=Recompute.SELECTIVE) \
        if model.is_moe else dict(tp=8, pp=4, zero_stage=1, micro_batch_size=1, sequence_parallel=True,
                                  recompute=Recompute.SELECTIVE)
    return build_plan(model, TRAIN, cluster, Choice(**{**choice, **kw}))


def _kept(model, modules, **kw) -> float:
    cluster = _cluster(modules)
    plan = _plan(model, cluster, **kw)
    return layer_activation_bytes(model, TRAIN, plan, Recompute.SELECTIVE, cluster.framework)


def test_mla_up_proj_frees_the_heads_q_k_v_and_the_normed_latents():
    m, tokens, a = DEEPSEEK, 4096, 2
    freed = a * tokens * ((m.q_lora_rank + m.kv_lora_rank)
                          + m.num_heads * (2 * m.head_dim + m.value_head_dim))
    assert _kept(m, ()) - _kept(m, ("mla_up_proj",)) == pytest.approx(freed)


def test_mlp_frees_a_dense_mlp_and_leaves_a_mixture_as_it_is():
    m = LLAMA
    tokens, t = 4096, 8
    fused_swiglu = MEGATRON.swiglu_saved_tensors   # 2f wide fc1 output and the product, bf16
    assert _kept(m, ()) - _kept(m, ("mlp",)) == pytest.approx(2 * fused_swiglu * tokens * m.ffn_hidden_size / t)
    assert _kept(DEEPSEEK, ("mlp",)) == _kept(DEEPSEEK, ())


def test_moe_act_frees_the_experts_fc2_input_and_layernorm_the_norms_apart_from_a_linear():
    m = DEEPSEEK
    rows = expert_rows(m, TRAIN, 4096, 32)   # the device's routed rows, each f wide in bf16
    assert _kept(m, ()) - _kept(m, ("moe_act",)) == pytest.approx(2 * rows * m.moe_ffn_hidden_size)
    # a dense model's norms are fused into its linears (Transformer Engine): nothing to free
    assert _kept(LLAMA, ("layernorm",)) == _kept(LLAMA, ())
    h, tokens = m.hidden_size, 4096
    assert _kept(m, ()) - _kept(m, ("layernorm",)) == pytest.approx(2 * 2 * tokens * h)


def test_each_module_re_runs_its_forward():
    cluster = _cluster(("core_attn",))
    plan = _plan(DEEPSEEK, cluster)
    parts = rank_time_parts(DEEPSEEK, TRAIN, cluster).compute(TimeShape.of(plan))
    layer, dev = parts.layer, cluster.device
    args = (DEEPSEEK, TRAIN, plan, dev)
    assert module_forward_s(*args, "core_attn", layer, True) == layer.attention_forward_s
    assert parts.selective_s == layer.attention_forward_s
    assert module_forward_s(*args, "mla_up_proj", layer, True) > 0
    assert module_forward_s(*args, "mlp", layer, True) == 0.0   # an expert layer has no dense MLP
    assert module_forward_s(LLAMA, TRAIN, _plan(LLAMA, cluster), dev, "mla_up_proj", layer, True) == 0.0


def test_recomputing_more_modules_costs_time_and_frees_memory():
    def priced(modules):
        cluster = _cluster(modules)
        plan = _plan(DEEPSEEK, cluster)
        return estimate(DEEPSEEK, TRAIN, cluster, plan)
    core, more = priced(("core_attn",)), priced(("core_attn", "mla_up_proj", "mlp"))
    assert more.step_time_s > core.step_time_s
    assert max(more.peak_memory_bytes) < max(core.peak_memory_bytes)
    assert more.executed_flops > core.executed_flops


def test_the_flops_of_the_up_projections_and_of_a_dense_mlp():
    m, b, s = DEEPSEEK, 1, 4096
    up = 2 * b * s * (m.q_lora_rank * m.num_heads * m.head_dim
                      + m.kv_lora_rank * m.num_heads * (m.qk_nope_head_dim + m.value_head_dim))
    assert selective_layer_flops(m, b, s, ("mla_up_proj",)) == up
    assert selective_layer_flops(m, b, s, ("core_attn",)) == attention_core_forward_flops(m, b, s)
    assert selective_layer_flops(LLAMA, b, s, ("mlp",)) == 2 * b * s * 3 * LLAMA.hidden_size * LLAMA.ffn_hidden_size


ROW = {"id": "r", "framework": "megatron-core", "recompute": "selective", "recompute_modules": "mla_up_proj+mlp"}


@pytest.mark.parametrize("change,model,message", [
    ({"framework": "torchtitan"}, DEEPSEEK, "torchtitan has no such option"),
    ({"recompute": "full"}, DEEPSEEK, "needs recompute = selective"),
    ({"recompute_modules": "mla_up_proj+moe"}, DEEPSEEK, "does not price recomputing 'moe'"),
    ({"recompute_modules": "attn"}, DEEPSEEK, "unknown module 'attn'"),
    ({"recompute_modules": "mlp+mlp"}, DEEPSEEK, "named twice"),
    ({}, LLAMA, "mla_up_proj needs multi-latent attention"),
    ({"recompute_modules": "moe_act"}, LLAMA, "moe_act needs a mixture of experts"),
])
def test_a_row_names_modules_megatron_core_recomputes(change, model, message):
    row = {**ROW, **change}
    with pytest.raises(UserError, match=message):
        _recompute_modules(row, framework_traits(row["framework"]), model)
    assert _recompute_modules(ROW, MEGATRON, DEEPSEEK) == ("mla_up_proj", "mlp")


def test_a_dense_mlp_re_run_repeats_its_tp_collectives():
    """Megatron-Core checkpoints the whole MLP, its column-parallel fc1's all-gather (SP) and its
    row-parallel fc2's reduce-scatter included: the re-run pays them again (exposed as the
    framework leaves them), where the attention core's re-run has none."""
    def recomputed(modules):
        cluster = _cluster(modules)
        plan = _plan(LLAMA, cluster)
        return rank_time_model(LLAMA, TRAIN, plan, cluster, spans(plan, cluster)).per_recomputed_layer
    assert recomputed(("core_attn",)).tp_comm_s == 0.0
    assert recomputed(("core_attn", "mlp")).tp_comm_s > 0.0
    assert recomputed(("core_attn", "mlp")).recompute_s > recomputed(("core_attn",)).recompute_s
