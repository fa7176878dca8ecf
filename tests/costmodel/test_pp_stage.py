"""Efficiency.pp_stage: a pipeline stage's work at a factor of its own (`planner calibrate` fits
it on a CPU's runs with a pipeline; the probes do not): it scales a pipelined plan's stage work, in
the closed form and the simulation alike, leaves every plan without a pipeline alone, and a
profile holds it."""
from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.cluster import ClusterSpec, load_profile
from costmodel.estimate import estimate
from costmodel.inputs import InputError
from costmodel.registry import llama_spec
from costmodel.specs import TrainSpec
from planner.calibrate import comm_params
from planner.space import Choice, build_plan

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"
MODEL = llama_spec("t-llama", layers=4, hidden=384, heads=6, kv_heads=2, ffn=1024, vocab=6000, max_pos=512,
                   source="test")
TRAIN = TrainSpec(seq_len=256, global_batch_size=8)


def _estimate(pp_stage: float, **choice):
    dev = load_profile(PROFILE)
    dev = replace(dev, efficiency=replace(dev.efficiency, pp_stage=pp_stage))
    cluster = ClusterSpec(device=dev, num_nodes=1, devices_per_node=2)
    plan = build_plan(MODEL, TRAIN, cluster, Choice(**choice))
    return estimate(MODEL, TRAIN, cluster, plan)


def test_pp_stage_scales_a_pipelined_plans_stage_work():
    pp = {"pp": 2, "micro_batch_size": 1}
    base, slow = _estimate(1.0, **pp), _estimate(1.5, **pp)
    for name in ("compute/forward", "compute/backward"):
        assert slow.time_breakdown_s[name] == pytest.approx(1.5 * base.time_breakdown_s[name], rel=1e-6), name
    # the bubble is the other stage's work, less the sends' share of it
    assert slow.time_breakdown_s["pipeline/bubble"] == pytest.approx(1.5 * base.time_breakdown_s["pipeline/bubble"],
                                                                     rel=0.02)
    assert slow.rank_work_s == pytest.approx([1.5 * w for w in base.rank_work_s], rel=1e-6)
    # the closed form the search ranks by moves with the simulation
    assert slow.closed_form_step_time_s > 1.4 * base.closed_form_step_time_s
    # the point-to-point sends and the optimizer are not a stage's work
    assert slow.time_breakdown_s["optimizer/step"] == base.time_breakdown_s["optimizer/step"]


def test_plans_without_a_pipeline_are_left_alone():
    for choice in ({"micro_batch_size": 2, "zero_stage": 1}, {"tp": 2, "micro_batch_size": 2},
                   {"cp": 2, "micro_batch_size": 2}):
        assert _estimate(1.5, **choice).step_time_s == _estimate(1.0, **choice).step_time_s, choice


def test_a_cpu_fits_pp_stage_and_a_profile_holds_it(tmp_path):
    cpu = load_profile(PROFILE)
    assert "pp_stage" in comm_params(cpu) and "pp_stage" not in comm_params(replace(cpu, kind="gpu"))
    text = PROFILE.read_text()
    assert "pp_stage" not in text and cpu.efficiency.pp_stage == 1.0   # a datasheet: 1
    for value, ok in (("1.2", True), ("0", False)):
        path = tmp_path / f"p{value}.toml"
        path.write_text(re.sub(r"(?m)^(\[efficiency\].*)$", rf"\1\npp_stage = {value}", text, count=1))
        if ok:
            assert load_profile(path).efficiency.pp_stage == 1.2
        else:
            with pytest.raises(InputError, match="pp_stage"):
                load_profile(path)


def test_calibrating_cpu_runs_finds_the_stages_factor():
    """Runs whose pipelined stages went 30 % over their price: `planner calibrate` finds it in
    pp_stage, not in the compute the one-rank runs tell; the probes' fit leaves it at 1."""
    from costmodel.plan import PlanFile
    from planner.calibrate import Run, fit_by_dtype, summary
    base = load_profile(PROFILE)
    base = replace(base, efficiency=replace(base.efficiency, overlap=0.0))
    truth = replace(base, efficiency=replace(base.efficiency, pp_stage=1.3))
    runs = []
    for choice in ({"micro_batch_size": 2}, {"micro_batch_size": 1}, {"zero_stage": 1, "micro_batch_size": 2},
                   {"pp": 2, "micro_batch_size": 1}, {"pp": 2, "micro_batch_size": 2}):
        ranks = 1 if len(choice) == 1 else 2
        cluster = ClusterSpec(device=base, num_nodes=1, devices_per_node=ranks)
        plan = build_plan(MODEL, TRAIN, cluster, Choice(**choice))
        step = estimate(MODEL, TRAIN, replace(cluster, device=truth), plan).step_time_s
        runs.append(Run(path=Path(f"run{len(runs)}"), pf=PlanFile(plan=plan, model=MODEL, train=TRAIN, cluster=cluster),
                        measured_step_s=step))
    device, params = fit_by_dtype(runs, base, rounds=2, prior_weight=0.0, compute_params=("compute",),
                                  compute_on_one_rank=True)
    assert summary(runs, base)["max_abs_error_pct"] > 10
    assert summary(runs, device)["max_abs_error_pct"] < 2
    assert params["pp_stage"] == pytest.approx(1.3, rel=0.05)
    assert all(v == pytest.approx(1.0, rel=0.02) for k, v in params.items() if k.startswith("compute@"))
    probes_fit, probe_params = fit_by_dtype(runs, base, rounds=2, prior_weight=0.0, compute_params=("compute",),
                                            compute_on_one_rank=True, fit_pp_stage=False)
    assert probes_fit.efficiency.pp_stage == 1.0 and probe_params["pp_stage"] == 1.0
