"""A run against its profile's moment (planner.measure.machine_speed): the profile's probe layer timed
again after the run, beside the seconds the profile holds for it."""
from __future__ import annotations

from pathlib import Path

import pytest
import tomlkit

from costmodel.plan import PlanFile
from planner.cli import main
from planner.measure import machine_speed

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"
ENTRY = {"model": "probe-narrow", "micro_batch_size": 2, "seq_len": 32, "gemm_s": 0.004, "sdpa_s": 0.001,
         "memory_s": 0.002}


def _profile(tmp_path: Path, layer_ops) -> Path:
    doc = tomlkit.parse(PROFILE.read_text())
    doc.setdefault("measured", tomlkit.table())["layer_ops"] = layer_ops
    path = tmp_path / "box.toml"
    path.write_text(tomlkit.dumps(doc))
    return path


def _plan(tmp_path: Path, profile: Path, dtype: str) -> PlanFile:
    out = tmp_path / f"{profile.stem}-{dtype}.json"
    assert main(["predict", "--model", "debug-tiny", "--cluster", f"1x1x{profile}", "--dtype", dtype,
                 "--out", str(out), "--json", "--overwrite"]) == 0
    return PlanFile.load(out)


def test_a_run_times_the_profiles_probe_layer_again(tmp_path):
    profile = _profile(tmp_path, {"fp32": ENTRY})
    now_s, then_s = machine_speed.probe_layer_s(_plan(tmp_path, profile, "fp32"), threads=1)
    assert then_s == pytest.approx(ENTRY["gemm_s"] + ENTRY["sdpa_s"] + ENTRY["memory_s"]) and 0 < now_s < 1
    # no entry for the plan's dtype, or a profile without the layer's timing: nothing to compare
    assert machine_speed.probe_layer_s(_plan(tmp_path, profile, "bf16"), threads=1) is None
    assert machine_speed.probe_layer_s(_plan(tmp_path, PROFILE, "fp32"), threads=1) is None


@pytest.mark.parametrize("layer_ops, says", [
    ({"fp32": {**ENTRY, "seq_len": "x"}}, r"layer_ops\.fp32\.seq_len: 'x' is not a whole number"),
    ({"fp32": {**ENTRY, "gemm_s": -1.0}}, r"layer_ops\.fp32\.gemm_s: -1\.0 is not a positive number"),
    ({"fp32": 5}, r"layer_ops\.fp32: not a table"),
])
def test_a_malformed_timing_is_named_not_a_traceback(tmp_path, layer_ops, says):
    profile = _profile(tmp_path, {"bf16": ENTRY})   # a well-formed one to plan with
    pf = _plan(tmp_path, profile, "fp32")
    _profile(tmp_path, layer_ops)   # the same file, now malformed
    with pytest.raises(ValueError, match=rf"box\.toml: \[measured\] {says}"):
        machine_speed.probe_layer_s(pf, threads=1)


def test_the_line_names_a_moment_far_from_the_profiles():
    assert "(+50 %); the machine ran slower" in machine_speed.describe(0.015, 0.010)
    assert "(-20 %); the machine ran faster" in machine_speed.describe(0.008, 0.010)
    assert machine_speed.describe(0.0103, 0.010).endswith("(+3 %)")
