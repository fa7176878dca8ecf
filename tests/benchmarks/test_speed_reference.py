"""benchmarks/speed_reference.py's figures: a reference that moves with the steps takes their
scatter away; one that moves on its own does not."""
from __future__ import annotations

import math
import random

import pytest
from benchmark_loader import load_benchmark

speed_reference = load_benchmark("speed_reference")


def _rows(drifts: list[float], reference: list[float]) -> list[dict]:
    base = {"a": 1.0, "b": 0.5}
    return [{"plan": plan, "step_s": base[plan] * d,
             "before": {k: 0.004 * r for k in speed_reference.KINDS},
             "after": {k: 0.004 * r for k in speed_reference.KINDS}}
            for i, (d, r) in enumerate(zip(drifts, reference)) for plan in ["ab"[i % 2]]]


def test_a_reference_that_tracks_the_steps_takes_their_scatter_away():
    drifts = [1.0, 1.1, 0.9, 1.2, 0.95, 1.05, 0.85, 1.15]
    corr, slope, left, best = speed_reference.tracking(_rows(drifts, drifts), "gemm_fp32", "both")
    assert corr == pytest.approx(1.0)
    assert slope == pytest.approx(1.0)
    assert left == pytest.approx(0.0, abs=1e-12) and best == pytest.approx(0.0, abs=1e-12)


def test_a_reference_that_moves_on_its_own_leaves_the_scatter():
    rng = random.Random(0)
    drifts = [math.exp(rng.gauss(0, 0.06)) for _ in range(200)]
    noise = [math.exp(rng.gauss(0, 0.10)) for _ in range(200)]
    rows = _rows(drifts, noise)
    corr, _, left, best = speed_reference.tracking(rows, "add_fp32", "before")
    scatter = speed_reference.statistics.pstdev(
        speed_reference._less_plan_mean(rows, [math.log(r["step_s"]) for r in rows]))
    assert abs(corr) < 0.2
    assert left > 1.5 * scatter          # dividing by it adds its own noise
    assert best == pytest.approx(scatter, rel=0.05)
