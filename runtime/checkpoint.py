"""Checkpoints of a run: sharded with `torch.distributed.checkpoint` (each rank writes its own
part), resumable onto the same plan or onto another plan of the same model.

Layout: DIR/step-000006/ holds DCP's files, `plan.json` (what was running, and what fed it: token_source), one RNG file per rank,
`MANIFEST.json` (every file's size and SHA-256, runtime.manifest) and `COMPLETE`. A checkpoint is written into DIR/.step-000006.partial/ and renamed by rank 0 once
every rank has finished its part, so a half-written checkpoint is never the one a resume picks;
a complete one whose files no longer match its manifest is skipped for the newest that does.

Names are the model's own (`layers.<global index>...`, `embed`, `norm`, `output`): a pipeline
stage saves its layers under the names the whole model has, so a checkpoint saved under pp2 loads
under dp2 x tp2, and DCP reshards DTensors (FSDP2, TP) to whatever mesh the loading plan has.
Optimizer states are saved flattened (`state.<name>.<key>`) for the same reason.
"""
from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from costmodel.hardware.clusters import FINGERPRINT_KEY
from costmodel.inputs import UserError
from costmodel.plan import PlanFile
from costmodel.specs import ModelSpec, TrainSpec
from runtime import manifest
from runtime.launch import CHECKPOINT_WRITE_FAILED

COMPLETE = manifest.COMPLETE
_STEP_DIR = re.compile(r"^step-(\d{6})$")
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(UserError):
    """A checkpoint that cannot be resumed from: the message names the directory or file."""


class CheckpointRefused(CheckpointError):
    """The checkpoints a resume is handed cannot be taken: none complete, none that passes
    verification, one saved for another model or already at the run's end, or an earlier run's
    without a resume flag. The input's fault, however late the ranks find it (planner run's exit
    2); a checkpoint that verified and then fails to load stays a CheckpointError (exit 1)."""


class CheckpointWriteFailed(RuntimeError):
    """Storage refused a checkpoint's write (a full disk, a lost mount): the run stops (planner run
    exits 1 naming the file); the checkpoints already committed stay as they were."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def complete_steps(root: Path) -> list[int]:
    """Steps with a complete checkpoint under `root`, ascending."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for d in root.iterdir()
                  if (m := _STEP_DIR.match(d.name)) and (d / COMPLETE).is_file())


def any_attempt(root: Path) -> list[str]:
    """Names under `root` that look like checkpoints, complete or not."""
    if not root.is_dir():
        return []
    return sorted(d.name for d in root.iterdir() if d.name.startswith(("step-", ".step-")))


def _unfingerprinted(plan_doc: dict) -> dict:
    """A plan file's dict without its profile's fingerprint: the same plan on a profile measured
    again is the same plan to resume (its random streams included)."""
    cluster = {k: v for k, v in plan_doc.get("cluster", {}).items() if k != FINGERPRINT_KEY}
    return {**plan_doc, "cluster": cluster}


def is_interrupted_write(name: str) -> bool:
    """Whether a folder's name is a checkpoint write cut short (.step-N.partial: Saver writes there
    and renames it when whole), which no run resumes from."""
    return name.startswith(".") and name.endswith(".partial")


def interrupted_only(root: Path) -> bool:
    """Whether `root` holds checkpoint writes and all of them were cut short, and nothing else
    that looks like a checkpoint."""
    earlier = any_attempt(root)
    return bool(earlier) and all(is_interrupted_write(name) for name in earlier)


def latest(root: Path) -> Path | None:
    steps = complete_steps(root)
    return step_dir(root, steps[-1]) if steps else None


def token_source(seed: int, data: str | None, data_dtype: str, train: TrainSpec) -> dict:
    """What the token stream of a run depends on, as a checkpoint keeps it: a token file (and its
    dtype), else the seed of the synthetic tokens (runtime.data.TokenSource); the sequences a step
    takes, and their length."""
    return {"data": data, "data_dtype": data_dtype if data else None, "seed": None if data else seed,
            "global_batch": train.global_batch_size, "seq_len": train.seq_len}


def other_tokens(path: Path, tokens: dict) -> str | None:
    """How the checkpoint at `path` was fed otherwise than `tokens` says, or None (the same, or a
    checkpoint that did not record it)."""
    try:
        saved = json.loads((path / "plan.json").read_text()).get("tokens")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(saved, dict) or saved == tokens:
        return None
    return ", ".join(f"{k} {saved.get(k)!r} there, {v!r} here" for k, v in tokens.items()
                     if saved.get(k) != v and not (k == "data_dtype" and saved.get("data") != tokens["data"]))


def check_resumable(path: Path, pf: PlanFile) -> int:
    """The step a complete checkpoint was taken after; CheckpointError naming the bad file
    otherwise (never a silent fresh start)."""
    for name in (COMPLETE, ".metadata", "plan.json"):
        if not (path / name).is_file():
            raise CheckpointRefused(f"checkpoint {path}: {name} is missing (not a complete checkpoint)")
    try:
        saved = json.loads((path / "plan.json").read_text())
        step = int(saved["step"])
        model = saved["model"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path / 'plan.json'}: unreadable ({exc})") from None
    try:   # read as a spec: fields added since it was saved take their defaults
        spec = ModelSpec.from_dict(model, f"checkpoint {path / 'plan.json'}: model")
    except (UserError, AttributeError) as exc:
        raise CheckpointError(str(exc)) from None
    if spec != pf.model:
        theirs, ours = spec.to_dict(), pf.model.to_dict()
        differ = [k for k in ours if k != "source" and theirs[k] != ours[k]]
        if differ:
            raise CheckpointRefused(f"checkpoint {path}: saved for model {spec.name}, this plan trains "
                                  f"{pf.model.name} ({', '.join(differ)} differ)")
    return step


def resume_point(root: Path, pf: PlanFile, total_steps: int, verify=manifest.problem, confirm=None
                 ) -> tuple[Path | None, int, list[str]]:
    """(checkpoint, step it was taken after, why each newer one was skipped) to resume from: the
    newest complete checkpoint that `verify` (path -> problem or None) passes; (None, 0, []) where
    there is none. A CheckpointError where checkpoints exist but none can be resumed (never a
    silent fresh start) or the chosen one already reaches `total_steps`. The launcher asks before
    starting the ranks (sizes), the ranks again before loading (sizes and checksums, shared).
    `confirm` (path -> problem or None): a further check of a checkpoint that would end the run
    before it starts (at or past `total_steps`), so that no refusal rests on one the ranks would
    skip (the launcher's: every checksum of that one checkpoint)."""
    steps = complete_steps(root)
    if not steps:
        if earlier := any_attempt(root):
            raise CheckpointRefused(f"{root}: no complete checkpoint to resume from (only {', '.join(earlier)})")
        return None, 0, []
    skipped = []
    for candidate in reversed(steps):
        path = step_dir(root, candidate)
        if (bad := verify(path)) is None and confirm is not None and candidate >= total_steps:
            bad = confirm(path)
        if bad is None:
            break
        skipped.append(f"checkpoint {path}: {bad}")
    else:
        raise CheckpointRefused(f"{root}: no checkpoint passes verification ({'; '.join(skipped)})")
    step = check_resumable(path, pf)
    if step >= total_steps:
        raise CheckpointRefused(f"checkpoint {path} is at step {step}, and --warmup + --steps = {total_steps} ends "
                              f"{'there' if step == total_steps else 'before it'}: nothing more to train (raise --steps)")
    return path, step, skipped


def skipped_line(skipped: list[str], path: Path) -> str:
    """The one line saying which checkpoints failed verification and which one is resumed."""
    return f"{'; '.join(skipped)}; skipped for {path.name}, the newest that passes verification"


class _Stages(nn.Module):
    """This rank's stage modules under one parent, so one optimizer's states map to names."""

    def __init__(self, modules: dict[int, nn.Module]) -> None:
        super().__init__()
        for j, mod in modules.items():
            self.add_module(f"s{j}", mod)


_PREFIX = re.compile(r"^((?:state|param_groups)\.)?s\d+\.")


def _model_names(sd: dict) -> dict:
    """`s<j>.layers.3.w` -> `layers.3.w` (and so inside flattened optimizer keys)."""
    return {_PREFIX.sub(lambda m: m.group(1) or "", k): v for k, v in sd.items()}


def _state(modules: dict[int, nn.Module], optimizer) -> tuple[_Stages, dict, dict]:
    parent = _Stages(modules)
    msd, osd = get_state_dict(parent, optimizer, options=_OPTIONS)
    return parent, msd, osd


class Saver:
    """Writes a run's checkpoints; every rank makes the same calls.

    Synchronous (the default, and what costmodel.resilience prices): the step waits until every
    rank's part is on storage. In the background (`planner run --checkpoint-async`): DCP's
    `async_save` copies this rank's part to host memory (the step waits for that copy only) and a
    thread writes it over a gloo group of its own while training goes on; the checkpoint is
    committed (COMPLETE, renamed) by the next save or by `close`, after every rank's write ended.
    Either way a checkpoint is committed only whole, so an interrupted write is never resumed from.
    `wait_s` records, per save, the seconds this rank's training stood still for it."""

    def __init__(self, root: Path, pf: PlanFile, keep: int, background: bool = False, resumed_step: int = 0,
                 tokens: dict | None = None) -> None:
        self.root, self.pf, self.keep = root, pf, keep
        self.tokens = tokens   # where the run's tokens come from (token_source), recorded for a resume
        # a resume takes the newest checkpoint that passes verification, so every complete one after
        # it failed (its line names them): none counts toward --keep until this run writes its step
        self.failed = {s for s in complete_steps(root) if s > resumed_step} if resumed_step else set()
        # a group of its own: the writer thread's collectives must not interleave with training's
        self.group = dist.new_group(backend="gloo") if background else None
        self.wait_s: list[float] = []
        self._pending: tuple[object, Path, int] | None = None

    def save(self, step: int, modules: dict[int, nn.Module], optimizer) -> None:
        """Every rank calls this after step `step`."""
        start = time.perf_counter()
        self._commit_pending()   # one write at a time: the previous one ends first
        final = step_dir(self.root, step)
        partial = self.root / f".{final.name}.partial"
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)   # a crashed earlier attempt at this step
            (partial / "rng").mkdir(parents=True)
        dist.barrier()
        _, msd, osd = _state(modules, optimizer)
        state = {"model": _model_names(msd), "optim": _model_names(osd)}
        with _naming_failures(partial):
            if self.group is None:
                dcp.save(state, checkpoint_id=str(partial))
                writing = None
            else:
                writing = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.group)
            torch.save(torch.get_rng_state(), partial / "rng" / f"rank-{rank:05d}.pt")
        self._pending = (writing, partial, step)
        if writing is None:
            self._commit_pending()
        self.wait_s.append(time.perf_counter() - start)

    def close(self) -> None:
        """Commit a write still in the background (every rank, before the run returns)."""
        self._commit_pending()

    def _commit_pending(self) -> None:
        if self._pending is None:
            return
        writing, partial, step = self._pending
        self._pending = None
        with _naming_failures(partial):
            if writing is not None:   # torch returns a Future, or a response holding one
                getattr(writing, "upload_completion", writing).result()
            dist.barrier()
            if dist.get_rank() == 0:
                record = {"step": step, "model": self.pf.model.to_dict(), "plan": self.pf.to_dict(),
                          **({} if self.tokens is None else {"tokens": self.tokens})}
                (partial / "plan.json").write_text(json.dumps(record, indent=1))
            dist.barrier()
            files = _hashed_together(partial)
            if dist.get_rank() == 0:
                manifest.write(partial, files)
                (partial / COMPLETE).write_text(f"step {step}\n")
                final = step_dir(self.root, step)
                shutil.rmtree(final, ignore_errors=True)
                partial.rename(final)
                self._prune(step)
            self.failed.discard(step)
        dist.barrier()

    def _prune(self, step: int) -> None:
        """Keep the `keep` newest verified checkpoints up to the one just committed (hashed from
        storage, so verified as written): it is never pruned, and neither is a later one left by an
        earlier run (a resume from an older checkpoint overwrites it when it reaches that step). One
        that failed verification at the resume is left as it is, for the user to inspect, and not
        counted: with it counted, --keep 2 after a resume past a corrupted checkpoint deleted the
        older verified one and kept the corrupted one."""
        verified = [s for s in complete_steps(self.root) if s <= step and s not in self.failed]
        for old in verified[:-self.keep]:
            shutil.rmtree(step_dir(self.root, old), ignore_errors=True)


def _hashed_together(partial: Path) -> dict[str, dict]:
    """Every file's size and digest, each rank hashing its share of them (read back from storage,
    after every rank's write ended); the whole table on every rank."""
    names = manifest.listed(partial)
    share = manifest.entries(partial, manifest.mine(names, (dist.get_rank(), dist.get_world_size())))
    tables: list = [None] * dist.get_world_size()
    dist.all_gather_object(tables, share)
    return {k: v for table in tables for k, v in table.items()}


def verify_together(path: Path) -> str | None:
    """runtime.manifest.problem with the digests shared over the ranks; the same answer on each."""
    mine = manifest.problem(path, (dist.get_rank(), dist.get_world_size()))
    found: list = [None] * dist.get_world_size()
    dist.all_gather_object(found, mine)
    return next((bad for bad in found if bad is not None), None)


def _first_failure(exc: BaseException) -> tuple[int, BaseException]:
    """(rank, its exception): the lowest rank's inside DCP's CheckpointException, else this rank's."""
    if isinstance(exc, dcp.api.CheckpointException) and exc.failures:
        rank, (cause, _) = min(exc.failures.items(), key=lambda kv: kv[0])
        return rank, cause
    return dist.get_rank(), exc


@contextmanager
def _naming_failures(partial: Path):
    """A storage error inside a checkpoint's write (DCP wraps each rank's in a CheckpointException,
    a BaseException that names no file) as CheckpointWriteFailed naming the rank and the file."""
    try:
        yield
    except (OSError, dcp.api.CheckpointException) as exc:
        rank, cause = _first_failure(exc)
        code = getattr(cause, "errno", None)
        what = os.strerror(code) if code else str(cause).splitlines()[0][:200]
        full = " (the disk is full)" if code == errno.ENOSPC else ""
        raise CheckpointWriteFailed(f"{CHECKPOINT_WRITE_FAILED} on rank {rank}: {getattr(cause, 'filename', None) or partial}: "
                                    f"{what}{full}; the checkpoints committed before it are kept") from None


_TIED = ("output.weight", "embed.tok.weight")


def _tied_from_embedding(names: dict, path: Path, pf: PlanFile) -> dict:
    """A tied output layer split onto another stage than the embedding is its own parameter, kept
    equal to the embedding (runtime.job); a checkpoint saved with both on one stage has the
    output weight's entries only under the embedding's name (its optimizer states certainly; the
    shared parameter is one tensor). Those entries (equal by construction) then fill both."""
    if not pf.model.tied_embeddings:
        return names
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    out = {}
    for part, sd in names.items():
        out[part] = {}
        for key, value in sd.items():
            if f"{part}.{key}" not in saved and _TIED[0] in key:
                key = key.replace(_TIED[0], _TIED[1])
            out[part][key] = value
    return out


def load(path: Path, modules: dict[int, nn.Module], optimizer, pf: PlanFile) -> int:
    """Load a checkpoint into this rank's modules and optimizer (any plan of the same model);
    restore this rank's RNG where the plan is the one saved. Returns the step it was taken after."""
    step = check_resumable(path, pf)
    parent, msd, osd = _state(modules, optimizer)
    try:   # DCP raises several kinds (CheckpointException is a BaseException); the user needs the file and why
        request = _tied_from_embedding({"model": _model_names(msd), "optim": _model_names(osd)}, path, pf)
        dcp.load(request, checkpoint_id=str(path))   # in place; non-tensor values replaced in `request`
    except (Exception, dcp.api.CheckpointException) as exc:
        rank, cause = _first_failure(exc)
        raise CheckpointError(f"checkpoint {getattr(cause, 'filename', None) or path}: cannot be loaded (rank {rank}: "
                              f"{type(cause).__name__}: {str(cause).splitlines()[0][:300] if str(cause) else ''})") from None
    back = dict(zip(msd, request["model"].values()))     # key order is kept through the renames
    back_o = dict(zip(osd, request["optim"].values()))
    set_state_dict(parent, optimizer, model_state_dict=back, optim_state_dict=back_o, options=_OPTIONS)
    saved_plan = json.loads((path / "plan.json").read_text())["plan"]
    rng = path / "rng" / f"rank-{dist.get_rank():05d}.pt"
    if _unfingerprinted(saved_plan) == _unfingerprinted(pf.to_dict()) and rng.is_file():
        try:
            torch.set_rng_state(torch.load(rng))
        except Exception as exc:   # noqa: BLE001 - torch.load raises many kinds on a damaged file
            raise CheckpointError(f"checkpoint {rng}: unreadable ({type(exc).__name__}: {exc})") from None
    return step
