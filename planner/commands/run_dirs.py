"""The directories `planner run` writes, each held by the run for its lifetime (a second run into
either is refused in one line naming it): --checkpoint-dir, whose earlier checkpoints are resumed,
replaced or refused under its lock, and --out, whose earlier results are refused unless
--overwrite, as is another plan file where the run copies its own."""
from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from costmodel.inputs import UserError
from costmodel.plan import PlanFile
from planner import outputs, run_lock

PLAN_COPY = "plan.json"


class RunRefused(UserError):
    """A plan or request the runtime cannot execute: one line, exit code 2."""


@contextlib.contextmanager
def held_dirs(args: argparse.Namespace, pf: PlanFile, out: Path) -> Iterator[int]:
    """--checkpoint-dir and --out held while the block lasts (one lock where they are one
    directory); yields the step the run resumes after (0: from the start)."""
    with contextlib.ExitStack() as held:
        resume_step = checkpoints(args, pf, held) if args.checkpoint_dir else 0
        outputs.out_dir(out, "--out", args.overwrite, outputs.RUN_FILES)
        if not (args.checkpoint_dir and Path(args.checkpoint_dir).resolve() == out.resolve()):
            held.enter_context(run_lock.run_dir_lock(out))
        outputs.out_dir(out, "--out", args.overwrite, outputs.RUN_FILES)   # again, held: a run may have ended
        _refuse_another_plan(args, out)
        yield resume_step


def checkpoints(args: argparse.Namespace, pf: PlanFile, held: contextlib.ExitStack) -> int:
    """Check --checkpoint-dir before any rank starts: writable; then, under its lock (`held`),
    earlier checkpoints resumed (--resume), replaced (--overwrite) or refused; the one a resume
    takes readable. Returns the step the run resumes after (0: from the start)."""
    from runtime import checkpoint, manifest
    root = Path(args.checkpoint_dir)
    if root.exists() and not root.is_dir():
        raise RunRefused(f"--checkpoint-dir {root} is a file; give a directory")
    if problem := outputs.writable_dir_problem(root):
        raise RunRefused(f"--checkpoint-dir: {problem}")
    existed = root.exists()
    held.enter_context(run_lock.run_dir_lock(root, "--checkpoint-dir"))   # before it is read or cleared
    earlier = checkpoint.any_attempt(root)
    if args.resume and checkpoint.latest(root) is None and not earlier:
        raise RunRefused(f"--resume: {root} holds no checkpoint ({'it is empty' if existed else 'it does not exist'}"
                         "); check the path, or pass --resume-if-present to start from step 0 when there is none")
    interrupted_only = checkpoint.interrupted_only(root)
    if interrupted_only and not (args.overwrite or args.resume or args.resume_if_present):
        # writes a stop cut short (.step-N.partial): no run resumes from them
        raise RunRefused(f"--checkpoint-dir {root} holds only interrupted checkpoint writes "
                         f"({', '.join(earlier[-3:])}), which no run resumes from; pass --resume-if-present or "
                         "--overwrite to start from step 0 (they are cleared)")
    if args.resume_if_present:
        args.resume = bool(earlier) and not interrupted_only
    if not args.resume:
        if earlier and not args.overwrite and not interrupted_only:
            raise RunRefused(f"--checkpoint-dir {root} holds checkpoints ({', '.join(earlier[-3:])}); pass "
                             "--resume to continue from them or --overwrite to replace them")
        if interrupted_only:
            print(f"planner run: clearing interrupted checkpoint writes in {root} ({', '.join(earlier[-3:])}); "
                  "starting from step 0", file=sys.stderr)
        elif earlier:
            print(f"planner run: --overwrite: removing the {len(earlier)} earlier checkpoint(s) in {root} "
                  f"({', '.join(earlier[-3:])})", file=sys.stderr)
        for name in earlier:
            shutil.rmtree(root / name)
        return 0
    try:   # sizes against the manifest here; the ranks compare the checksums before loading (and this
        # process, of a checkpoint it would refuse the run on: runtime.manifest's whole-file check)
        path, step, skipped = checkpoint.resume_point(root, pf, args.warmup + args.steps,
                                                      confirm=lambda at: manifest.problem(at, (0, 1)))
    except checkpoint.CheckpointError as exc:
        hint = "; pass --resume-if-present in its place to start from step 0" if interrupted_only else ""
        raise RunRefused(f"--resume: {exc}{hint}") from None
    if skipped:
        print(f"planner run: {checkpoint.skipped_line(skipped, path)}", file=sys.stderr)
    if path is not None:
        _resuming(args, pf, root, path, step, earlier)
    return step


def _resuming(args: argparse.Namespace, pf: PlanFile, root: Path, path: Path, step: int, earlier: list[str]) -> None:
    """A resume from `path` (step `step`) about to start: interrupted writes' folders, which no
    resume takes, removed under the directory's lock; a token stream other than the checkpoint's said."""
    from runtime import checkpoint
    for name in earlier:
        if checkpoint.is_interrupted_write(name):
            shutil.rmtree(root / name, ignore_errors=True)
    data = str(Path(args.data).resolve()) if args.data else None
    if differ := checkpoint.other_tokens(path, checkpoint.token_source(args.seed, data, args.data_dtype, pf.train)):
        print(f"planner run: warning: {path} was trained on other tokens ({differ}): from step {step} on "
              "this run draws another stream than that run would have", file=sys.stderr)


def copy_plan(args: argparse.Namespace, out: Path) -> None:
    """The plan beside its measurements, so the run directory is self-contained; not written
    where it is already (`planner run D/plan.json --out D`)."""
    text = Path(args.plan).read_text()
    if not _holds(out / PLAN_COPY, text):
        outputs.write_file(out / PLAN_COPY, text, args.overwrite)


def _refuse_another_plan(args: argparse.Namespace, out: Path) -> None:
    """Another plan file where the run would copy its own is refused before the run, not replaced
    after it (unless --overwrite)."""
    target = out / PLAN_COPY
    if args.overwrite or not (target.exists() or target.is_symlink()):
        return
    if not _holds(target, Path(args.plan).read_text()):
        raise RunRefused(f"--out {out} holds another {PLAN_COPY}; pass --overwrite to replace it, or choose "
                         "another directory")


def _holds(path: Path, text: str) -> bool:
    try:
        return path.read_text() == text
    except (OSError, UnicodeDecodeError):
        return False
