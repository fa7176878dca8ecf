"""A run against its profile's moment (planner.machine_speed): the profile's probe layer timed
again after the run, beside the seconds the profile holds for it."""
from __future__ import annotations

from pathlib import Path

import tomlkit

from costmodel.plan import PlanFile
from planner import machine_speed
from planner.cli import main

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"
ENTRY = {"model": "probe-narrow", "micro_batch_size": 2, "seq_len": 32, "gemm_s": 0.004, "sdpa_s": 0.001,
         "memory_s": 0.002}


def _plan(tmp_path: Path, profile: Path, dtype: str) -> PlanFile:
    out = tmp_path / f"{profile.stem}-{dtype}.json"
    assert main(["predict", "--model", "debug-tiny", "--cluster", f"1x1x{profile}", "--dtype", dtype,
                 "--out", str(out), "--json"]) == 0
    return PlanFile.load(out)


def test_a_run_times_the_profiles_probe_layer_again(tmp_path, capsys):
    doc = tomlkit.parse(PROFILE.read_text())
    doc.setdefault("measured", tomlkit.table())["layer_ops"] = {"fp32": ENTRY}
    profile = tmp_path / "box.toml"
    profile.write_text(tomlkit.dumps(doc))
    now_s, then_s = machine_speed.probe_layer_s(_plan(tmp_path, profile, "fp32"), threads=1)
    assert then_s == ENTRY["gemm_s"] + ENTRY["sdpa_s"] + ENTRY["memory_s"] and 0 < now_s < 1
    # no entry for the plan's dtype, or a profile without the layer's timing: nothing to compare
    assert machine_speed.probe_layer_s(_plan(tmp_path, profile, "bf16"), threads=1) is None
    assert machine_speed.probe_layer_s(_plan(tmp_path, PROFILE, "fp32"), threads=1) is None


def test_the_line_names_a_moment_far_from_the_profiles():
    assert "(+50 %); the machine ran slower" in machine_speed.describe([0.015, 0.010])
    assert "(-20 %); the machine ran faster" in machine_speed.describe([0.008, 0.010])
    assert machine_speed.describe([0.0103, 0.010]).endswith("(+3 %)")
