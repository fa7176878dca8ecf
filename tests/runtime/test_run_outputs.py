"""What `planner run` writes goes through planner.outputs: run.log published without replacing a
file that appeared (and a full disk writing it is one line naming it), the plan copied beside the
measurements without replacing another plan file, and --checkpoint-dir held for the run's lifetime
like --out. torchrun is replaced by a stand-in (runtime.launch.run_local): what is tested is the
command's handling of its directories, not the ranks."""
from __future__ import annotations

import errno
import os

import pytest
from parity import plan_file

import runtime.launch
from planner import outputs, run_lock
from planner.cli import main
from planner.space import Choice
from runtime.launch import RunFailed


@pytest.fixture()
def plan(tmp_path):
    path = tmp_path / "plan.json"
    plan_file(Choice(), world=2).save(path)
    return path


def _one_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("planner run: ")
           or "error" in line]
    assert len(err) == 1 and "Traceback" not in err[0] and "internal error" not in err[0], err
    return err[0]


def _stand_in(monkeypatch, seen: list) -> None:
    """torchrun's place: records the log it was handed and what it found, then fails the run."""
    def run_local(nproc, worker, threads, log):
        log.write("a line of the ranks\n")
        seen.append((log, sorted(p.name for p in worker.out.iterdir())))
        raise RunFailed("rank 0 failed: stand-in")
    monkeypatch.setattr(runtime.launch, "run_local", run_local)


def test_run_log_is_published_whole_and_its_write_failure_is_one_line(tmp_path, plan, capsys, monkeypatch):
    seen: list = []
    _stand_in(monkeypatch, seen)
    out = tmp_path / "run"
    assert main(["run", str(plan), "--steps", "1", "--warmup", "0", "--out", str(out)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("planner run: stopped: rank 0 failed: stand-in")
    assert (out / "run.log").read_text() == "a line of the ranks\n" and ".lock" in seen[0][1]
    assert not list(out.glob(".run.log.*"))   # the temporary name is gone once published

    def full(text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(runtime.launch, "run_local", lambda n, w, t, log: (setattr(log.stream, "write", full),
                                                                          log.write("x")))
    assert main(["run", str(plan), "--steps", "1", "--warmup", "0", "--out", str(out), "--overwrite"]) == 1
    assert _one_line(capsys).endswith(f"cannot write {out / 'run.log'}: No space left on device")


def test_run_log_that_appeared_meanwhile_is_not_replaced(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("theirs\n")
    with pytest.raises(outputs.Clobbered, match="appeared while this command ran"):
        with outputs.new_stream(log, overwrite=False):
            pass
    assert log.read_text() == "theirs\n" and [p.name for p in tmp_path.iterdir()] == ["run.log"]
    with outputs.new_stream(log, overwrite=True) as stream:
        stream.write("ours\n")
    assert log.read_text() == "ours\n" and [p.name for p in tmp_path.iterdir()] == ["run.log"]


def test_another_plan_file_in_the_run_directory_is_refused_before_the_run(tmp_path, plan, capsys, monkeypatch):
    seen: list = []
    _stand_in(monkeypatch, seen)
    out = tmp_path / "run"
    out.mkdir()
    (out / "plan.json").write_text("{}\n")
    assert main(["run", str(plan), "--steps", "1", "--out", str(out)]) == 2
    assert f"--out {out} holds another plan.json; pass --overwrite" in _one_line(capsys)
    assert seen == [] and (out / "plan.json").read_text() == "{}\n"
    (out / "plan.json").write_text(plan.read_text())   # the same plan, e.g. run from the directory itself
    assert main(["run", str(out / "plan.json"), "--steps", "1", "--out", str(out)]) == 1   # ran, then failed
    assert "stand-in" in capsys.readouterr().err and len(seen) == 1


def test_a_checkpoint_directory_in_use_is_refused_in_one_line(tmp_path, plan, capsys, monkeypatch):
    """The first run is simulated by holding the directory's lock here (flock: another open file)."""
    seen: list = []
    _stand_in(monkeypatch, seen)
    ckpt = tmp_path / "ckpt"
    argv = ["run", str(plan), "--steps", "1", "--warmup", "0", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"]
    with run_lock.run_dir_lock(ckpt, "--checkpoint-dir"):
        assert main([*argv, "--out", str(tmp_path / "run")]) == 2
        assert _one_line(capsys) == (f"planner run: error: --checkpoint-dir {ckpt} is in use by another run "
                                     f"(pid {os.getpid()}); wait for it to end or choose another directory")
    assert seen == [] and not ckpt.exists() and not (tmp_path / "run").exists()
    assert main([*argv, "--out", str(ckpt)]) == 1   # one directory for both: one lock, held once; ran
    assert "stand-in" in capsys.readouterr().err and ".lock" in seen[0][1]
    assert not (ckpt / run_lock.LOCK_NAME).exists()   # released with the run


def test_a_reused_run_directory_keeps_no_earlier_result(tmp_path):
    """--overwrite into an earlier run's directory: its measured.json, raw figures and ranks' errors
    go before the ranks start (a run stopped before its first step would otherwise sit beside
    them), the plan a user keeps there stays."""
    from runtime.launch import clear_earlier_run
    for name in ("measured.json", "raw.json", "plan.json", "errors/rank1.txt"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("{}")
    clear_earlier_run(tmp_path)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["plan.json"]


def test_a_checkpoint_directory_of_only_an_interrupted_write_is_no_checkpoint_to_resume(tmp_path, plan, capsys):
    """Its folder is no checkpoint: --resume is refused, never started from step 0, and the
    folder is left for the user to see (--resume-if-present starts from step 0, said:
    tests/runtime/test_checkpoint_faults.py)."""
    partial = tmp_path / "ckpt" / ".step-000002.partial"
    (partial / "rng").mkdir(parents=True)
    assert main(["run", str(plan), "--steps", "4", "--out", str(tmp_path / "run"), "--checkpoint-dir",
                 str(tmp_path / "ckpt"), "--resume"]) == 2
    assert "no complete checkpoint to resume from (only .step-000002.partial)" in capsys.readouterr().err
    assert partial.exists()
