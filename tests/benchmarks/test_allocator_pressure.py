"""benchmarks/allocator_pressure.py: the stored H200 measurement replays as its README says, and
without CUDA the measurement is one line, exit 2."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCHMARKS / "results" / "allocator-pressure-h200-2026-12-04"


def test_the_stored_runs_hold_full_speed_up_to_the_limit():
    for name, last_share in (("pressure_default.json", 0.95), ("pressure_expandable.json", 0.98)):
        doc = json.loads((RESULTS / name).read_text())
        ran = [r for r in doc["rows"] if not r["oom"]]
        assert max(r["share"] for r in ran) == last_share
        assert all(r["alloc_retries_per_step"] == 0 for r in ran)
        steps = [r["step_s"] for r in ran]
        assert max(steps) / min(steps) < 1.02
        assert all(r["reserved_bytes"] < 1.08 * r["allocated_bytes"] for r in ran)
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "allocator_pressure.py"), "--replay",
                           str(RESULTS / "pressure_default.json")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "out of memory" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures on CUDA")
def test_without_cuda_it_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "allocator_pressure.py"), "--out", str(tmp_path / "p.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "needs CUDA" in proc.stderr
