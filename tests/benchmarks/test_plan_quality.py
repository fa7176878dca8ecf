"""benchmarks/plan_quality.py's --ids and --fix, which the README's decompositions of the gains
quote: a fixed field holds in the search, `published` takes the row's own value."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "plan_quality.py"


def test_a_fixed_field_holds_and_the_measured_run_is_compared():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--ids", "korthikanti_22B_sel_sp", "--fix", "tp=published",
                           "cp=1", "--time-limit-s", "5"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("korthikanti_")]
    assert len(rows) == 1   # --ids: that row alone
    fixed = next(ln for ln in proc.stdout.splitlines() if "fixed {" in ln)
    assert "{'tp': 8, 'cp': 1}" in fixed and " tp8" in fixed and " cp" not in fixed.split("fastest")[1].split(",")[0]
    step_s, measured_s = map(float, re.search(r", ([\d.]+) s against ([\d.]+) s measured", fixed).groups())
    assert measured_s == 1.1 and step_s > 0
