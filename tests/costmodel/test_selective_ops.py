"""torchtitan's per-op selective checkpointing (frameworks `selective_op_policy`,
costmodel.selective_ops): a Llama block keeps its input and the outputs of wq, wv, w1, w2 and the
attention kernel, and re-runs wk, wo, w3 with the elementwise ops; torchtitan's published 8B runs
(docs/performance.md @ d4c86e375 Tables 1 and 3) hold the memory this counts."""
from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.flops import recompute_flops_per_step, selective_layer_flops
from costmodel.frameworks import framework_traits
from costmodel.hardware import parse_cluster
from costmodel.layout import recomputed_linears
from costmodel.memory import layer_activation_bytes
from costmodel.plan import Recompute
from costmodel.rank_time.parts import TimeShape, rank_time_parts
from costmodel.registry import resolve_model
from costmodel.selective_modules import OP_POLICY, module_problems
from costmodel.selective_ops import kept_linears
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

LLAMA8B = resolve_model("llama3-8b")
TRAIN = TrainSpec(seq_len=8192, global_batch_size=256)
TORCHTITAN = framework_traits("torchtitan")


def _priced(traits, recompute=Recompute.SELECTIVE, **kw):
    cluster = replace(parse_cluster("16x8xH100"), framework=traits)
    plan = build_plan(LLAMA8B, TRAIN, cluster, Choice(**{**dict(tp=1, pp=1, zero_stage=3, micro_batch_size=2,
                                                              recompute=recompute), **kw}))
    return cluster, plan


def test_every_second_projection_in_forward_order_is_re_run():
    assert [lin.name for lin in recomputed_linears(LLAMA8B, OP_POLICY)] == ["wk", "wo", "w3"]
    assert [lin.name for lin in kept_linears(LLAMA8B)] == ["wq", "wv", "w1", "w2"]
    gpt = resolve_model("gpt3-175b")
    assert [lin.name for lin in recomputed_linears(gpt, OP_POLICY)] == ["proj", "fc2"]


def test_a_block_keeps_its_input_the_kept_outputs_and_the_attention_s():
    cluster, plan = _priced(TORCHTITAN)
    m, a, tokens = LLAMA8B, 2, 2 * 8192
    h, q, kv, f = m.hidden_size, m.q_hidden_size, m.kv_hidden_size, m.ffn_hidden_size
    expected = (a * tokens * (h + q + kv + f + h) + a * tokens * q + 4.0 * 2 * m.num_heads * 8192
                + 4 * a * 8192 * m.rotary_dims)
    assert layer_activation_bytes(m, TRAIN, plan, Recompute.SELECTIVE, TORCHTITAN) == pytest.approx(expected)
    # Megatron's selective keeps every tensor but the attention core's: about twice as much
    megatron = layer_activation_bytes(m, TRAIN, plan, Recompute.SELECTIVE, framework_traits("megatron-core"))
    assert megatron > 1.8 * expected


def test_under_sequence_parallelism_the_input_is_a_shard_and_the_reduce_scatters_are_kept():
    cluster, plan = _priced(TORCHTITAN, tp=8, sequence_parallel=True)
    m, a, tokens, t = LLAMA8B, 2, 2 * 8192, 8
    h, q, kv, f = m.hidden_size, m.q_hidden_size, m.kv_hidden_size, m.ffn_hidden_size
    kept = a * tokens * (q / t + kv / t + f / t + h)   # w2's partial sums whole
    expected = (a * tokens * h / t + kept + 2 * a * tokens * h / t + a * tokens * q / t
                + 4.0 * 2 * (m.num_heads // t) * 8192 + 4 * a * 8192 * m.rotary_dims)
    assert layer_activation_bytes(m, TRAIN, plan, Recompute.SELECTIVE, TORCHTITAN) == pytest.approx(expected)


def test_the_re_run_costs_the_projections_and_the_elementwise_ops():
    cluster, plan = _priced(TORCHTITAN)
    parts = rank_time_parts(LLAMA8B, TRAIN, cluster).compute(TimeShape.of(plan))
    assert parts.selective_s > 0 and parts.selective_s != parts.layer.attention_forward_s
    per_layer = selective_layer_flops(LLAMA8B, 256, 8192, (OP_POLICY,))
    m = LLAMA8B
    assert per_layer == 2 * 256 * 8192 * (m.hidden_size * m.kv_hidden_size + m.q_hidden_size * m.hidden_size
                                          + m.hidden_size * m.ffn_hidden_size)
    assert recompute_flops_per_step(LLAMA8B, TRAIN, plan, modules=(OP_POLICY,)) == per_layer * m.num_layers
    op, none = estimate(LLAMA8B, TRAIN, cluster, plan), estimate(LLAMA8B, TRAIN, *_priced(TORCHTITAN, Recompute.NONE))
    assert op.executed_flops == op.model_flops + per_layer * m.num_layers
    assert op.step_time_s > none.step_time_s and max(op.peak_memory_bytes) < max(none.peak_memory_bytes)


def test_the_policy_is_not_a_module_a_user_can_name():
    assert any("unknown module 'op_policy'" in p for p in module_problems((OP_POLICY,), "megatron-core"))
