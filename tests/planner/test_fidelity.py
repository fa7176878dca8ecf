"""The cost model against published measurements: the fidelity targets of the foundation issue,
on the published table with its one documented correction (scripts/correct_runs.py)."""
import subprocess
import sys
from pathlib import Path

from planner.validate import validate

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT.parent / "shared" / "reference" / "published_runs.csv"


def test_published_runs_within_targets(tmp_path):
    corrected = tmp_path / "corrected.csv"
    with open(corrected, "w") as out:
        subprocess.run([sys.executable, str(ROOT / "scripts" / "correct_runs.py"), str(RUNS)],
                       stdout=out, stderr=subprocess.DEVNULL, check=True)
    results, summary = validate(corrected)
    assert summary["n"] == 38
    assert summary["mape_pct"] <= 10.0
    assert summary["max_abs_error_pct"] <= 20.0
    assert summary["spearman"] >= 0.9
    assert all(r.fits for r in results), "every measured run must be predicted to fit"


def test_the_uncorrected_rows_are_the_only_outliers():
    """As published, only the megatron_h100 rows (ZeRO-0 stated, distributed optimizer used)
    miss by more than 20 %; everything else stays within the target."""
    results, _ = validate(RUNS)
    outliers = {r.id for r in results if abs(r.error_pct) > 20}
    assert outliers and all(i.startswith("megatron_h100_") for i in outliers)
