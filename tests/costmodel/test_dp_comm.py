"""Efficiency.dp_comm: data-parallel collectives at a factor of their own over the node tier's
efficiency (a CPU's probes fit it, DP's bucketed collectives being faster per byte than TP's
activation-sized ones): it scales DP's exposed time and nothing else, and a profile holds it."""
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


def _step(dp_comm: float, **choice):
    dev = load_profile(PROFILE)
    dev = replace(dev, efficiency=replace(dev.efficiency, overlap=0.0, dp_comm=dp_comm))
    cluster = ClusterSpec(device=dev, num_nodes=1, devices_per_node=2)
    plan = build_plan(MODEL, TRAIN, cluster, Choice(**choice))
    return estimate(MODEL, TRAIN, cluster, plan)


def test_dp_comm_scales_the_exposed_data_parallel_time_alone():
    slow, fast = _step(1.0, zero_stage=1, micro_batch_size=2), _step(2.0, zero_stage=1, micro_batch_size=2)
    exposed = slow.time_breakdown_s["comm/dp_exposed"]
    assert exposed > 0
    assert fast.time_breakdown_s["comm/dp_exposed"] == pytest.approx(exposed / 2)
    assert fast.step_time_s == pytest.approx(slow.step_time_s - exposed / 2)
    # tensor parallelism's collectives are not DP's
    assert _step(2.0, tp=2, micro_batch_size=2).step_time_s == pytest.approx(_step(1.0, tp=2, micro_batch_size=2).step_time_s)


def test_a_cpu_fits_dp_comm_and_a_gpu_the_overlap():
    cpu = load_profile(PROFILE)
    assert cpu.kind == "cpu" and "dp_comm" in comm_params(cpu) and "overlap" not in comm_params(cpu)
    assert "overlap" in comm_params(replace(cpu, kind="gpu"))


def test_a_profile_holds_dp_comm_and_refuses_a_non_positive_one(tmp_path):
    text = PROFILE.read_text()
    assert "dp_comm" not in text   # a datasheet: 1, one efficiency for every collective
    assert load_profile(PROFILE).efficiency.dp_comm == 1.0
    for value, ok in (("2.5", True), ("0", False)):
        path = tmp_path / f"p{value}.toml"
        path.write_text(re.sub(r"(?m)^(\[efficiency\].*)$", rf"\1\ndp_comm = {value}", text, count=1))
        if ok:
            assert load_profile(path).efficiency.dp_comm == 2.5
        else:
            with pytest.raises(InputError, match="dp_comm"):
                load_profile(path)


def test_calibrating_cpu_runs_keeps_dp_exposed_and_finds_its_factor():
    """On a CPU `planner calibrate` fits dp_comm, not the overlap, and holds the overlap at 0 even
    where an older profile says otherwise (xeon-amx: 1, every DP collective hidden)."""
    from costmodel.plan import PlanFile
    from planner.calibrate import Run, fit_by_dtype, summary
    base = load_profile(PROFILE)
    assert base.efficiency.overlap == 1.0
    truth = replace(base, efficiency=replace(base.efficiency, overlap=0.0, dp_comm=2.0))
    runs = []
    for choice in ({"micro_batch_size": 2}, {"micro_batch_size": 1}, {"zero_stage": 1, "micro_batch_size": 2},
                   {"zero_stage": 1, "micro_batch_size": 1}, {"tp": 2, "micro_batch_size": 2},
                   {"tp": 2, "micro_batch_size": 1}):
        ranks = choice.get("tp", 1) * (2 if "zero_stage" in choice else 1)
        cluster = ClusterSpec(device=base, num_nodes=1, devices_per_node=ranks)
        plan = build_plan(MODEL, TRAIN, cluster, Choice(**choice))
        step = estimate(MODEL, TRAIN, replace(cluster, device=truth), plan).step_time_s
        runs.append(Run(path=Path(f"run{len(runs)}"), pf=PlanFile(plan=plan, model=MODEL, train=TRAIN, cluster=cluster),
                        measured_step_s=step))
    device, params = fit_by_dtype(runs, base, rounds=2, prior_weight=0.0, compute_params=("compute",),
                                  compute_on_one_rank=True)
    assert device.efficiency.overlap == 0.0 and "overlap" not in params
    assert summary(runs, base)["max_abs_error_pct"] > 5   # DP hidden, where it is exposed
    # the links' factors and DP's trade against each other on six runs: the fit, not each factor
    assert summary(runs, device)["max_abs_error_pct"] < 2 and params["dp_comm"] > 1.2
