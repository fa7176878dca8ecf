"""The cost model against published measurements (profiles/runs/published_runs.csv).

These guard what `python benchmarks/fidelity.py` measured (2026-11-23: in sample MAPE 6.0 %,
max 26.3 %, Spearman 0.998, 72 of 73 measured runs predicted to fit; 2026-11-25, with the
Mixtral 8x7B row (+18.7 %): MAPE 6.2 %, 73 of 74 fit; with three more MoE rows: MAPE 6.7 %,
74 of 77 fit) from getting worse; the
targets of the fidelity issue (MAPE <= 5 %, max <= 25 % out of sample) are not all met yet, and
the README's fidelity section says which rows miss and why."""
from pathlib import Path

from planner.validate import validate

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "profiles" / "runs" / "published_runs.csv"


def test_published_runs_stay_within_the_measured_fidelity():
    results, summary = validate(RUNS)
    assert summary["n"] == sum(1 for r in results if r.error_pct is not None) == 77
    # 6.2 % over the 74 dense and Mixtral 8x7B rows; the Mixtral 8x22B rows (+22-24 %, predicted
    # not to fit: Megatron-Core folds EP over the TP ranks, which the model does not) add 0.5
    assert summary["mape_pct"] <= 7.0
    assert summary["max_abs_error_pct"] <= 27.0
    assert summary["spearman"] >= 0.99
    assert sum(r.fits for r in results if r.error_pct is not None) >= 74
    assert summary["num_status_correct"] == summary["num_status_rows"]


def test_the_corrected_megatron_rows_are_zero_1_and_fit():
    """The megatron_h100 rows state ZeRO-1 (--overlap-param-gather needs the distributed
    optimizer): at ZeRO-1 each fits without full recomputation forced on it."""
    results, _ = validate(RUNS)
    rows = [r for r in results if r.id.startswith("megatron_h100_")]
    assert len(rows) == 9
    assert all(r.plan.zero_stage == 1 and r.fits and abs(r.error_pct) <= 20 for r in rows)


def test_leaving_a_source_out_of_the_fit_predicts_it(tmp_path):
    """planner.fit on a small table: the Megatron H100 rows predicted by a fit on the other H100
    sources (llm-foundry) stay within 25 % (the full table's figures: benchmarks/fidelity.py)."""
    import math

    from planner import fit
    from planner.validate import read_runs
    rows = [r for r in read_runs(RUNS) if r["gpu"] == "H100-SXM5-80GB"
            and r["id"].startswith(("megatron_h100_", "mosaic_"))]
    errors = fit.leave_one_source_out(fit.fill_rows(rows))
    held = [e for r, e in errors if r.row["id"].startswith("megatron_h100_")]
    assert len(held) == 9 and max(abs(math.exp(e) - 1) for e in held) <= 0.25
