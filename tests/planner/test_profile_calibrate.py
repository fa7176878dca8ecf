"""`planner profile` writes a profile the cost model reads (measured curves used), and
`planner calibrate` fits a profile to runs, never overwriting the original."""
from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.cluster import load_profile, parse_cluster
from costmodel.compute import gemm_s, interpolate
from costmodel.estimate import estimate
from costmodel.plan import PlanFile
from costmodel.registry import resolve_model
from costmodel.specs import DType, TrainSpec
from planner.cli import main
from planner.space import Choice, build_plan


def test_profile_writes_a_usable_measured_profile(tmp_path, capsys):
    out = tmp_path / "box.toml"
    assert main(["profile", "--out", str(out), "--nproc", "2"]) == 0
    raw = tomllib.loads(out.read_text())
    assert raw["device"]["kind"] == "cpu" and raw["measured"]["threads_per_rank"] >= 1
    for key in ("gemm_fp32", "gemm_bf16", "memory_bound", "collective_all_reduce", "collective_p2p"):
        assert len(raw["measured"][key]) >= 8, key
    assert "measured" in raw["efficiency"]["source"] and "planner profile" in raw["measured"]["command"]
    dev = load_profile(out)
    train = TrainSpec(seq_len=128, global_batch_size=8, compute_dtype=DType.FP32)
    small, big = gemm_s(64, 64, 64, dev, train), gemm_s(1024, 1024, 1024, dev, train)
    assert big / small < 4096   # small GEMMs run at a lower measured rate than large ones
    assert main(["predict", "--model", "debug-small", "--cluster", f"1x2x{out}", "--dtype", "fp32",
                 "--json"]) == 0


def test_interpolation_is_log_linear_and_flat_outside():
    curve = ((1e3, 1.0), (1e5, 3.0))
    assert interpolate(curve, 1e4) == pytest.approx(2.0)
    assert interpolate(curve, 1.0) == 1.0 and interpolate(curve, 1e9) == 3.0


def _fake_runs(tmp_path: Path, truth) -> list[Path]:
    """Run directories whose 'measured' step times come from a known profile."""
    model, base = resolve_model("debug-small"), parse_cluster("1x2xlocal")
    dirs = []
    for i, choice in enumerate([Choice(zero_stage=0, micro_batch_size=2), Choice(tp=2), Choice(pp=2),
                                Choice(zero_stage=3), Choice(zero_stage=1, micro_batch_size=4)]):
        train = TrainSpec(seq_len=128, global_batch_size=16, compute_dtype=DType.FP32)
        plan = build_plan(model, train, base, choice)
        pf = PlanFile(plan=plan, model=model, train=train, cluster=base)
        d = tmp_path / f"run{i}"
        pf.save(d / "plan.json")
        est = estimate(model, train, replace(base, device=truth), plan)
        (d / "measured.json").write_text(json.dumps({"step_time_s": est.step_time_s,
                                                     "memory_source": "tensors", "peak_memory_bytes": None}))
        dirs.append(d)
    return dirs


def test_calibrate_recovers_a_known_slowdown_and_keeps_the_original(tmp_path, capsys):
    base = parse_cluster("1x2xlocal").device
    truth = replace(base, efficiency=replace(base.efficiency, gemm=base.efficiency.gemm * 0.5,
                                             attention=base.efficiency.attention * 0.5,
                                             kernel_overhead_s=2e-5))
    runs = _fake_runs(tmp_path, truth)
    before = Path(base.path).read_text()
    out = tmp_path / "cal.toml"
    assert main(["calibrate", *map(str, runs), "--profile", base.path, "--out", str(out)]) == 0
    assert Path(base.path).read_text() == before
    text = capsys.readouterr().out
    after = float(text.split("MAPE")[1].split()[1].rstrip("%"))
    assert after < 2.0
    cal = load_profile(out)
    assert "calibrated" in cal.efficiency.source and cal.name == "cal"
    assert main(["calibrate", *map(str, runs), "--profile", base.path, "--out", base.path]) == 2
