"""A probe layer's kernels timed by kind inside a training step (runtime.layer_ops), and the
GEMM and memory factors a CPU profile takes from them (planner.probes.layer_factors)."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from costmodel.cluster import load_profile
from costmodel.compute import layer_kernel_times, layer_parts_s
from costmodel.registry import llama_spec
from costmodel.specs import DType, TrainSpec
from planner import probes
from planner.space import Choice
from runtime.layer_ops import KINDS, OpTimer, layer_op_seconds, op_kind

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from layer_timing import WIDE_AT_128, layer_ops_at  # noqa: E402

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"
SMALL = llama_spec("ops", layers=1, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=256, max_pos=64, source="test")


def test_each_op_is_priced_as_its_kind():
    assert [op_kind(n) for n in ("mm", "addmm", "_scaled_dot_product_flash_attention_for_cpu_backward",
                                 "mul", "_to_copy", "view", "empty_strided")] == \
        ["gemm", "gemm", "sdpa", "memory", "memory", None, None]


def test_the_timer_adds_each_ops_seconds_to_its_kind():
    a = torch.randn(64, 64)
    with OpTimer() as timer:
        (a @ a).mul(2.0).view(-1)
    assert timer.seconds["gemm"] > 0 and timer.seconds["memory"] > 0 and timer.seconds["sdpa"] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layers_forward_and_backward_is_timed_in_every_kind(dtype):
    seconds = layer_op_seconds(SMALL, dtype, micro_batch_size=2, seq_len=32, repeats=2)
    assert set(seconds) == set(KINDS) and all(0 < s < 1 for s in seconds.values())


def test_the_parts_add_up_to_the_layer_priced_at_the_curves():
    """layer_parts_s is layer_kernel_times' CPU layer split by kind, at factor 1 and no per-kernel cost."""
    base = load_profile(PROFILE)
    for dtype in (DType.FP32, DType.BF16):
        bare = probes.with_layer_factors(base, {str(dtype): {"gemm": 1.0, "memory": 1.0}})
        bare = replace(bare, dtype_efficiency=tuple((d, replace(e, kernel_overhead_s=0.0))
                                                    for d, e in bare.dtype_efficiency))
        model, train = probes.WIDE, TrainSpec(seq_len=128, global_batch_size=4, compute_dtype=dtype)
        plan = probes.build_plan(model, train, probes.ClusterSpec(device=base, num_nodes=1, devices_per_node=1),
                                 Choice(micro_batch_size=4))
        whole = layer_kernel_times(model, train, plan, bare, False, False, True)
        parts = layer_parts_s(model, train, plan, base)
        assert sum(parts.values()) == pytest.approx(whole.forward_s + whole.backward_input_s + whole.backward_weight_s)
        assert all(v > 0 for v in parts.values())


def test_the_factors_are_the_price_over_the_measurement():
    base = load_profile(PROFILE)
    wanted = {"fp32": {"gemm": 0.9, "memory": 0.6}, "bf16": {"gemm": 0.8, "memory": 1.2}}
    found = probes.layer_factors(layer_ops_at(base, wanted), base, "p.toml: [measured] layer_ops")
    for dtype, f in wanted.items():
        assert found[dtype] == pytest.approx(f)
    fitted = probes.with_layer_factors(base, found)
    assert fitted.for_dtype(DType.BF16).efficiency.memory == pytest.approx(1.2)
    assert fitted.for_dtype(DType.FP32).efficiency.gemm == pytest.approx(0.9)


@pytest.mark.parametrize("broken, says", [
    ({"memory_s": 1e3}, "outside"),                # a stall: the kernels at ~0 of their curve
    ({"model": "probe-huge"}, "not a probe layer's timing"),
    ({"gemm_s": "fast"}, "not a probe layer's timing"),
    ({"memory_s": 0.0}, "not a probe layer's timing"),
])
def test_a_broken_timing_is_refused_naming_the_profile(broken, says):
    base = load_profile(PROFILE)
    ops = layer_ops_at(base, {"fp32": {"gemm": 1.0, "memory": 1.0}})
    ops["fp32"].update(broken)
    with pytest.raises(ValueError, match=rf"p\.toml: \[measured\] layer_ops\.fp32: .*{says}"):
        probes.layer_factors(ops, base, "p.toml: [measured] layer_ops")


def test_a_cpu_fit_without_the_layers_timing_is_refused():
    base = load_profile(PROFILE)
    with pytest.raises(ValueError, match="layer_ops: missing"):
        probes.fit_probes([], base)
    assert WIDE_AT_128["model"] == "probe-wide"
