"""A family of rows that differ only in their micro-batch count splits into what a micro-batch
costs and what a step adds once (planner.measure.step_split): a constant added to every
measured step shows as the per-step error alone, whichever metric the rows publish."""
from pathlib import Path

import pytest

from planner.measure.runs_table import read_runs
from planner.measure.step_split import step_splits
from planner.measure.validate import validate_row

RUNS = Path(__file__).resolve().parents[2] / "profiles" / "runs" / "published_runs.csv"
ROW = "mlperf31_gpt3_h100_eosdfw_4096"   # every plan cell stated: dp 128, micro-batch 1, 16 a step


def _family(extra_s: float) -> tuple[list[dict[str, str]], list]:
    base = next(r for r in read_runs(RUNS) if r["id"] == ROW)
    rows = [dict(base, id=f"m{gbs}", global_batch=str(gbs)) for gbs in (2048, 4096, 8192)]
    predicted = [validate_row(r).estimate.step_time_s for r in rows]
    for row, step_s in zip(rows, predicted):
        row.update(metric_name="iteration_time_s", metric_value=str(step_s + extra_s))
    # one row published as throughput: its step time is read back through the conversion
    last = rows[-1]
    tokens = int(last["global_batch"]) * int(last["seq_len"]) / (predicted[-1] + extra_s) / int(last["num_gpus"])
    last.update(metric_name="tokens_per_sec_per_gpu", metric_value=str(tokens))
    return rows, [validate_row(r) for r in rows]


@pytest.mark.parametrize("extra_s", [0.0, 0.25])
def test_a_constant_per_step_shows_in_the_per_step_error_alone(extra_s):
    rows, results = _family(extra_s)
    [split] = step_splits(rows, results)
    assert split.micro_batches == (16, 32, 64)
    assert split.row_ids == ("m2048", "m4096", "m8192")
    assert split.per_micro_batch_error_pct == pytest.approx(0.0, abs=1e-6)
    assert split.per_step_error_s == pytest.approx(-extra_s, abs=1e-6)
    assert split.measured_per_step_s == pytest.approx(split.predicted_per_step_s + extra_s, abs=1e-6)


def test_rows_at_one_micro_batch_count_make_no_family():
    rows, results = _family(0.0)
    assert step_splits(rows[:1], results[:1]) == []
