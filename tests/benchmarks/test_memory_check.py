"""benchmarks/memory.py: each check's rows from what `planner run` measured, and the host check's
two processes, each reporting its passes."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from benchmark_loader import BENCHMARKS, load_benchmark

from planner.cli import main as planner

memory = load_benchmark("memory")


def test_a_plan_is_compared_stage_by_stage(tmp_path, monkeypatch):
    calls = []

    def fake_planner(*args: str) -> None:   # `planner run` writes OUT/<tag>/measured.json
        calls.append(args[0])
        if args[0] == "run":
            (tmp_path / "tag").mkdir()
            (tmp_path / "tag" / "measured.json").write_text(json.dumps(
                {"peak_memory_bytes": [100.0, 200.0], "predicted_memory_compared_bytes": [110.0, 190.0]}))
    monkeypatch.setattr(memory, "_planner", fake_planner)
    assert memory.peaks(tmp_path, "tag", ["--model", "debug-tiny"]) == [(110.0, 100.0), (190.0, 200.0)]
    assert calls == ["predict", "run"]
    row = memory.compared(3 * memory.MIB, 2 * memory.MIB)
    assert len(row) == len(memory.COMPARED) and row.split() == ["3.0", "2.0", "+50.0%"]


def test_the_host_report_gives_each_pass_and_the_medians():
    timed = [{"_log_softmax": 0.002, "nll_loss_forward": 0.001, "mm": 0.010, memory.FAULTS: 40},
             {"_log_softmax": 0.004, "nll_loss_forward": 0.002, "mm": 0.020, memory.FAULTS: 60}]
    line = memory.host_report("kept", timed)
    assert line.startswith("kept: loss kernels per pass 3.0, 6.0 ms (median 4.5)")
    assert "all kernels 13, 26 ms (median 20)" in line and "pages first touched 50 a pass" in line


def test_each_check_is_a_subcommand():
    p = memory.parser()
    assert p.parse_args(["dp"]).check == "dp" and p.parse_args(["pipeline", "--out", "x"]).out.name == "x"
    assert p.parse_args(["host", "plan.json"]).passes == 8
    for bad in ([], ["nothing"], ["host"], ["dp", "plan.json"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    with pytest.raises(SystemExit):
        memory.main(["host", "plan.json", "--passes", "0"])


def test_the_host_check_runs_both_processes(tmp_path):
    plan = tmp_path / "plan.json"
    assert planner(["predict", "--model", "debug-tiny", "--cluster", "1x1xxeon-amx", "--dtype", "fp32",
                    "--out", str(plan), "--json"]) == 0
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "memory.py"), "host", str(plan), "--passes", "1"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines[:2]] == ["glibc as it comes", "freed memory kept"]
    assert lines[-1].endswith(f"command: python benchmarks/memory.py host {plan} --passes 1")


def test_a_missing_plan_is_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "memory.py"), "host", str(tmp_path / "none.json")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip() == f"memory host: {tmp_path / 'none.json'}: no such file"
