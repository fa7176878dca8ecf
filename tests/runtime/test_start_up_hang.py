"""A rank stopped or stuck before the process group forms (SIGSTOP while it starts): its peers'
start-up watchdog (runtime.watchdog.joining) gives up after --hang-timeout instead of torch's own
rendezvous timeout, and the user reads which rank did not join, not a DistStoreError. In-process:
the watchdog with its process exit recorded, and the launcher's message from torchrun's summary."""
from __future__ import annotations

import threading

from runtime import watchdog
from runtime.launch import failure_message

# torchrun's summary after rank 0's watchdog ended it (exit 4) and rank 1, stopped, was killed
SUMMARY = """
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4339)
  error_file: <N/A>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 4 (pid: 4338)
  error_file: <N/A>
"""


def _exits(monkeypatch) -> threading.Event:
    ended = threading.Event()
    monkeypatch.setattr(watchdog.os, "_exit", lambda code: ended.set())
    return ended


def test_a_peer_that_never_joins_ends_the_rank_with_the_diagnosis(tmp_path, monkeypatch):
    ended = _exits(monkeypatch)
    errors_file = tmp_path / "errors" / "rank0.txt"
    with watchdog.joining(errors_file, 0.2):
        assert ended.wait(30)   # init_process_group still waiting here
    assert errors_file.read_text().startswith("RankHung: waiting for a peer to join for 0 s (Timeout)")


def test_a_group_that_forms_in_time_leaves_nothing(tmp_path, monkeypatch):
    ended = _exits(monkeypatch)
    with watchdog.joining(tmp_path / "rank0.txt", 0.5):
        pass
    assert not ended.wait(1.0) and not (tmp_path / "rank0.txt").exists()
    with watchdog.joining(tmp_path / "rank0.txt", 0.0):   # no --hang-timeout: torch's own timeout only
        assert not any(t.name == "planner-join-watchdog" and t.is_alive() for t in threading.enumerate())


def test_the_rank_that_did_not_join_is_named(tmp_path):
    (tmp_path / "run.log").write_text(SUMMARY)
    (tmp_path / "errors").mkdir()
    (tmp_path / "errors" / "rank0.txt").write_text(
        "RankHung: waiting for a peer to join for 5 s (Timeout): the process group did not form\n")
    message = failure_message(tmp_path, 2)
    assert message.startswith("rank 1 did not join the process group (stopped or stuck at start-up: rank 0 waiting "
                              "for a peer to join for 5 s (Timeout)")
    assert "it was then ended (signal 9)" in message and "DistStoreError" not in message
