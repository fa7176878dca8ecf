"""The launcher names the rank that caused a failure from torchrun's summary, which lists the
ranks it terminated before the first observed failure."""
from __future__ import annotations

import pytest

from runtime.launch import failure_message

SUMMARY = """
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 4339)  (SIGTERM)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : -11 (pid: 4338)
  error_file: <N/A>
"""


def test_root_cause_beats_terminated_peer(tmp_path):
    (tmp_path / "run.log").write_text("training output\n" + SUMMARY)
    assert "rank 0 died (signal 11)" in failure_message(tmp_path, 2)


def test_root_cause_with_lost_peer_error_names_its_line(tmp_path):
    (tmp_path / "run.log").write_text(SUMMARY)
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rank0.txt").write_text("RuntimeError: Connection reset by peer\n")
    assert failure_message(tmp_path, 2).startswith("rank 0 failed: RuntimeError: Connection reset")


def test_no_summary_says_where_the_log_is(tmp_path):
    message = failure_message(tmp_path, 4)
    assert "see" in message and "run.log" in message


def _near_zero_parts_run():
    from costmodel.measured import MeasuredRun
    m = {"predicted": {"step_time_s": 0.1, "tokens_per_s": 10.0, "mfu": 0.1},
         "error_pct": {"step_time_s": 10.0, "tokens_per_s": -9.0, "mfu": -9.0, "peak_memory_bytes": None,
                       "stage_breakdown_s": {k: [1e18] for k in ("work", "dp_sync", "optimizer", "wait")}},
         "step_time_s": 0.11, "tokens_per_s": 9.1, "mfu": 0.09, "peak_memory_bytes": None,
         "predicted_memory_compared_bytes": [1e6], "losses": [1.0, 0.9],
         "stage_breakdown_s": {"work": [0.08], "dp_sync": [0.002], "optimizer": [0.01], "wait": [0.018]},
         "predicted_stage_breakdown_s": {"work": [0.07], "dp_sync": [0.0], "optimizer": [0.01], "wait": [1e-19]}}
    m |= {"step_times_s": [0.11], "memory_source": "tensors", "device": "cpu", "world_size": 1, "steps": 1,
          "warmup_steps": 1, "wall_s": 1.0, "plan": {"pp": 1}, "model": "m", "cluster": "1x1xc"}
    return MeasuredRun(**m)


def test_parts_predicted_near_zero_compare_in_milliseconds():
    from runtime.measure import comparison_rows
    rows = {r[0]: r[3] for r in comparison_rows(_near_zero_parts_run())}
    assert rows["stage 0 DP sync after backward"] == "+2.0 ms"   # no pipeline: the sync inside the backward is work
    assert rows["stage 0 wait (bubble, PP transfer, host)"] == "+18.0 ms"
    assert rows["stage 0 work (compute + TP/CP + DP sync)"].endswith("%")
    assert not any("timed steps" in r for r in rows)   # one timed step: no range to show


def test_the_report_compares_parts_predicted_near_zero_in_milliseconds_too():
    from reports.build import _measured
    from reports.document import Document
    doc = Document("t")
    _measured(doc, _near_zero_parts_run())
    rows = {line.split("|")[1].strip(): line.split("|")[4].strip()
            for line in doc.markdown().splitlines() if line.startswith("| stage 0")}
    assert rows["stage 0 dp_sync (s)"] == "+2.0 ms" and rows["stage 0 wait (s)"] == "+18.0 ms"
    assert rows["stage 0 work (s)"].endswith("%")


def test_a_dry_run_state_predicted_as_nothing_has_no_relative_error():
    from runtime.dryrun import _error_pct
    assert _error_pct(0.0, 0.0) == 0.0 and _error_pct(1.5, 1.0) == pytest.approx(50.0)
    assert _error_pct(2**20, 0.0) is None   # not "+0.00%": the table shows the difference in GiB


def test_the_timed_steps_scatter_is_shown_beside_the_median():
    from runtime.measure import steps_row
    label, predicted, measured, apart = steps_row([0.100, 0.125, 0.110])
    assert "3 timed steps" in label and predicted == "-"
    assert measured == "100.0 - 125.0 ms" and apart == "25% apart"


def test_a_stopped_rank_is_named_with_the_watchdog_diagnosis_and_the_step(tmp_path):
    """A rank that cannot run its own watchdog (SIGSTOP, stuck in the kernel) is killed by torchrun
    without a Python error; the peer's watchdog waited for it, and that is what the user reads."""
    summary = SUMMARY.replace("-15 (pid: 4339)  (SIGTERM)", "-9 (pid: 4339)").replace(
        "rank      : 0 (local_rank: 0)\n  exitcode  : -11", "rank      : 0 (local_rank: 0)\n  exitcode  : 4")
    (tmp_path / "run.log").write_text(summary)
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rank0.txt").write_text(
        "step 3: RankHung: waiting for a peer for 5 s (Timeout) in torch.distributed\n\nstack\n")
    message = failure_message(tmp_path, 2)
    assert message.startswith("rank 1 made no progress at step 3 (hung or stopped: rank 0 waiting for a peer for 5 s")
    assert "it was then ended (signal 9)" in message and "died" not in message


def test_a_diverged_run_is_its_own_line_whichever_rank_wrote_first(tmp_path):
    (tmp_path / "errors").mkdir()
    for rank in (1, 0):
        (tmp_path / "errors" / f"rank{rank}.txt").write_text(
            "step 2: Diverged: training diverged at step 2 on rank 0: loss nan, gradient norm nan (1 non-finite "
            "step(s) in a row); no checkpoint of this state was saved\n\ntraceback\n")
    assert failure_message(tmp_path, 2).startswith("training diverged at step 2 on rank 0: loss nan")


def test_a_rank_error_names_its_step(tmp_path):
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rank1.txt").write_text("step 7: ValueError: bad\n\ntraceback\n")
    assert failure_message(tmp_path, 2).startswith("rank 1 failed at step 7: ValueError: bad")
