"""A CPU's curves are measured twice and each point keeps the faster pass
(runtime.profiler.second_pass): a point that fell in a slow stretch of a shared machine is
measured again, nothing else changes shape (one process, a one-rank gloo group)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from costmodel.cluster import sdpa_key
from runtime import profiler as prof

CPU = torch.device("cpu")


@pytest.fixture
def group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_best_of_keeps_the_faster_pass_point_by_point_and_the_first_beyond_the_second():
    first = ((1.0, 10.0), (2.0, 5.0), (2.0, 7.0), (4.0, 9.0))
    second = ((1.0, 8.0), (2.0, 6.0), (2.0, 6.0))   # a budget stopped it before the last size
    assert prof.best_of(first, second) == ((1.0, 10.0), (2.0, 6.0), (2.0, 7.0), (4.0, 9.0))


def test_best_of_refuses_passes_over_different_sizes():
    with pytest.raises(ValueError, match="point 1"):
        prof.best_of(((1.0, 1.0), (2.0, 1.0)), ((1.0, 1.0), (3.0, 1.0)))


def test_a_point_slowed_in_the_first_pass_is_measured_again(group):
    shapes = prof.gemm_shapes()[:6]
    gemm = prof.gemm_curve(shapes, torch.float32, CPU, phase_s=5.0, point_s=0.5)
    assert len(gemm.points) == len(shapes)
    # the fourth point as a stretch ten times slower would have measured it
    slowed = tuple((x, r / 10 if i == 3 else r) for i, (x, r) in enumerate(gemm.points))
    out = {"gemm": {"fp32": replace(gemm, points=slowed)},
           "memory": prof.memory_curve(CPU, 5.0, 0.5, lambda frac, what: None, count=2),
           "sdpa": prof.sdpa_curves("fp32", CPU, 5.0, 0.5, prof.CPU_SDPA_SHAPES[:1]), "attention": {},
           **prof.per_unit_costs(CPU)}
    first = {k: (dict(v) if isinstance(v, dict) else v) for k, v in out.items()}
    prof.second_pass(out, ["fp32"], shapes, CPU, point_s=0.5, limit_s=10.0, report=lambda frac, what: None)

    again = out["gemm"]["fp32"].points
    assert [x for x, _ in again] == [x for x, _ in slowed]
    assert again[3][1] > 2 * slowed[3][1]   # measured again at its real rate, not ten times under it
    assert all(r >= r0 for (_, r), (_, r0) in zip(again, slowed))
    assert out["gemm"]["fp32"].stopped_before == gemm.stopped_before
    memory, memory0 = out["memory"].points, first["memory"].points
    assert [x for x, _ in memory] == [x for x, _ in memory0]
    assert all(r >= r0 for (_, r), (_, r0) in zip(memory, memory0))
    for key, points in out["sdpa"].items():
        assert [x for x, _ in points] == [x for x, _ in first["sdpa"][key]]
        assert all(r >= r0 for (_, r), (_, r0) in zip(points, first["sdpa"][key]))
    assert out["attention"]["fp32"] > 0   # derived again from the faster curves
    assert sdpa_key("fp32", True, True) in out["sdpa"]
    for key in ("overhead_s", "optimizer_s_per_param", "dropout_s_per_element"):
        assert out[key] <= first[key]
    for approximate, pair in out["gelu_s_per_element"].items():
        assert all(t <= t0 for t, t0 in zip(pair, first["gelu_s_per_element"][approximate]))
