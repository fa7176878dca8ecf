"""benchmarks/phase_lock.py: the mechanism planner.relayout mends, on the event simulator."""
from __future__ import annotations

import pytest

from tests.benchmarks.benchmark_loader import load_benchmark

phase_lock = load_benchmark("phase_lock")


def test_uniform_stages_run_at_either_form():
    stage_s = [1.0] * 12
    assert phase_lock.period_s(4, 3, stage_s) == pytest.approx(3.0) == phase_lock.forms(4, 3, stage_s)[0]


def test_a_heavy_last_stage_holds_the_pipeline_back_beyond_its_rank_s_total():
    """PP4 VP3, the last rank's stages 0.5, 0.5 and 2.5 (its total the others' 3.5): the period is
    above the rank form the closed form uses and below the phase form."""
    stage_s = [1.0] * 12
    stage_s[3], stage_s[7], stage_s[11] = 0.5, 0.5, 2.5
    rank, phase = phase_lock.forms(4, 3, stage_s)
    assert (rank, phase) == (3.5, 4.5)
    assert rank * 1.05 < phase_lock.period_s(4, 3, stage_s) < phase
