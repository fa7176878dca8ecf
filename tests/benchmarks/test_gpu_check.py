"""benchmarks/gpu_check.py: its plan matrix everywhere; the check itself only with CUDA."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from benchmark_loader import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "gpu_check.py"


def test_matrix_and_model_fit_the_issue():
    mod = load_benchmark("gpu_check")
    full = mod.matrix(quick=False)
    assert {m for m, _, _ in full} == {1, 2, 4} and {r for _, r, _ in full} == {"none", "selective", "full"}
    assert {s for _, _, s in full} == {2048, 4096} and len(full) == 18
    assert mod.model_config(80 * 2**30)["num_key_value_heads"] < mod.model_config(80 * 2**30)["num_attention_heads"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_check_runs_on_this_gpu(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--steps", "2", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["rows"]
    assert any("measured_step_s" in r for r in rows)
