"""--objective cost and the run's limits (--deadline-days, --budget-usd), the same words in
search and sweep: bad combinations are one line with exit 2; on one cluster the cheapest run is
the fastest plan; between sizes the objective decides."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from planner import api
from planner.cli import main
from planner.sweep import SweepSpec, _best

SEARCH = ["search", "--model", "llama3-8b", "--cluster", "1x8xH100", "--seq-len", "4096", "--global-batch", "64"]
SWEEP = ["sweep", "--model", "llama3-8b", "--device", "H100", "--nodes", "1,2", "--tokens", "1e11"]


@pytest.mark.parametrize("argv, message", [
    (SEARCH + ["--objective", "cost"], "search --objective cost prices a training run of --tokens N at --gpu-hour-usd "
                                       "P: give --tokens N and --gpu-hour-usd P"),
    (SEARCH + ["--objective", "cost", "--tokens", "1e11"], "give --gpu-hour-usd P"),
    (SEARCH + ["--deadline-days", "3"], "--deadline-days limits the days to train --tokens N; give --tokens"),
    (SEARCH + ["--tokens", "1e11", "--budget-usd", "9"], "--budget-usd limits the cost of training --tokens N at"),
    (SWEEP + ["--objective", "cost"], "sweep --objective cost prices a training run"),
    (SWEEP + ["--budget-usd", "9"], "--budget-usd limits the cost"),
    (SWEEP + ["--objective", "memory"], "invalid choice: 'memory'"),
])
def test_bad_combinations_are_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_search_cost_is_the_time_answer_with_its_run_priced_and_limited(capsys):
    assert main(SEARCH + ["--json", "--top", "3"]) == 0
    by_time = json.loads(capsys.readouterr().out)["plans"]
    priced = SEARCH + ["--objective", "cost", "--tokens", "1e11", "--gpu-hour-usd", "2"]
    assert main(priced + ["--json", "--top", "3", "--deadline-days", "1000"]) == 0
    by_cost = json.loads(capsys.readouterr().out)["plans"]
    assert [p["plan"] for p in by_cost] == [p["plan"] for p in by_time]
    days = [p["training"]["days"] for p in by_cost]
    costs = [p["training"]["cost_usd"] for p in by_cost]
    assert all(c == pytest.approx(d * 24 * 8 * 2) for c, d in zip(costs, days))
    # a deadline no plan meets: one line naming the fastest plan's days
    assert main(priced + ["--deadline-days", f"{min(days) / 2:.3f}"]) == 2
    err = capsys.readouterr().err
    assert "no plan on 1x8xH100-SXM5-80GB trains 1e+11 tokens within" in err and "the fastest (" in err
    assert err.rstrip().endswith("more devices (planner sweep), fewer tokens or a later deadline")
    # a budget no plan meets: more devices would not help; a larger budget would
    assert main(priced + ["--budget-usd", f"{min(costs) / 2:.0f}"]) == 2
    assert capsys.readouterr().err.rstrip().endswith(
        "fewer tokens or a larger budget or another size or device (planner sweep)")


def test_sweep_objective_cost_takes_the_cheapest_size_and_time_the_soonest_within_the_budget():
    result = api.sweep("llama3-8b", "H100", nodes=[1, 2], tokens=1e11, gpu_hour_usd=2.0, seq_len=4096,
                       global_batch=64)
    small, large = result.rows
    assert small.cost.days > large.cost.days and small.cost.cost_usd < large.cost.cost_usd
    assert result.best is small and result.objective == "cost"
    spec = SweepSpec(devices=("H100",), nodes=(1, 2), tokens=1e11, gpu_hour_usd=(2.0,))
    assert _best(list(result.rows), replace(spec, objective="time"))[0] is large
    assert _best(list(result.rows), replace(spec, objective="time", budget_usd=large.cost.cost_usd * 1.001))[0] is large
    best, _ = _best(list(result.rows), replace(spec, objective="time", budget_usd=large.cost.cost_usd * 0.999))
    assert best is small
    best, why = _best(list(result.rows), replace(spec, budget_usd=small.cost.cost_usd * 0.5))
    assert best is None and why.startswith("no size costs at most $")
