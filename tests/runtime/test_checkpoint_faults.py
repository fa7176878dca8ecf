"""Checkpoints that verify themselves, under injected faults: a shard corrupted on storage (bytes
flipped, same size) is named and the older verified checkpoint resumed, ending as the
uninterrupted run; a truncated shard, a truncated or corrupted RNG file is named; a save killed
half-way is ignored; a full disk during a save names the file and keeps the older checkpoint.
Ranks are forked (gloo on CPU)."""
from __future__ import annotations

import errno
import os
import shutil

import pytest
from parity import SEED, plan_file

from costmodel.specs import Optimizer
from planner.cli import main
from planner.space import Choice
from runtime import checkpoint, manifest
from runtime.fork import RankFailed, run_forked
from runtime.launch import RunFailed, failure_message
from runtime.train import RunConfig, run_rank

LR = 1e-2


def _plan():
    return plan_file(Choice(zero_stage=1, micro_batch_size=2), world=2, optimizer=Optimizer.ADAMW)


def _losses(pf, root, *, steps: int, resume: bool = False, every: int = 0) -> list[float]:
    cfg = RunConfig(steps=steps, warmup=0, seed=SEED, lr=LR, quiet=True, resume=resume,
                    checkpoint_dir=str(root), checkpoint_every=every)
    return run_forked(pf.plan.world_size, run_rank, pf, cfg)[0]["losses"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The uninterrupted 4-step run's losses and its checkpoints after steps 2 and 4."""
    root = tmp_path_factory.mktemp("saved")
    pf = _plan()
    losses = _losses(pf, root, steps=4, every=2)
    assert checkpoint.complete_steps(root) == [2, 4]
    return pf, losses, root


def _copy(saved, tmp_path, drop_newest: bool = False):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[2], ckpt)
    if drop_newest:
        shutil.rmtree(ckpt / "step-000004")
    return ckpt


def _largest_shard(step_dir):
    return max(step_dir.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _flip(path, num_bytes: int = 4096) -> None:
    """Invert `num_bytes` in the middle of the file, in place: the size stays."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - num_bytes // 2)
    data[start:start + num_bytes] = bytes(b ^ 0xFF for b in data[start:start + num_bytes])
    path.write_bytes(bytes(data))


def test_a_corrupted_shard_is_named_and_the_older_verified_checkpoint_resumed(saved, tmp_path, capfd):
    pf, whole, _ = saved
    ckpt = _copy(saved, tmp_path)
    shard = _largest_shard(ckpt / "step-000004")
    size = shard.stat().st_size
    _flip(shard)
    assert shard.stat().st_size == size
    capfd.readouterr()
    assert _losses(pf, ckpt, steps=4, resume=True) == whole[2:]   # from step 2: as if never interrupted
    err = capfd.readouterr().err
    assert f"{shard.name} does not match its sha256" in err and "skipped for step-000002" in err
    assert checkpoint.complete_steps(ckpt) == [2, 4]   # the older one kept, step 4 written again
    assert manifest.problem(ckpt / "step-000004", (0, 1)) is None


def test_keep_counts_verified_checkpoints_only(saved, tmp_path):
    """Resumed from step 2 past a corrupted step 4 and saved at step 6 with --keep 2: the verified
    step 2 stays beside step 6 (counting the corrupted one pruned it), and step 4 is left as found."""
    pf = saved[0]
    ckpt = _copy(saved, tmp_path)
    _flip(_largest_shard(ckpt / "step-000004"))
    _losses(pf, ckpt, steps=6, resume=True)
    assert checkpoint.complete_steps(ckpt) == [2, 4, 6]
    assert manifest.problem(ckpt / "step-000002", (0, 1)) is None and manifest.problem(ckpt / "step-000006", (0, 1)) is None
    assert "does not match its sha256" in manifest.problem(ckpt / "step-000004", (0, 1))


@pytest.mark.parametrize("damage", ["truncated shard", "truncated rng", "corrupted rng"])
def test_a_damaged_file_is_named_and_the_checkpoint_skipped(saved, tmp_path, damage):
    pf = saved[0]
    ckpt = _copy(saved, tmp_path)
    newest = ckpt / "step-000004"
    target = _largest_shard(newest) if "shard" in damage else newest / "rng" / "rank-00001.pt"
    if "truncated" in damage:
        os.truncate(target, target.stat().st_size // 2)
    else:
        _flip(target, 64)
    every_digest = lambda p: manifest.problem(p, (0, 1))   # noqa: E731 - what the ranks check, in one process
    path, step, skipped = checkpoint.resume_point(ckpt, pf, 6, every_digest)
    assert (path, step) == (ckpt / "step-000002", 2)
    name = target.relative_to(newest).as_posix()
    assert len(skipped) == 1 and str(newest) in skipped[0] and name in skipped[0]
    assert ("truncated" if "truncated" in damage else "corrupted on storage") in skipped[0]
    if "truncated" in damage:   # sizes: the launcher sees it before any rank starts
        assert checkpoint.resume_point(ckpt, pf, 6)[:2] == (ckpt / "step-000002", 2)


def test_resume_is_refused_in_one_line_when_no_checkpoint_passes(saved, tmp_path, capsys):
    pf = saved[0]
    ckpt = _copy(saved, tmp_path)
    for step in ("step-000002", "step-000004"):
        os.truncate(_largest_shard(ckpt / step), 100)
    plan = tmp_path / "plan.json"
    pf.save(plan)
    assert main(["run", str(plan), "--steps", "6", "--warmup", "0", "--checkpoint-dir", str(ckpt), "--resume",
                 "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint passes verification" in err[0] and ".distcp is 100 bytes" in err[0]


def test_a_save_killed_half_way_is_ignored(saved, tmp_path, monkeypatch):
    """Rank 0 dies after every rank wrote and hashed step 3, before the manifest is committed."""
    pf, whole, _ = saved
    ckpt = _copy(saved, tmp_path, drop_newest=True)
    write = manifest.write

    def killed(root, files):
        if root.name == ".step-000003.partial":
            os._exit(9)
        write(root, files)
    monkeypatch.setattr(manifest, "write", killed)
    with pytest.raises(RankFailed):
        _losses(pf, ckpt, steps=4, resume=True, every=1)
    monkeypatch.undo()
    assert (ckpt / ".step-000003.partial").is_dir() and checkpoint.complete_steps(ckpt) == [2]
    assert _losses(pf, ckpt, steps=4, resume=True) == whole[2:]


def test_a_full_disk_during_a_save_names_the_file_and_keeps_the_older_checkpoint(saved, tmp_path, monkeypatch):
    from torch.distributed.checkpoint import filesystem
    pf = saved[0]
    ckpt = _copy(saved, tmp_path, drop_newest=True)
    write_item = filesystem._write_item

    def full_disk(transforms, stream, *args, **kwargs):
        if os.environ["RANK"] == "1" and ".step-000004.partial" in stream.name:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), stream.name)
        return write_item(transforms, stream, *args, **kwargs)
    monkeypatch.setattr(filesystem, "_write_item", full_disk)
    with pytest.raises(RankFailed, match=r"checkpoint write failed on rank 1: \S+/\.step-000004\.partial/__1_0\.distcp: "
                                         r"No space left on device \(the disk is full\)"):
        _losses(pf, ckpt, steps=4, resume=True, every=2)
    assert checkpoint.complete_steps(ckpt) == [2]


def test_a_stopped_run_is_one_line_with_exit_1(tmp_path, capsys, monkeypatch):
    """How the ranks' causes reach the user: the storage failure's own line, not "rank 1 failed",
    and exit 1 (the run broke, not the command)."""
    out = tmp_path / "run"
    (out / "errors").mkdir(parents=True)
    line = ("step 4: CheckpointWriteFailed: checkpoint write failed on rank 1: /c/.step-000004.partial/__1_0.distcp: "
            "No space left on device (the disk is full); the checkpoints committed before it are kept")
    for rank in (0, 1):
        (out / "errors" / f"rank{rank}.txt").write_text(line + "\n\ntraceback\n")
    message = failure_message(out, 2)
    assert message.startswith("checkpoint write failed on rank 1: /c/.step-000004.partial/__1_0.distcp: No space")

    def failing(*_args):
        raise RunFailed(message)
    import runtime.launch
    monkeypatch.setattr(runtime.launch, "run_local", failing)
    plan = tmp_path / "plan.json"
    _plan().save(plan)
    capsys.readouterr()
    assert main(["run", str(plan), "--steps", "4", "--warmup", "0", "--checkpoint-dir", str(tmp_path / "c"),
                 "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    stopped = [e for e in err if "stopped:" in e]
    assert stopped == err[-1:] and "checkpoint write failed on rank 1" in stopped[0] and "Traceback" not in "".join(err)
    # a run from step 0 without warm-up is told what its first step's time carries
    assert any("warning: --warmup 0: the first timed step carries the start-up costs" in e for e in err)


def test_a_load_failure_past_verification_names_the_checkpoint_and_the_rank(saved, tmp_path, monkeypatch):
    """A shard damaged after it was verified (or never verified): DCP's CheckpointException, which
    names no file, becomes the checkpoint, the rank and the cause."""
    pf = saved[0]
    ckpt = _copy(saved, tmp_path, drop_newest=True)
    os.truncate(_largest_shard(ckpt / "step-000002"), 1000)
    monkeypatch.setattr(manifest, "problem", lambda *_args: None)
    with pytest.raises(RankFailed, match=r"CheckpointError: checkpoint \S+step-000002: cannot be loaded \(rank \d: \w+"):
        _losses(pf, ckpt, steps=4, resume=True)


def test_checkpoints_the_ranks_refuse_are_the_inputs_fault_one_line_with_exit_2(tmp_path, capsys, monkeypatch):
    """Only the ranks compare the checksums (each its share): when they find no checkpoint that
    passes, the run's input is at fault, not the run: one line naming the checkpoint and the
    file, exit 2, and no second note about steps never measured."""
    out = tmp_path / "run"
    (out / "errors").mkdir(parents=True)
    cause = (f"CheckpointRefused: {tmp_path / 'c'}: no checkpoint passes verification (checkpoint "
             f"{tmp_path / 'c' / 'step-000004'}: __0_0.distcp does not match its sha256 in manifest.json "
             "(corrupted on storage))")
    for rank in (0, 1):
        (out / "errors" / f"rank{rank}.txt").write_text(f"{cause}\n\ntraceback\n")
    message = failure_message(out, 2)

    def failing(*_args):
        raise RunFailed(message)
    import runtime.launch
    monkeypatch.setattr(runtime.launch, "run_local", failing)
    monkeypatch.setattr(checkpoint, "resume_point", lambda *_args, **_kw: (None, 0, []))   # the launcher's sizes pass
    plan = tmp_path / "plan.json"
    _plan().save(plan)
    (tmp_path / "c").mkdir()
    capsys.readouterr()
    assert main(["run", str(plan), "--steps", "4", "--warmup", "0", "--checkpoint-dir", str(tmp_path / "c"),
                 "--resume-if-present", "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "does not match its sha256" in err[-1] and err[-1].count("(log: ") == 1
    assert "no step was measured" not in "".join(err) and "Traceback" not in "".join(err)
    # a checkpoint that verified and then failed to load is no refusal: the run broke (exit 1)
    for rank in (0, 1):
        (out / "errors" / f"rank{rank}.txt").write_text(
            f"CheckpointError: checkpoint {tmp_path / 'c' / 'step-000004'}: cannot be loaded (rank {rank}: "
            "OutOfMemoryError: CUDA out of memory)\n\ntraceback\n")
    message = failure_message(out, 2)
    assert main(["run", str(plan), "--steps", "4", "--warmup", "0", "--checkpoint-dir", str(tmp_path / "c"),
                 "--resume-if-present", "--out", str(out), "--overwrite"]) == 1
    assert "cannot be loaded" in capsys.readouterr().err


def test_a_run_is_not_refused_on_a_checkpoint_the_ranks_would_skip(saved, tmp_path):
    """The launcher checks sizes only, but before it refuses a run because the newest checkpoint
    already reaches --steps, it compares that checkpoint's checksums: a corrupted one is skipped,
    as the ranks would, and the run resumes from the older."""
    pf = saved[0]
    ckpt = _copy(saved, tmp_path)
    _flip(_largest_shard(ckpt / "step-000004"))
    with pytest.raises(checkpoint.CheckpointError, match="nothing more to train"):
        checkpoint.resume_point(ckpt, pf, 4)   # sizes alone: step 4 is taken, and it ends the run
    path, step, skipped = checkpoint.resume_point(ckpt, pf, 4, confirm=lambda at: manifest.problem(at, (0, 1)))
    assert (path, step) == (ckpt / "step-000002", 2) and "does not match its sha256" in skipped[0]


def test_planner_run_resumes_past_a_corrupted_checkpoint_at_steps_instead_of_refusing(saved, tmp_path, capsys,
                                                                                        monkeypatch):
    """The launcher's own check, as planner run makes it: the newest checkpoint (step 4, corrupted)
    would end a 4-step run, so its checksums are compared before any refusal; it is skipped and
    the ranks are launched to resume after step 2 (the launch itself is stubbed)."""
    pf = saved[0]
    ckpt = _copy(saved, tmp_path)
    _flip(_largest_shard(ckpt / "step-000004"))

    def stopped(*_args):
        raise RunFailed("rank 0 failed: RuntimeError: stopped by the test")
    import runtime.launch
    monkeypatch.setattr(runtime.launch, "run_local", stopped)
    plan = tmp_path / "plan.json"
    pf.save(plan)
    capsys.readouterr()
    assert main(["run", str(plan), "--steps", "4", "--warmup", "0", "--checkpoint-dir", str(ckpt), "--resume",
                 "--out", str(tmp_path / "run")]) == 1   # launched: not refused (exit 2) on step 4
    err = capsys.readouterr().err
    assert "does not match its sha256" in err and "skipped for step-000002" in err and "resuming after step 2" in err


def test_only_interrupted_writes_are_no_checkpoint_to_resume(tmp_path, capsys, monkeypatch):
    """A stop during the first save leaves .step-000001.partial alone: a plain rerun is told
    that no run resumes from it and how to start afresh, --resume the same, and
    --resume-if-present starts from step 0 with the writes cleared (said); the ranks agree."""
    ckpt = tmp_path / "c"
    (ckpt / ".step-000001.partial").mkdir(parents=True)
    plan = tmp_path / "plan.json"
    _plan().save(plan)
    started = []
    import runtime.launch
    monkeypatch.setattr(runtime.launch, "run_local", lambda *args: started.append(args) or None)
    base = ["run", str(plan), "--steps", "2", "--checkpoint-dir", str(ckpt)]
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "holds only interrupted checkpoint writes (.step-000001.partial)" in err and "--resume-if-present" in err
    assert main([*base, "--resume", "--out", str(tmp_path / "b")]) == 2
    assert "start from step 0" in capsys.readouterr().err and not started
    main([*base, "--resume-if-present", "--out", str(tmp_path / "d")])   # the faked launch measures nothing
    assert "clearing interrupted checkpoint writes" in capsys.readouterr().err
    assert started and not (ckpt / ".step-000001.partial").exists()
    # --overwrite replaces complete checkpoints too, naming them
    (ckpt / "step-000004").mkdir()
    main([*base, "--overwrite", "--out", str(tmp_path / "e")])
    assert f"--overwrite: removing the 1 earlier checkpoint(s) in {ckpt} (step-000004)" in capsys.readouterr().err
    # the ranks, launched by hand with --resume-if-present (--print-launch), start from step 0 too
    (ckpt / ".step-000001.partial").mkdir()
    cfg = RunConfig(steps=1, warmup=0, seed=SEED, lr=LR, quiet=True, resume_if_present=True, checkpoint_dir=str(ckpt))
    assert len(run_forked(2, run_rank, _plan(), cfg)[0]["losses"]) == 1
    # and a restart of a run that died in its first save (torchrun --max-restarts) starts over
    died = tmp_path / "died"
    (died / ".step-000001.partial").mkdir(parents=True)
    from types import SimpleNamespace

    from runtime.train import _resume
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restart = SimpleNamespace(checkpoint_dir=str(died), resume=False, resume_if_present=False)
    assert _resume(None, None, None, restart, 10) == 0
