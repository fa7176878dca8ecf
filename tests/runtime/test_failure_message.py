"""The launcher names the rank that caused a failure from torchrun's summary, which lists the
ranks it terminated before the first observed failure."""
from __future__ import annotations

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
    assert "see" in failure_message(tmp_path, 4)
