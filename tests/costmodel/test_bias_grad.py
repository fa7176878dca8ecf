"""The dense projections' bias gradients (costmodel.kernels.elementwise.bias_grad_traffic): each a
reduction reading the rank's rows of the projection's output gradient, unless the framework computes
the QKV projection's inside its weight-gradient GEMM (Transformer Engine in Megatron-Core: frameworks
`qkv_bias_grad_in_gemm`; Megatron's bias-GeLU and bias-dropout-add leave the others to autograd)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.frameworks import FRAMEWORKS
from costmodel.hardware import ClusterSpec, resolve_device
from costmodel.kernels import layer_kernel_times
from costmodel.kernels.elementwise import bias_grad_traffic
from costmodel.kernels.roofline import memory_bound_s
from costmodel.registry import gpt_spec, llama_spec
from costmodel.specs import DType, TrainSpec
from planner.space import Choice, build_plan

TRAIN = TrainSpec(seq_len=1024, global_batch_size=8, compute_dtype=DType.BF16)
GPT = gpt_spec("t-gpt", layers=2, hidden=1024, heads=8, vocab=5000, max_pos=1024, ffn=4096, source="test")
LLAMA = llama_spec("t-llama", layers=2, hidden=1024, heads=8, kv_heads=2, ffn=2816, vocab=5000, max_pos=1024,
                   source="test")
H100 = resolve_device("H100")


def _plan(model, tp: int, sp: bool):
    cluster = ClusterSpec(device=H100, num_nodes=1, devices_per_node=tp)
    return build_plan(model, TRAIN, cluster, Choice(tp=tp, sequence_parallel=sp, micro_batch_size=2))


@pytest.mark.parametrize("sp", [True, False])
def test_each_bias_reads_its_output_gradient_on_this_rank(sp):
    tokens, h, f, tp, a = 2048, 1024, 4096, 2, 2
    plan = _plan(GPT, tp, sp)
    # column-parallel QKV and fc1: every token over 1/tp of their outputs; row-parallel proj and fc2:
    # the rank's sequence shard under SP (every token without) over all h outputs
    columns = tokens * (3 * h + f) // tp
    rows = 2 * (tokens // tp if sp else tokens) * h
    assert bias_grad_traffic(GPT, plan, tokens, a) == (a * (columns + rows), 4)
    assert bias_grad_traffic(GPT, plan, tokens, a, qkv_in_gemm=True) == (a * (columns - tokens * 3 * h // tp + rows), 3)


def test_a_model_without_biases_has_none_to_reduce():
    assert bias_grad_traffic(LLAMA, _plan(LLAMA, 2, True), 2048, 2) == (0.0, 0)


def test_megatron_core_computes_the_qkv_bias_gradient_in_its_gemm():
    """Under Megatron-Core's traits a GPT layer's backward reads the QKV gradient once less than
    under a framework that reduces every bias: exactly that reduction's memory time."""
    assert FRAMEWORKS["megatron-core"].qkv_bias_grad_in_gemm and not FRAMEWORKS["megatron-lm"].qkv_bias_grad_in_gemm
    plan = _plan(GPT, 2, True)
    dev = replace(H100, efficiency=replace(H100.efficiency, kernel_overhead_s=0.0))
    reduced, in_gemm = (layer_kernel_times(GPT, TRAIN, plan, dev, False, True, False, False, False, False, False,
                                           False, False, False, False, fused)
                        for fused in (False, True))
    tokens = 2 * 1024
    qkv = 2 * tokens * 3 * 1024 // 2
    assert reduced.forward_s == in_gemm.forward_s
    assert reduced.backward_input_s - in_gemm.backward_input_s == pytest.approx(
        memory_bound_s(qkv, dev, 1), rel=0.02)
