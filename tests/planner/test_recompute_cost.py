"""The cost of recomputation on a device (Efficiency.recompute_cost): priced on the recomputed
forward alone, fitted by `calibrate` from the runs that recompute, kept in a profile."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.estimate import estimate
from costmodel.hardware import parse_cluster, parse_profile
from costmodel.plan import PlanFile, Recompute
from costmodel.registry import resolve_model
from costmodel.specs import DType, TrainSpec
from planner.measure.calibrate import Run, fit_by_dtype, summary, with_params
from planner.space import Choice, build_plan

MODEL = resolve_model("debug-small")


def _priced(recompute: Recompute, cost: float, dtype: DType = DType.FP32):
    cluster = parse_cluster("1x1xxeon-amx")
    cluster = replace(cluster, device=with_params(cluster.device, {"recompute_cost": cost}, dtype=str(dtype)))
    train = TrainSpec(seq_len=128, global_batch_size=8, compute_dtype=dtype)
    plan = build_plan(MODEL, train, cluster, Choice(micro_batch_size=2, recompute=recompute))
    return estimate(MODEL, train, cluster, plan).time_breakdown_s


@pytest.mark.parametrize("recompute", [Recompute.FULL, Recompute.SELECTIVE])
def test_the_cost_scales_the_recomputed_forward_and_nothing_else(recompute):
    whole, cheap = _priced(recompute, 1.0), _priced(recompute, 0.6)
    assert whole["compute/recompute"] > 0
    assert cheap["compute/recompute"] == pytest.approx(0.6 * whole["compute/recompute"])
    for part in ("compute/forward", "compute/backward", "optimizer/step"):
        assert cheap[part] == pytest.approx(whole[part])
    assert _priced(Recompute.NONE, 0.6) == pytest.approx(_priced(Recompute.NONE, 1.0))


def _runs(truth, dtype: DType, recomputes: bool) -> list[Run]:
    """Runs of several plans whose 'measured' step times are `truth`'s predictions."""
    base = parse_cluster("1x2xxeon-amx")
    train = TrainSpec(seq_len=128, global_batch_size=16, compute_dtype=dtype)
    choices = [Choice(micro_batch_size=2), Choice(micro_batch_size=4), Choice(micro_batch_size=1),
               Choice(tp=2), Choice(pp=2)]
    if recomputes:
        choices.append(Choice(micro_batch_size=4, recompute=Recompute.FULL))
    out = []
    for choice in choices:
        plan = build_plan(MODEL, train, base, choice)
        pf = PlanFile(plan=plan, model=MODEL, train=train, cluster=base)
        measured = estimate(MODEL, train, replace(base, device=truth), plan).step_time_s
        out.append(Run(path=Path(f"run:{plan.short()}"), pf=pf, measured_step_s=measured))
    return out


def test_calibrate_finds_the_cost_from_the_runs_that_recompute_for_every_dtype():
    """One recomputing run, in fp32, tells the cost for bf16 too (one factor for all dtypes:
    Efficiency.recompute_cost); the probes' fit leaves it alone."""
    base = parse_cluster("1x2xxeon-amx").device
    # a CPU's DP collectives are exposed (planner.measure.calibrate.CPU_COMM_PARAMS: the fit holds it so)
    base = replace(base, efficiency=replace(base.efficiency, overlap=0.0))
    truth = with_params(base, {"recompute_cost": 0.6})
    runs = _runs(truth, DType.FP32, recomputes=True) + _runs(truth, DType.BF16, recomputes=False)
    device, factors = fit_by_dtype(runs, base, prior_weight=0.0)
    # alternating with the compute factors, which take a little of it in the first round (more
    # since the recomputed forward lacks the down projection: the same step is a smaller share)
    for dtype in (DType.FP32, DType.BF16):
        assert device.for_dtype(dtype).efficiency.recompute_cost == pytest.approx(0.6, abs=0.08)
    assert factors["recompute_cost"] == pytest.approx(0.6, abs=0.08)
    assert summary(runs, device)["max_abs_error_pct"] < 2.0 < summary(runs, base)["max_abs_error_pct"]
    fixed, factors = fit_by_dtype(runs, base, prior_weight=0.0, fit_recompute=False)
    assert fixed.for_dtype(DType.FP32).efficiency.recompute_cost == 1.0 and "recompute_cost" not in factors


PROFILE = (Path(__file__).parents[2] / "profiles" / "xeon-amx.toml")


def test_a_profile_carries_the_cost_per_dtype_and_refuses_a_non_positive_one():
    text = PROFILE.read_text()
    assert "[efficiency.bf16]" not in text
    with_table = text + "\n[efficiency.bf16]\ngemm = 1.0\nattention = 0.5\nmemory = 1.0\n" \
        "kernel_overhead_s = 1e-5\nrecompute_cost = 0.7\n"
    dev = parse_profile(with_table, Path("p.toml"))
    assert dev.for_dtype(DType.BF16).efficiency.recompute_cost == 0.7
    assert dev.efficiency.recompute_cost == 1.0
    with pytest.raises(ValueError, match=r"p.toml.*efficiency.bf16.recompute_cost"):
        parse_profile(with_table.replace("recompute_cost = 0.7", "recompute_cost = 0.0"), Path("p.toml"))


def test_the_calibrated_profile_keeps_the_fitted_cost(tmp_path, capsys):
    """`planner calibrate` writes the fitted cost into the new profile, which prices with it."""
    from costmodel.hardware import load_profile
    from planner.cli import main
    from runtime.measure import measured_record
    base = parse_cluster("1x2xxeon-amx").device
    truth = with_params(base, {"recompute_cost": 0.6})
    dirs = []
    for i, run in enumerate(_runs(truth, DType.FP32, recomputes=True)):
        raw = {"losses": [1.0], "step_times_s": [run.measured_step_s], "peak_memory_bytes": None,
               "memory_source": "tensors", "device": "cpu"}
        run.pf.save(tmp_path / f"r{i}" / "plan.json")
        measured_record(run.pf, raw, steps=1, warmup=0, wall_s=1.0).save(tmp_path / f"r{i}" / "measured.json")
        dirs.append(str(tmp_path / f"r{i}"))
    out = tmp_path / "cal.toml"
    assert main(["calibrate", *dirs, "--profile", str(PROFILE), "--out", str(out)]) == 0
    assert "recompute_cost" in capsys.readouterr().out
    cost = load_profile(out).for_dtype(DType.FP32).efficiency.recompute_cost
    # one recomputing run of six moves it part of the way: the prior (PRIOR_WEIGHT) holds it
    # towards the profile's 1, as it holds every factor
    assert 0.55 < cost < 0.95


def test_calibrate_merges_repeated_runs_of_a_plan_into_their_geometric_mean():
    """A plan run twice counts once (planner.measure.calibrate.merge_repeats), at the geometric mean."""
    from planner.measure.run_dirs import merge_repeats
    base = parse_cluster("1x2xxeon-amx").device
    runs = _runs(base, DType.FP32, recomputes=False)
    again = [replace(runs[0], path=Path("again"), measured_step_s=4 * runs[0].measured_step_s)]
    merged = merge_repeats(runs + again)
    assert len(merged) == len(runs)
    assert merged[0].measured_step_s == pytest.approx(2 * runs[0].measured_step_s)
    assert [r.measured_step_s for r in merged[1:]] == [r.measured_step_s for r in runs[1:]]
