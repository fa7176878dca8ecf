"""benchmarks/step_trace.py's parts of a step: each op's self time goes to what it runs under or
its kind, the GEMMs beside their price; the trace holds the timed steps alone (RunConfig.after_step)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from costmodel.kernels import gemm_s
from costmodel.plan import PlanFile
from planner.cli import main
from runtime.train import TIMED_STEP
from tests.benchmarks.benchmark_loader import load_benchmark

trace = load_benchmark("step_trace")


def _event(name: str, parent=None, self_us: float = 0.0, shapes=None):
    return SimpleNamespace(name=name, cpu_parent=parent, self_cpu_time_total=self_us, input_shapes=shapes or [])


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> PlanFile:
    path = tmp_path_factory.mktemp("trace") / "plan.json"
    assert main(["predict", "--model", "debug-tiny", "--cluster", "1x1xxeon-amx", "--dtype", "fp32",
                 "--out", str(path), "--json"]) == 0
    return PlanFile.load(path)


def test_an_op_belongs_to_what_it_runs_under_else_to_its_kind():
    step = _event(TIMED_STEP, _event("ProfilerStep#3"))
    optimizer = _event("Optimizer.step#AdamW.step", step)
    fsdp = _event("FSDP::post_backward_reduce", step)
    assert trace.part_of(_event("aten::mul", optimizer)) == "optimizer step"
    assert trace.part_of(_event("aten::copy_", _event("aten::_to_copy", fsdp))) == \
        "FSDP hooks (casts, copies, collectives)"
    assert trace.part_of(_event("c10d::allreduce_", step)) == "collectives and send/recv (waits)"
    assert trace.part_of(_event("aten::mm", _event("MmBackward0", step))) == "GEMMs"
    assert trace.part_of(_event("aten::_scaled_dot_product_flash_attention_for_cpu", step)) == "SDPA"
    assert trace.part_of(_event("aten::_log_softmax", step)) == "loss (log-softmax, NLL)"
    assert trace.part_of(_event("aten::add_", step)) == "other aten ops (memory-bound kernels)"
    assert trace.part_of(_event("MmBackward0", step)) == "autograd nodes, hooks (own time)"
    assert trace.part_of(step) == "outside ops (Python, unrecorded waits)"
    # the loop's own work around the timed step is no part of it
    assert trace.part_of(_event("c10d::allreduce_", _event("ProfilerStep#3"))) is None


def test_plain_gemms_are_priced_at_the_profile_and_others_not(plan_file):
    dev, train = plan_file.cluster.device, plan_file.train
    assert trace.gemm_priced_s(_event("aten::mm", shapes=[[64, 32], [32, 48]]), plan_file) == \
        gemm_s(64, 32, 48, dev, train)
    # addmm's bias comes first
    assert trace.gemm_priced_s(_event("aten::addmm", shapes=[[48], [64, 32], [32, 48]]), plan_file) == \
        gemm_s(64, 32, 48, dev, train)
    assert trace.gemm_priced_s(_event("aten::mm", shapes=[[64, 32], [16, 48]]), plan_file) is None   # no product
    assert trace.gemm_priced_s(_event("aten::mm", shapes=[]), plan_file) is None   # shapes not recorded


def test_the_parts_add_up_per_step_and_the_gemms_sit_beside_their_price(plan_file):
    loop = _event("ProfilerStep#2", self_us=5000.0)
    step = _event(TIMED_STEP, loop, self_us=2000.0)
    priced = trace.gemm_priced_s(_event("aten::mm", shapes=[[64, 32], [32, 48]]), plan_file)
    mm = [_event("aten::mm", step, 2 * priced * 1e6, [[64, 32], [32, 48]]) for _ in range(2)]   # one a step
    events = [loop, step, *mm, _event("aten::add_", step, 1000.0), _event("aten::add_", loop, 700.0)]
    table = trace.parts_table(events, plan_file, steps=2)
    total_ms = (2000.0 + 4 * priced * 1e6 + 1000.0) / 1e3 / 2   # the loop's own work left out
    assert f"{'the timed step (self time of its ops)':45s} {total_ms:10.1f}" in table
    assert "(+100.0 %)" in table   # the GEMMs took twice their price
    # and per shape: one call a step, at twice its price
    shape_row = next(line for line in table.splitlines() if line.startswith("  [64, 32] x [32, 48]"))
    assert shape_row.split()[5] == "1" and shape_row.endswith("(+100.0 %)")
    assert "predicted ledger (critical rank): compute/forward" in table


def test_each_gemm_shape_is_priced_apart_most_traced_first(plan_file):
    step = _event(TIMED_STEP, _event("ProfilerStep#2"))
    big, small = [[1024, 1024], [1024, 1024]], [[64, 32], [32, 48]]
    big_s, small_s = (trace.gemm_priced_s(_event("aten::mm", shapes=x), plan_file) for x in (big, small))
    events = [_event("aten::mm", step, 3 * big_s * 1e6, big) for _ in range(2)]   # one a step, 3x its price
    events += [_event("aten::addmm", step, 1.5 * small_s * 1e6, [[48], *small]) for _ in range(4)]
    lines = trace.parts_table(events, plan_file, steps=2).splitlines()
    first = lines.index(next(line for line in lines if line.startswith("  GEMM shape")))
    rows = [line.split() for line in lines[first + 1:first + 3]]
    assert [r[:5] for r in rows] == [["[1024,", "1024]", "x", "[1024,", "1024]"], ["[64,", "32]", "x", "[32,", "48]"]]
    assert float(rows[0][5]) == 1 and float(rows[1][5]) == 2   # calls a step
    assert float(rows[0][6]) == pytest.approx(3 * big_s * 1e3, abs=0.06)   # traced ms a step
    assert float(rows[0][7]) == pytest.approx(big_s * 1e3, abs=0.06)       # priced ms a step
    assert big_s > 1e-3 and rows[0][8:] == ["(+200.0", "%)"] and rows[1][8:] == ["(+50.0", "%)"]
    # past GEMM_SHAPE_ROWS, the rest in one line
    assert trace.gemm_shape_lines({"a": [2, 0.004, 0.002], "b": [2, 0.002, 0.002]}, 2, rows=1)[-1] == \
        "  ... 1 more shapes, 1.0 ms traced"


def test_the_trace_holds_the_timed_steps_alone(plan_file):
    from runtime.fork import run_forked
    assert run_forked(1, _timed_steps_traced, plan_file)[0] == 3


def _timed_steps_traced(pf: PlanFile) -> int:
    prof, _ = trace.traced_steps(pf, 3)   # after WARM_STEPS untraced ones
    return sum(ev.name == TIMED_STEP for ev in prof.events())


def test_after_step_sees_every_step_warm_up_included(plan_file):
    from runtime.fork import run_forked
    seen = run_forked(1, _steps_seen, plan_file)[0]
    assert seen == [0, 1, 2]


def _steps_seen(pf: PlanFile) -> list[int]:
    from runtime.train import RunConfig, run_rank
    torch.set_num_threads(1)
    seen: list[int] = []
    run_rank(pf, RunConfig(steps=2, warmup=1, quiet=True, after_step=seen.append))
    return seen
