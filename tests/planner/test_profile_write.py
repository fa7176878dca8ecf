"""A fitted profile stays one the reader accepts: the fit keeps a link at or below its own
microbenchmark, and the one writer (planner.measure.profile_file.write) refuses what the reader would."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.hardware import load_profile
from costmodel.inputs import UserError
from planner.measure import probes, profile_file
from planner.measure.calibrate import Run, fit, predict_with

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
    with pytest.raises(UserError, match="efficiency = 2.0 is out of range"):
        profile_file.write(tmp_path / "bad.toml", doc)
    assert not (tmp_path / "bad.toml").exists()


def test_the_links_come_from_the_tp_probes_not_the_pipelines_unpriced_work():
    """A pipeline stage's per-micro-batch work is priced nowhere (the PP probe runs over its
    price on a CPU): fitted on every multi-rank probe, the links' latency and bandwidth would take
    it on, and TP plans be priced for it. From the TP probes alone
    (links_from_tp, a CPU's probe fit) the links are the TP probes' own."""
    from planner.measure.calibrate import fit_by_dtype
    base = load_profile(XEON)
    base = replace(base, intra_node=replace(base.intra_node, efficiency=1.0))
    truth = replace(base, intra_node=replace(base.intra_node, efficiency=0.2,
                                             latency_s=8 * base.intra_node.latency_s))
    plans = probes.probe_plans(base, {"fp32": True, "bf16": True}, 2)
    runs = [Run(path=Path("p"), pf=pf, measured_step_s=_step_s(pf, truth) * (1.4 if pf.plan.pp > 1 else 1.0))
            for pf in plans]
    assert any(r.pf.plan.tp > 1 for r in runs) and any(r.pf.plan.pp > 1 for r in runs)

    def tp_error(links_from_tp: bool) -> float:
        device, _ = fit_by_dtype(runs, base, rounds=1, prior_weight=0.0, compute_on_one_rank=True,
                                 fit_pp_stage=False, links_from_tp=links_from_tp)
        return max(abs(_step_s(r.pf, device) / _step_s(r.pf, truth) - 1) for r in runs if r.pf.plan.tp > 1)
    assert tp_error(True) < 0.02 < tp_error(False)


def test_one_tp_step_cannot_set_the_links_alone():
    """Two link factors need two different TP steps: with one (a short budget), every factor is
    fitted on every multi-rank run as before links_from_tp."""
    from planner.measure.calibrate import _comm_fits
    base = load_profile(XEON)
    plans = probes.probe_plans(base, {"fp32": True, "bf16": True}, 2)
    runs = [Run(path=Path("p"), pf=pf, measured_step_s=1.0) for pf in plans]
    two = _comm_fits(runs, base, fit_pp_stage=False, links_from_tp=True)
    assert [names for _, names in two] == [("intra_node_comm", "comm_latency"), ("dp_comm",)]
    assert all(r.pf.plan.tp > 1 for r in two[0][0])
    one_tp = [r for r in runs if r.pf.plan.tp == 1 or (str(r.pf.train.compute_dtype) == "fp32"
                                                       and r.pf.model.name == "probe-wide")]
    assert sum(r.pf.plan.tp > 1 for r in one_tp) == 1
    assert _comm_fits(one_tp, base, fit_pp_stage=False, links_from_tp=True) == [
        (one_tp, ("intra_node_comm", "comm_latency", "dp_comm"))]
