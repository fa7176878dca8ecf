"""Megatron-LM's own model (megatron/model, before Megatron-Core) runs a Llama-style layer's
RMSNorm, RoPE and SwiGLU as torch ops (costmodel.frameworks `llama_ops_eager`), its GPT layer
fused; its QKV and gate/up are one projection each, so autograd adds no gradient sums."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.frameworks import composite_rms_norm, eager_layer_ops, framework_traits
from costmodel.hardware import parse_cluster
from costmodel.kernels import eager_elementwise_traffic
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

LLAMA, GPT = resolve_model("llama2-13b"), resolve_model("gpt3-175b")
TRAIN = TrainSpec(seq_len=4096, global_batch_size=64)


def test_only_a_llama_layer_runs_op_by_op_under_megatron_lm():
    lm, core = framework_traits("megatron-lm"), framework_traits("megatron-core")
    assert eager_layer_ops(lm, LLAMA) and not eager_layer_ops(lm, GPT)
    assert composite_rms_norm(lm)   # megatron/model/rms_norm.py: x.float(), pow, mean, rsqrt, multiply
    assert not eager_layer_ops(core, LLAMA) and not composite_rms_norm(core)   # Transformer Engine's fused layer


def _step_s(model, traits) -> float:
    cluster = replace(parse_cluster("2x8xA800"), framework=traits)
    plan = build_plan(model, TRAIN, cluster, Choice(tp=2, pp=1, zero_stage=1, micro_batch_size=1))
    return estimate(model, TRAIN, cluster, plan).step_time_s


def test_the_torch_ops_cost_a_llama_run_time_and_leave_a_gpt_run_alone():
    lm = framework_traits("megatron-lm")
    fused = replace(lm, llama_ops_eager=False)
    assert _step_s(LLAMA, lm) > 1.05 * _step_s(LLAMA, fused)
    assert _step_s(LLAMA, lm) > _step_s(LLAMA, replace(lm, eager_rms_norm_composite=False))   # apex's fused norm
    small_gpt = replace(GPT, num_layers=4)
    assert _step_s(small_gpt, lm) == pytest.approx(_step_s(small_gpt, fused))


def test_fused_projections_leave_autograd_no_sums():
    """Separate q/k/v and gate/up modules (our runtime's layer) take three sums of their input's
    gradient a layer backward (3 x read two, write one); Megatron's fused QKV and fc1 none."""
    cluster = parse_cluster("1x8xA800")
    plan = build_plan(LLAMA, TRAIN, cluster, Choice(tp=1, micro_batch_size=1))
    tokens = TRAIN.seq_len
    separate = eager_elementwise_traffic(LLAMA, TRAIN, plan, tokens, 2, cpu=False)
    fused = eager_elementwise_traffic(LLAMA, TRAIN, plan, tokens, 2, cpu=False, fused_projections=True)
    assert separate[0] == fused[0] and separate[1] == fused[1]   # forward alike
    assert separate[2] - fused[2] == pytest.approx(3 * 3 * 2 * tokens * LLAMA.hidden_size)
    assert separate[3] - fused[3] == 3
