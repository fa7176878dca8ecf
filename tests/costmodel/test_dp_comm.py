"""Efficiency.dp_comm: data-parallel collectives at a factor of their own over the node tier's
efficiency (a CPU's probes fit it, DP's bucketed collectives being faster per byte than TP's
activation-sized ones): it scales DP's exposed time and nothing else, and a profile holds it.
Efficiency.pp_stage: a pipeline stage's work at a factor of its own (`planner calibrate` fits it
on a CPU's runs with a pipeline; the probes do not): it scales a pipelined plan's stage work, in
the closed form and the simulation alike, and leaves every plan without a pipeline alone."""
from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.estimate import estimate
from costmodel.hardware import ClusterSpec, load_profile
from costmodel.inputs import UserError
from costmodel.params import rank_params
from costmodel.rank_time import grad_accumulation_s, one_replica_fsdp_parts_s
from costmodel.registry import llama_spec
from costmodel.specs import TrainSpec
from planner.measure.calibrate import comm_params
from planner.space import Choice, build_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from layer_timing import layer_ops_at  # noqa: E402

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"
MODEL = llama_spec("t-llama", layers=4, hidden=384, heads=6, kv_heads=2, ffn=1024, vocab=6000, max_pos=512,
                   source="test")
TRAIN = TrainSpec(seq_len=256, global_batch_size=8)


def _step(dp_comm: float, pp_stage: float = 1.0, **choice):
    dev = load_profile(PROFILE)
    dev = replace(dev, efficiency=replace(dev.efficiency, overlap=0.0, dp_comm=dp_comm, pp_stage=pp_stage))
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


@pytest.mark.parametrize("key", ["dp_comm", "pp_stage"])
def test_a_profile_holds_the_factor_and_refuses_a_non_positive_one(tmp_path, key):
    text = PROFILE.read_text()
    assert key not in text   # a datasheet: 1 (one efficiency for every collective; stages as priced)
    assert getattr(load_profile(PROFILE).efficiency, key) == 1.0
    for value, ok in (("2.5", True), ("0", False)):
        path = tmp_path / f"p{value}.toml"
        path.write_text(re.sub(r"(?m)^(\[efficiency\].*)$", rf"\1\n{key} = {value}", text, count=1))
        if ok:
            assert getattr(load_profile(path).efficiency, key) == 2.5
        else:
            with pytest.raises(UserError, match=key):
                load_profile(path)


def test_calibrating_cpu_runs_keeps_dp_exposed_and_finds_its_factor():
    """On a CPU `planner calibrate` fits dp_comm, not the overlap, and holds the overlap at 0 even
    where an older profile says otherwise (xeon-amx: 1, every DP collective hidden)."""
    from planner.measure.calibrate import fit_by_dtype, summary
    base = load_profile(PROFILE)
    assert base.efficiency.overlap == 1.0
    truth = replace(base, efficiency=replace(base.efficiency, overlap=0.0, dp_comm=2.0))
    runs = _runs(base, truth, ({"micro_batch_size": 2}, {"micro_batch_size": 1},
                               {"zero_stage": 1, "micro_batch_size": 2}, {"zero_stage": 1, "micro_batch_size": 1},
                               {"tp": 2, "micro_batch_size": 2}, {"tp": 2, "micro_batch_size": 1}))
    device, params = fit_by_dtype(runs, base, rounds=2, prior_weight=0.0, compute_params=("compute",),
                                  compute_on_one_rank=True)
    assert device.efficiency.overlap == 0.0 and "overlap" not in params
    assert summary(runs, base)["max_abs_error_pct"] > 5   # DP hidden, where it is exposed
    # the links' factors and DP's trade against each other on six runs: the fit, not each factor
    assert summary(runs, device)["max_abs_error_pct"] < 2 and params["dp_comm"] > 1.2


def test_pp_stage_scales_a_pipelined_plans_stage_work():
    pp = {"pp": 2, "micro_batch_size": 1}
    base, slow = _step(1.0, 1.0, **pp), _step(1.0, 1.5, **pp)
    for name in ("compute/forward", "compute/backward"):
        assert slow.time_breakdown_s[name] == pytest.approx(1.5 * base.time_breakdown_s[name], rel=1e-6), name
    # the bubble is the other stage's work, less the sends' share of it
    assert slow.time_breakdown_s["pipeline/bubble"] == pytest.approx(1.5 * base.time_breakdown_s["pipeline/bubble"],
                                                                     rel=0.02)
    # a rank's work is its stages' (scaled), its gradient accumulation and FSDP's one-rank gathers
    # (not a stage's kernels; the pipeline's reduce is its DP sync)
    cluster = ClusterSpec(device=load_profile(PROFILE), num_nodes=1, devices_per_node=2)
    plan = build_plan(MODEL, TRAIN, cluster, Choice(**pp))
    held = [rank_params(MODEL, plan, r) for r in range(2)]
    accumulate = [grad_accumulation_s(MODEL, TRAIN, plan, cluster, held[r], plan.layers_on_rank(r)) for r in range(2)]
    fsdp = [one_replica_fsdp_parts_s(MODEL, TRAIN, plan, cluster, held[r], plan.layers_on_rank(r))[1] for r in range(2)]
    assert min(accumulate) > 0 and max(accumulate) == pytest.approx(base.time_breakdown_s["grads/accumulation"])
    assert slow.rank_work_s == pytest.approx([1.5 * (w - a - f) + a + f
                                              for w, a, f in zip(base.rank_work_s, accumulate, fsdp)], rel=1e-6)
    # the closed form the search ranks by moves with the simulation
    assert slow.closed_form_step_time_s > 1.35 * base.closed_form_step_time_s   # 1.0 if it did not
    # the point-to-point sends and the optimizer are not a stage's work
    for name in ("comm/pp_exposed", "optimizer/step", "grads/accumulation", "grads/fsdp_one_rank"):
        assert slow.time_breakdown_s[name] == base.time_breakdown_s[name], name


def test_plans_without_a_pipeline_are_left_alone():
    for choice in ({"micro_batch_size": 2, "zero_stage": 1}, {"tp": 2, "micro_batch_size": 2},
                   {"cp": 2, "micro_batch_size": 2}):
        assert _step(1.0, 1.5, **choice).step_time_s == _step(1.0, 1.0, **choice).step_time_s, choice


def test_a_cpu_fits_pp_stage_and_a_gpu_does_not():
    cpu = load_profile(PROFILE)   # a profile holds it: test_dp_comm.py's profile test
    assert "pp_stage" in comm_params(cpu) and "pp_stage" not in comm_params(replace(cpu, kind="gpu"))


def test_calibrating_cpu_runs_finds_the_stages_factor():
    """Runs whose pipelined stages went 30 % over their price: `planner calibrate` finds it in
    pp_stage, not in the compute the one-rank runs tell; the probes' fit leaves it at 1."""
    from planner.measure.calibrate import fit_by_dtype, summary
    base = load_profile(PROFILE)
    base = replace(base, efficiency=replace(base.efficiency, overlap=0.0))
    truth = replace(base, efficiency=replace(base.efficiency, pp_stage=1.3))
    runs = _runs(base, truth, ({"micro_batch_size": 2}, {"micro_batch_size": 1},
                               {"zero_stage": 1, "micro_batch_size": 2}, {"pp": 2, "micro_batch_size": 1},
                               {"pp": 2, "micro_batch_size": 2}))
    device, params = fit_by_dtype(runs, base, rounds=2, prior_weight=0.0, compute_params=("compute",),
                                  compute_on_one_rank=True)
    assert summary(runs, base)["max_abs_error_pct"] > 10
    assert summary(runs, device)["max_abs_error_pct"] < 2
    assert params["pp_stage"] == pytest.approx(1.3, rel=0.05)
    assert all(v == pytest.approx(1.0, rel=0.02) for k, v in params.items() if k.startswith("compute@"))
    probes_fit, probe_params = fit_by_dtype(runs, base, rounds=2, prior_weight=0.0, compute_params=("compute",),
                                            compute_on_one_rank=True, fit_pp_stage=False)
    assert probes_fit.efficiency.pp_stage == 1.0 and "pp_stage" not in probe_params
    # as `planner calibrate` runs it (its prior, compute fitted on every run): the stages still
    # go to pp_stage; and runs without a pipeline leave it alone, unreported
    device, params = fit_by_dtype(runs, base)
    assert params["pp_stage"] > 1.15
    device, params = fit_by_dtype([r for r in runs if r.pf.plan.pp == 1], base)
    assert device.efficiency.pp_stage == 1.0 and "pp_stage" not in params


def test_later_rounds_keep_the_factors_within_their_bounds_against_the_base():
    """A second round fits on the first's device: its factors multiply the first's, and the
    product stays inside BOUNDS (stages 3x over their price once ended at pp_stage 2.4 > 2.0)."""
    from planner.measure.calibrate import BOUNDS, fit_by_dtype
    base = load_profile(PROFILE)
    base = replace(base, efficiency=replace(base.efficiency, overlap=0.0))
    truth = replace(base, efficiency=replace(base.efficiency, pp_stage=3.0))
    runs = _runs(base, truth, ({"micro_batch_size": 2}, {"micro_batch_size": 1}, {"pp": 2, "micro_batch_size": 1},
                               {"pp": 2, "micro_batch_size": 2}))
    device, params = fit_by_dtype(runs, base, rounds=3, prior_weight=0.0, compute_params=("compute",))
    for name, factor in params.items():
        lo, hi = BOUNDS[name.split("@")[0]]
        assert lo * (1 - 1e-9) <= factor <= hi * (1 + 1e-9), name
    assert params["pp_stage"] == pytest.approx(BOUNDS["pp_stage"][1], rel=0.02)   # at its bound: the runs ask more


def _runs(base, truth, choices) -> list:
    """Runs of `choices` on `base`'s device as `truth` prices them: measurements a fit should find."""
    from costmodel.plan import PlanFile
    from planner.measure.calibrate import Run
    runs = []
    for choice in choices:
        ranks = choice.get("tp", 1) * choice.get("pp", 1) * (2 if "zero_stage" in choice else 1)
        cluster = ClusterSpec(device=base, num_nodes=1, devices_per_node=ranks)
        plan = build_plan(MODEL, TRAIN, cluster, Choice(**choice))
        step = estimate(MODEL, TRAIN, replace(cluster, device=truth), plan).step_time_s
        runs.append(Run(path=Path(f"run{len(runs)}"), pf=PlanFile(plan=plan, model=MODEL, train=TRAIN, cluster=cluster),
                        measured_step_s=step))
    return runs


def test_the_probes_fit_leaves_pp_stage_at_1():
    """planner.measure.probes.fit_probes passes fit_pp_stage=False: its one PP probe a dtype is too noisy
    for the stages' factor, even where that probe ran 30 % over its price."""
    from planner.measure.probes import ProbeResult, fit_probes
    base = load_profile(PROFILE)
    base = replace(base, efficiency=replace(base.efficiency, overlap=0.0))
    truth = replace(base, efficiency=replace(base.efficiency, pp_stage=1.3))
    runs = _runs(base, truth, ({"micro_batch_size": 2}, {"micro_batch_size": 1},
                               {"zero_stage": 1, "micro_batch_size": 2}, {"pp": 2, "micro_batch_size": 1}))
    ops = layer_ops_at(base, {str(TRAIN.compute_dtype): {"gemm": 1.0, "memory": 1.0}})
    device, params, _, _ = fit_probes([ProbeResult(r.pf, r.measured_step_s) for r in runs], base, ops)
    assert device.efficiency.pp_stage == 1.0 and "pp_stage" not in params
