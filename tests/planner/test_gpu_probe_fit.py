"""The profile's probes on a GPU (planner.measure.probes.compute_params): their small steps are the host's
alone, so the fit finds the host's per-kernel and per-step costs and leaves the measured rates alone. The profile is
the one `planner profile` wrote on an H100 (H100: benchmarks/results/gpu-check-h100-*/run2/gpu.toml)."""
from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.hardware import load_profile
from planner.measure import probes
from planner.measure.calibrate import Run, predict_with, with_params

H100 = Path(__file__).parents[2] / "benchmarks" / "results" / "gpu-check-h100-2026-11-26" / "run2" / "gpu.toml"


def test_a_gpu_probe_fit_recovers_the_host_costs_and_keeps_the_rates():
    base = probes.unfitted(load_profile(H100), tomllib.loads(H100.read_text())["measured"])
    assert probes.compute_params(base) == ("kernel_overhead_s", "step_overhead_s")
    assert probes.compute_params(replace(base, kind="cpu")) == ("kernel_overhead_s", "step_overhead_s")
    truth = base
    for dtype, seconds, step_s in (("fp32", 40e-6, 1e-3), ("bf16", 60e-6, 4e-3)):
        truth = with_params(truth, {"compute": 1.0, "memory": 1.0, "kernel_overhead_s": seconds,
                                    "step_overhead_s": step_s}, dtype)
    plans = probes.probe_plans(base, {"fp32": True, "bf16": True}, 1)
    measured = [probes.ProbeResult(pf, predict_with(Run(path=Path("p"), pf=pf, measured_step_s=1.0), truth).step_time_s)
                for pf in plans]
    # the fit starts at no per-kernel cost, where the loss is flat (the device's work hides a
    # small one): it must still find it, and tell it from the per-step cost
    _, params, _, after = probes.fit_probes(measured, base)
    assert params["kernel_overhead_s@fp32"] == pytest.approx(40e-6, rel=0.05)
    assert params["kernel_overhead_s@bf16"] == pytest.approx(60e-6, rel=0.05)
    assert params["step_overhead_s@fp32"] == pytest.approx(1e-3, rel=0.1)
    assert params["step_overhead_s@bf16"] == pytest.approx(4e-3, rel=0.1)
    assert params["compute@bf16"] == 1.0 and params["memory@bf16"] == 1.0
    assert after["mape_pct"] < 1.0


def test_a_fitted_per_step_cost_is_written_and_read_back(tmp_path):
    import tomlkit

    from planner.measure import profile_doc, profile_file
    device, *_ = probes.refit_stored(H100)
    raw = tomllib.loads(H100.read_text())
    micro = {"attention": raw["measured"]["attention_efficiency"], "overhead_s": raw["measured"]["op_overhead_s"]}
    doc = profile_file.document(["test"])
    doc.add("efficiency", profile_doc._efficiency(micro, device, "test", 12, "cuda"))
    raw["efficiency"] = tomllib.loads(tomlkit.dumps(doc))["efficiency"]
    (tmp_path / "p.toml").write_text(tomlkit.dumps(raw))
    back = dict(load_profile(tmp_path / "p.toml").dtype_efficiency)["bf16"]
    assert back.step_overhead_s == pytest.approx(dict(device.dtype_efficiency)["bf16"].step_overhead_s, rel=1e-5)
    assert back.step_overhead_s > 1e-3   # the H100's bf16 probes: 4.4 ms



def test_a_gpu_profiles_attention_ratio_is_a_long_sequences_and_not_counted_twice():
    """The profiler divides each GPU shape's SDPA / GEMM ratio by the flash tile efficiency at its
    length and says so (`attention_long_sequence`); the H100 profile above predates that, so its
    raw median (between the 2k and 4k shapes) is divided by their tile efficiency when read back.
    CPU ratios are never divided (no tile model on a CPU)."""
    from costmodel.kernels import flash_tile_efficiency
    device = load_profile(H100)
    measured = tomllib.loads(H100.read_text())["measured"]
    raw = measured["attention_efficiency"]["fp32"]
    assert "attention_long_sequence" not in measured
    legacy = (flash_tile_efficiency(2048) + flash_tile_efficiency(4096)) / 2
    assert probes.unfitted(device, measured).efficiency.attention == pytest.approx(raw / legacy)
    assert probes.long_sequence_attention(raw, device, {**measured, "attention_long_sequence": True}) == raw
    assert probes.long_sequence_attention(raw, replace(device, kind="cpu"), measured) == raw


def test_a_gpu_profile_measures_and_writes_its_attention_backward_ratio(tmp_path, monkeypatch):
    """`planner profile` on a GPU times causal SDPA's backward beside its forward (runtime.profiler.
    attention_efficiency, run here on the CPU at small shapes) and writes their rate ratio as
    [efficiency] attention_backward_ratio, which the pricing applies to every backward; a profile
    written before (the stored H100's) has none and prices the backward at the forward's rate."""
    import tomlkit
    import torch

    from planner.measure import profile_doc, profile_file
    from runtime.profiler import attention as profiler_attention
    monkeypatch.setattr(profiler_attention, "GPU_ATTENTION_SHAPES", ((1, 2, 128, 32), (1, 2, 256, 32)))
    gemm = ((1e6, 1e10), (1e9, 2e10))
    forward, backward = profiler_attention.attention_efficiency(torch.float32, torch.device("cpu"), gemm, 30.0, 1.0)
    assert forward > 0 and 0 < backward <= 1

    device, *_ = probes.refit_stored(H100)
    assert device.efficiency.attention_backward_ratio == 1.0
    raw = tomllib.loads(H100.read_text())
    micro = {"attention": raw["measured"]["attention_efficiency"], "overhead_s": raw["measured"]["op_overhead_s"],
             "attention_backward": {"fp32": 0.8, "bf16": 0.85}}
    doc = profile_file.document(["test"])
    doc.add("efficiency", profile_doc._efficiency(micro, device, "test", 12, "cuda"))
    raw["efficiency"] = tomllib.loads(tomlkit.dumps(doc))["efficiency"]
    (tmp_path / "p.toml").write_text(tomlkit.dumps(raw))
    loaded = load_profile(tmp_path / "p.toml")
    assert loaded.efficiency.attention_backward_ratio == pytest.approx(0.8)
    assert dict(loaded.dtype_efficiency)["bf16"].attention_backward_ratio == pytest.approx(0.8)
