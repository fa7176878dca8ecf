"""The profiler's budget: a curve stops where the next point would break it and says so, and a
dtype far below fp32's rate is marked not accelerated (run in one process, no group)."""
from __future__ import annotations

import time

import pytest
import torch

from runtime.profiler import ACCELERATED_CHECK_FLOPS, gemm_curve, gemm_shapes


@pytest.mark.alone   # a wall-clock bound
def test_a_curve_stops_at_its_budget_and_says_where():
    start = time.perf_counter()
    curve = gemm_curve(gemm_shapes(), torch.float32, torch.device("cpu"), phase_s=0.3, point_s=0.02)
    assert time.perf_counter() - start < 3.0          # the budget, not the shape list, bounds it
    assert curve.stopped_before is not None and curve.points
    assert max(x for x, _ in curve.points) <= curve.stopped_before   # shapes of equal FLOPs may straddle it
    assert len(curve.points) < len(gemm_shapes())   # the budget, not the end of the list, stopped it


def test_a_dtype_far_below_fp32_is_marked_not_accelerated():
    # a reference 1000x faster than anything here: the measured dtype cannot keep up with it
    reference = ((1.0, 1e15), (1e12, 1e15))
    shapes = [s for s in gemm_shapes() if 2 * s[0] * s[1] * s[2] <= 4 * ACCELERATED_CHECK_FLOPS]
    curve = gemm_curve(shapes, torch.float32, torch.device("cpu"), phase_s=10.0, point_s=1.0,
                       reference=reference)
    assert not curve.accelerated


def test_a_gpu_point_is_timed_over_calls_back_to_back():
    """One call between two synchronisations times the launch and the sync on a GPU, not the
    kernel (runtime.profiler.GPU_BATCH_S): batches of calls, capped, divided by their count."""
    from runtime.profiler import MAX_BATCH, best_s
    calls = []
    per_call = best_s(lambda: calls.append(1), repeat=3, batch_s=10.0)
    assert len(calls) == 2 + 3 * MAX_BATCH   # a warm-up, a call that sizes the batch, three batches
    assert per_call < 1e-3
    calls.clear()
    best_s(lambda: calls.append(1), repeat=3)
    assert len(calls) == 4   # on a CPU, as before: one warm-up and three timed calls


def test_gpu_curves_reach_the_layers_of_real_models():
    cpu, gpu = gemm_shapes(), gemm_shapes("cuda")
    assert set(cpu) < set(gpu)
    assert max(2 * m * k * n for m, k, n in cpu) <= 2e10 < max(2 * m * k * n for m, k, n in gpu)
