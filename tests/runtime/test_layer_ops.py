"""A probe layer's kernels timed by kind inside a training step (runtime.layer_ops), and the
GEMM and memory factors a CPU profile takes from them (planner.measure.probes.layer_factors)."""
from __future__ import annotations

import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from costmodel.hardware import load_profile
from costmodel.kernels import LAYER_KINDS, layer_kernel_times, layer_parts_s
from costmodel.registry import llama_spec
from costmodel.specs import DType, TrainSpec
from planner.measure import probes
from planner.space import Choice
from runtime.layer_ops import OpTimer, layer_op_seconds, op_kind

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from layer_timing import layer_ops_at  # noqa: E402

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"
# a profile `planner profile` measured on a 2-core EPYC: curves, SDPA points, the probe layer's
# timing and the factors taken from it
MEASURED = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "cpu-epyc-2026-11-28-DA.toml"
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
    assert set(seconds) == set(LAYER_KINDS) and all(0 < s < 1 for s in seconds.values())


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


def test_the_measured_factors_price_the_layer_as_it_was_timed():
    """A profile whose layer timing is the curves' price over (0.9, 0.6) in fp32 and (0.8, 1.2)
    in bf16 gets those factors, and its layer is then priced at the time it was timed."""
    base = probes.unfitted(load_profile(MEASURED), tomllib.loads(MEASURED.read_text())["measured"])
    wanted = {"fp32": {"gemm": 0.9, "memory": 0.6}, "bf16": {"gemm": 0.8, "memory": 1.2}}
    ops = layer_ops_at(base, wanted)
    found = probes.layer_factors(ops, base, "p.toml: [measured] layer_ops", {"fp32", "bf16"})
    for dtype, f in wanted.items():
        assert found[dtype] == pytest.approx(f)
    fitted = probes.with_layer_factors(base, found)
    for dtype in (DType.FP32, DType.BF16):
        own = fitted.for_dtype(dtype)
        own = replace(own, efficiency=replace(own.efficiency, kernel_overhead_s=0.0))
        model, train = probes.WIDE, TrainSpec(seq_len=128, global_batch_size=4, compute_dtype=dtype)
        plan = probes.build_plan(model, train, probes.ClusterSpec(device=base, num_nodes=1, devices_per_node=1),
                                 Choice(micro_batch_size=4))
        layer = layer_kernel_times(model, train, plan, own, False, False, True)
        timed = ops[str(dtype)]
        assert layer.forward_s + layer.backward_input_s + layer.backward_weight_s == \
            pytest.approx(timed["gemm_s"] + timed["sdpa_s"] + timed["memory_s"])


def test_a_measured_profile_holds_the_factors_of_its_layer_timing():
    """What `planner profile` wrote: each dtype's GEMM and memory factors are its probe layer's
    (priced at the profile's own curves over the timing it holds)."""
    raw = tomllib.loads(MEASURED.read_text())
    dev = load_profile(MEASURED)
    found = probes.layer_factors(raw["measured"]["layer_ops"], probes.unfitted(dev, raw["measured"]), str(MEASURED),
                                 {"fp32", "bf16"})
    for dtype in (DType.FP32, DType.BF16):
        eff = dev.for_dtype(dtype).efficiency
        assert (eff.gemm, eff.memory) == pytest.approx(tuple(found[str(dtype)].values()), rel=1e-5)


@pytest.mark.parametrize("broken, says", [
    ({"memory_s": 1e3}, r"fp32: the layer's kernels ran at .*outside 0\.1-3\.0"),   # a stall
    ({"model": "probe-huge"}, r"fp32\.model: 'probe-huge' is not a probe model"),
    ({"model": ["x"]}, r"fp32\.model: \['x'\] is not a probe model"),
    ({"gemm_s": "fast"}, r"fp32\.gemm_s: 'fast' is not a positive number"),
    ({"memory_s": 0.0}, r"fp32\.memory_s: 0\.0 is not a positive number"),
    ({"seq_len": 100000}, r"fp32\.seq_len: 100000 is not a whole number from 1 to 256"),
    ({"micro_batch_size": -1}, r"fp32\.micro_batch_size: -1 is not a whole number"),
])
def test_a_broken_timing_is_refused_naming_the_profile_and_field(broken, says):
    base = load_profile(PROFILE)
    ops = layer_ops_at(base, {"fp32": {"gemm": 1.0, "memory": 1.0}})
    ops["fp32"].update(broken)
    with pytest.raises(ValueError, match=rf"p\.toml: \[measured\] layer_ops\.{says}"):
        probes.layer_factors(ops, base, "p.toml: [measured] layer_ops")


def test_a_timing_must_cover_every_dtype_the_probes_ran():
    base = load_profile(PROFILE)
    ops = layer_ops_at(base, {"fp32": {"gemm": 1.0, "memory": 1.0}})
    with pytest.raises(ValueError, match="layer_ops: no timing for bf16, which the probes ran"):
        probes.layer_factors(ops, base, "p.toml: [measured] layer_ops", {"fp32", "bf16"})
    with pytest.raises(ValueError, match="layer_ops: not a table"):
        probes.layer_factors(5, base, "p.toml: [measured] layer_ops")


def test_a_cpu_fit_without_the_layers_timing_is_refused():
    base = load_profile(PROFILE)
    with pytest.raises(ValueError, match="layer_ops: missing"):
        probes.fit_probes([], base)
