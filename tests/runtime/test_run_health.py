"""A run that breaks says so: a loss that stops being finite stops the run at that step with
exit 1 and one line naming it (no checkpoint of the broken state); `--resume` into a directory
without a checkpoint is an error, unless `--resume-if-present` asks to start afresh then."""
from __future__ import annotations

from pathlib import Path

from planner.cli import main
from runtime import checkpoint

TINY = ["predict", "--model", "debug-tiny", "--cluster", "1x2xxeon-amx", "--dtype", "fp32"]


def _plan(tmp_path: Path) -> Path:
    assert main([*TINY, "--out", str(tmp_path / "plan.json")]) == 0
    return tmp_path / "plan.json"


def test_a_diverged_run_stops_at_the_step_with_exit_1_and_keeps_no_broken_checkpoint(tmp_path, capsys):
    plan = _plan(tmp_path)
    capsys.readouterr()
    ckpt = tmp_path / "ckpt"
    code = main(["run", str(plan), "--steps", "4", "--warmup", "1", "--lr", "1e6", "--out", str(tmp_path / "run"),
                 "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[planner run]")]
    assert code == 1
    stopped = [line for line in err if "stopped:" in line]
    assert len(stopped) == 1 and "training diverged at step" in stopped[0] and "rank" in stopped[0], err
    step = int(stopped[0].split("training diverged at step ")[1].split(":")[0])
    assert step <= 3   # within one step of the first non-finite loss (lr 1e6: the second step's)
    assert all(s < step for s in checkpoint.complete_steps(ckpt))   # the broken state was never saved
    assert not (tmp_path / "run" / "measured.json").exists() or \
        '"complete": false' in (tmp_path / "run" / "measured.json").read_text()


def test_resume_without_a_checkpoint_is_an_error_and_resume_if_present_starts_afresh(tmp_path, capsys):
    plan = _plan(tmp_path)
    capsys.readouterr()
    missing = tmp_path / "misspelt"
    assert main(["run", str(plan), "--steps", "1", "--checkpoint-dir", str(missing), "--resume",
                 "--out", str(tmp_path / "r1")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no checkpoint (it does not exist)" in err[0] and "--resume-if-present" in err[0]
    assert main(["run", str(plan), "--steps", "1", "--warmup", "0", "--checkpoint-dir", str(missing),
                 "--resume-if-present", "--out", str(tmp_path / "r2")]) == 0
    assert checkpoint.complete_steps(missing) == [1]   # trained from step 0 and saved at the end
