"""A fitted profile stays one the reader accepts: the fit keeps a link at or below its own
microbenchmark, and the one writer (planner.profile_file.write) refuses what the reader would."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.cluster import load_profile
from costmodel.inputs import InputError
from planner import probes, profile_file
from planner.calibrate import Run, fit, predict_with

XEON = Path(__file__).parents[2] / "profiles" / "xeon-amx.toml"


def _step_s(pf, device) -> float:
    return predict_with(Run(path=Path("p"), pf=pf, measured_step_s=1.0), device).step_time_s


def test_collectives_faster_than_their_microbenchmark_stay_at_efficiency_one(tmp_path):
    """Probes measured on a loaded machine can make the training step's collectives look faster
    than the microbenchmark's: the fit stops at efficiency 1 (what the reader accepts), and the
    writer refuses a profile the reader would refuse, naming the number."""
    base = load_profile(XEON)
    base = replace(base, intra_node=replace(base.intra_node, efficiency=1.0))
    truth = replace(base, intra_node=replace(base.intra_node, efficiency=2.0))   # not a valid profile
    plans = probes.probe_plans(base, {"fp32": True}, 2)
    runs = [Run(path=Path("p"), pf=pf, measured_step_s=_step_s(pf, truth)) for pf in plans]
    assert runs
    device, params = fit(runs, base, ("intra_node_comm",))
    assert params["intra_node_comm"] <= 1.0 + 1e-9 and device.intra_node.efficiency <= 1.0 + 1e-9
    doc = profile_file.parse(XEON.read_text())
    doc["efficiency"]["intra_node_comm"] = 2.0
    with pytest.raises(InputError, match="efficiency = 2.0 is out of range"):
        profile_file.write(tmp_path / "bad.toml", doc)
    assert not (tmp_path / "bad.toml").exists()
