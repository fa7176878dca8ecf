"""benchmarks/closed_loop.py's passes: a plan measured in several passes is compared by their
geometric mean, and leave-one-out leaves every pass of the plan out."""
from __future__ import annotations

import math

import pytest
from benchmark_loader import load_benchmark

from costmodel.hardware import parse_cluster
from costmodel.plan import PlanFile
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan
from runtime.measure import measured_record

MODEL = resolve_model("debug-tiny")
CLUSTER = parse_cluster("1x1xxeon-amx")
TRAIN = TrainSpec(seq_len=64, global_batch_size=4)


def _write_run(where, step_s: float) -> None:
    pf = PlanFile(plan=build_plan(MODEL, TRAIN, CLUSTER, Choice(micro_batch_size=2)), model=MODEL, train=TRAIN,
                  cluster=CLUSTER)
    raw = {"losses": [1.0], "step_times_s": [step_s], "peak_memory_bytes": None, "memory_source": "tensors",
           "device": "cpu"}
    pf.save(where / "plan.json")
    measured_record(pf, raw, steps=1, warmup=0, wall_s=1.0).save(where / "measured.json")


def _matrix(tmp_path, cl, passes: int) -> dict[str, list[float]]:
    times = {}
    for j, (name, *_) in enumerate(cl.MATRIX):
        times[name] = [0.1 * (j + 1) * (1 + 0.2 * k) for k in range(passes)]
        for k, t in enumerate(times[name], 1):
            _write_run(cl.pass_dir(tmp_path, k) / name, t)
    return times


def test_a_plan_is_measured_by_the_geometric_mean_of_its_passes(tmp_path):
    cl = load_benchmark("closed_loop")
    times = _matrix(tmp_path, cl, passes=3)
    rows = cl.table(tmp_path, CLUSTER.device)
    for name, _, measured in rows:
        assert [d.parent.name for d in cl.passes_of(tmp_path, name)] == [tmp_path.name, "pass2", "pass3"]
        assert math.isclose(measured, math.prod(times[name]) ** (1 / 3))


def test_a_single_pass_is_the_plan_s_measure(tmp_path):
    cl = load_benchmark("closed_loop")
    times = _matrix(tmp_path, cl, passes=1)
    assert [m for _, _, m in cl.table(tmp_path, CLUSTER.device)] == pytest.approx([t for t, in times.values()])


def test_leave_one_out_calibrates_on_the_other_plans_passes_merged(tmp_path, monkeypatch):
    """Without any pass of the left-out plan, and one run per other plan (its passes' geometric
    mean), so the prior weighs as on one pass."""
    cl = load_benchmark("closed_loop")
    times = _matrix(tmp_path, cl, passes=2)
    import planner.measure.calibrate as calibrate
    seen = []

    def fit(runs, base, **_):
        seen.append({r.path.name: r.measured_step_s for r in runs})
        return base, {}
    monkeypatch.setattr(calibrate, "fit_by_dtype", fit)
    rows = cl.leave_one_out(tmp_path, CLUSTER.device, 0.3)
    for (name, *_), fitted in zip(rows, seen):
        assert set(fitted) == set(times) - {name}
        assert all(t == pytest.approx(math.sqrt(math.prod(times[n]))) for n, t in fitted.items())


def test_plans_measured_in_different_numbers_of_passes_are_refused(tmp_path):
    cl = load_benchmark("closed_loop")
    _matrix(tmp_path, cl, passes=2)
    name = cl.MATRIX[-1][0]
    (cl.pass_dir(tmp_path, 2) / name / "measured.json").unlink()   # a second pass stopped part-way
    with pytest.raises(SystemExit, match="different numbers of passes"):
        cl.table(tmp_path, CLUSTER.device)


def test_a_new_matrix_clears_the_later_passes_of_an_earlier_one(tmp_path):
    cl = load_benchmark("closed_loop")
    _matrix(tmp_path, cl, passes=3)
    cl.clear_passes(tmp_path)
    assert not cl.pass_dir(tmp_path, 2).exists() and not cl.pass_dir(tmp_path, 3).exists()
    assert all(len(cl.passes_of(tmp_path, name)) == 1 for name, *_ in cl.MATRIX)
