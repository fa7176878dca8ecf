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
