"""The training loop one rank runs, and what it measures.

Per step: the rank's slice of the global batch (runtime.data), forward/backward over the plan's
micro-batches (a pipelining schedule when pp > 1, gradient accumulation otherwise), tied
embedding sync, optimizer step. Warm-up steps are not timed. The step time is the slowest rank's
(ranks start each step together after a barrier). Peak memory: `torch.cuda.max_memory_allocated`
on GPU; on CPU the live tensor bytes over the last warm-up step (runtime.memtrack: tensors only,
not the allocator's or the interpreter's overhead; said so in measured.json).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.profiler import record_function

from costmodel.inputs import write_text_atomic
from costmodel.plan import PlanFile
from costmodel.specs import Optimizer
from runtime import checkpoint, watchdog
from runtime.data import TokenSource, local_slice
from runtime.health import Diverged, nonfinite_step, step_health  # noqa: F401 - Diverged: the run's error
from runtime.job import (
    Job,
    build_job,
    cross_entropy,
    sync_replicated_over_tp,
    sync_tied_embedding,
    update_balancing_biases,
)
from runtime.launch import StepsConfig
from runtime.memtrack import TensorBytesTracker, state_tensors
from runtime.optimizer import adamw
from runtime.parallel import gradient_sync_every_micro_batch
from runtime.rank_figures import gather_params, per_stage_max, rank0_figures, slowest_s

TIMED_STEP = "planner::timed_step"   # the profiler's range around a step's timed work


@dataclass(frozen=True, kw_only=True)
class RunConfig(StepsConfig):
    collect_params: bool = False    # tests: gather full parameters on rank 0
    quiet: bool = False
    fault: tuple[int, int, str] | None = None   # (rank, step, "raise" | "exit"): failure tests
    partial: Path | None = None     # rank 0 rewrites its figures here after every timed step
    # called with the step's index after each step, warm-up ones too (benchmarks/step_trace.py
    # steps its profiler's schedule with it, so that a trace holds the timed steps alone)
    after_step: Callable[[int], None] | None = None


def init_distributed(timeout_s: float = 120.0) -> None:
    """NCCL for CUDA tensors and gloo for CPU ones when a GPU is present, else gloo."""
    kwargs: dict = {"timeout": timedelta(seconds=timeout_s)}
    if attempt := restart_count():
        # torchrun keeps one store across restarts, and the subgroups (DeviceMesh) are named alike
        # in every attempt: without a prefix of our own the restarted ranks read the dead
        # attempt's addresses (gloo: "connectFullMesh ... Connection refused")
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=timeout_s))
        kwargs.update(store=dist.PrefixStore(f"planner-attempt-{attempt}/", base),
                      rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("cpu:gloo,cuda:nccl", **kwargs)
    else:
        dist.init_process_group("gloo", **kwargs)


def make_optimizer(job: Job, pf: PlanFile, lr: float) -> torch.optim.Optimizer:
    params = job.parameters()
    if pf.train.optimizer is Optimizer.SGD:
        return torch.optim.SGD(params, lr=lr)
    optimizer, note = adamw(params, lr)   # fused where torch runs it (runtime.optimizer)
    if note and dist.get_rank() == 0:
        print(f"[planner run] optimizer: {note}", file=sys.stderr, flush=True)
    return optimizer


def forward_backward(job: Job, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """One step's gradients on this rank; returns the mean loss of its micro-batches (or None
    on ranks without the last stage)."""
    plan = job.plan
    x, y = tokens.to(job.device), labels.to(job.device)
    if job.schedule is not None:
        losses: list[torch.Tensor] = []
        first, last = 0 in job.modules, job.num_stages - 1 in job.modules
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": losses, "labels": y} if last else {}   # labels: MTP (runtime.mtp)
        # return_outputs=False: otherwise the last stage keeps every micro-batch's logits until
        # the step ends (torch's output_chunks), which the cost model does not count
        job.schedule.step(*args, return_outputs=False, **kwargs)
        return torch.stack(losses).mean().detach() if last else None
    model = job.modules[0]
    m = plan.num_micro_batches
    total = torch.zeros((), device=job.device)
    start = time.perf_counter()
    for k, (xs, ys) in enumerate(zip(x.chunk(m), y.chunk(m))):
        final = k == m - 1
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(final or gradient_sync_every_micro_batch(plan))
            model.set_reshard_after_backward(final or plan.zero_stage == 3)
        loss = cross_entropy(model(xs, ys), ys)   # the labels feed MTP modules (runtime.mtp)
        (loss * (job.loss_weight / m)).backward()
        total += loss.detach()
    _drain(job.device)
    job.clock.busy_s += time.perf_counter() - start   # no pipeline: all of it is the stage's work
    return total / m


def run_rank(pf: PlanFile, cfg: RunConfig) -> dict | None:
    """Train on this rank (process group already initialised); rank 0 returns the raw figures."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    job = build_job(pf, device, seed=cfg.seed, compile=cfg.compile)
    # Dropout: one RNG stream per (replica, stage); TP ranks of a replica share it, so masks on
    # replicated activations agree. Initialisation does not use this stream (runtime.model).
    torch.manual_seed(cfg.seed * 1_000_003 + job.coords["dp"] * 1009 + job.coords["pp"])
    optimizer = make_optimizer(job, pf, cfg.lr)
    source = TokenSource(pf.model.vocab_size, pf.train.seq_len, cfg.seed, cfg.data, cfg.data_dtype)
    losses, grad_norms, times, busy, sync, optim, memory = [], [], [], [], [], [], None
    nonfinite = 0   # consecutive steps with a non-finite loss or gradient norm
    every_s: list[float] = []   # every step's time, warm-up too: what a run diverged before its timed steps keeps
    mine: list[float] = []   # this rank's own layer forwards per timed step (stragglers, runtime.measure)
    if cfg.fault is not None and cfg.fault[2] in ("slow", "nan") and cfg.fault[0] == dist.get_rank():
        _slow_down(job) if cfg.fault[2] == "slow" else _poison(job, cfg.fault[1])
    forward = _ForwardTimer(job)
    total = cfg.warmup + cfg.steps
    start = _resume(job, optimizer, pf, cfg, total)
    saver = (checkpoint.Saver(Path(cfg.checkpoint_dir), pf, cfg.keep, background=cfg.checkpoint_async,
                              resumed_step=start, tokens=checkpoint.token_source(cfg.seed, cfg.data, cfg.data_dtype, pf.train))
             if cfg.checkpoint_dir else None)
    if cfg.hang_timeout and cfg.partial is not None:   # the launcher's errors file names the cause
        watchdog.watch(job.modules.values(), cfg.partial.parent / "errors" / f"rank{dist.get_rank()}.txt",
                       cfg.hang_timeout)
    for step in range(start, total):
        first, count = local_slice(step, pf.train.global_batch_size, pf.plan.dp, job.coords["dp"], job.samples)
        tokens, labels = map(job.local_tokens, source.batch(first, count))
        # torch.compile refuses a step under the tracker's dispatch mode: a compiled run's CPU memory is not taken
        track = step == cfg.warmup - 1 and device.type == "cpu" and not cfg.compile
        if step == cfg.warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        watchdog.beat()
        tag = watchdog.step_label(step, cfg.warmup, cfg.steps)
        watchdog.at_step(step + 1, tag)
        _maybe_fail(cfg.fault, step)
        dist.barrier()
        job.clock.reset()
        forward.total_s = 0.0
        start = time.perf_counter()
        with record_function(TIMED_STEP):   # what a trace counts as the step (benchmarks/step_trace.py)
            health, tracked = _step(job, optimizer, tokens, labels, track)
            _drain(device)
        elapsed = time.perf_counter() - start
        memory = tracked if track else memory
        step_loss, step_s = health.loss, slowest_s(elapsed)
        losses.append(step_loss)
        grad_norms.append(health.grad_norm)
        every_s.append(step_s)
        if step >= cfg.warmup:
            times.append(step_s)
            busy.append(per_stage_max(job, job.clock.busy_s))
            mine.append(forward.total_s)
            sync.append(per_stage_max(job, job.clock.dp_sync_s))
            optim.append(per_stage_max(job, job.clock.optimizer_s))
        if dist.get_rank() == 0 and not cfg.quiet:
            # the step whose live tensors runtime.memtrack follows is slower for it: say why
            tracked_note = " (every live tensor tracked for the memory figure: slower)" if track else ""
            print(f"[planner run] {tag}: loss {step_loss:.4f}, grad norm {health.grad_norm:.4g}, "
                  f"{step_s * 1e3:.1f} ms{tracked_note}", file=sys.stderr, flush=True)
        nonfinite = 0 if health.finite else nonfinite + 1
        if nonfinite:   # every rank decides alike (the values are global), before this state is saved
            nonfinite_step(step, health, nonfinite, cfg.max_nonfinite_steps, cfg.partial, lambda: rank0_figures(
                job, device, memory, losses, times or every_s, busy, sync, optim, mine, saver, grad_norms,
                compiled=cfg.compile), tag)
        if saver and (step + 1 == total or (cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0)):
            with watchdog.paused():
                saver.save(step + 1, job.modules, optimizer)
        if cfg.after_step is not None:
            cfg.after_step(step)
        if cfg.partial is not None and step >= cfg.warmup and step < cfg.warmup + cfg.steps - 1:
            raw = rank0_figures(job, device, memory, losses, times, busy, sync, optim, mine, saver, grad_norms,
                        compiled=cfg.compile)
            if raw is not None:   # untimed, after the step: what an interrupted run keeps
                write_text_atomic(cfg.partial, json.dumps(raw))
    if saver:
        with watchdog.paused():
            saver.close()
    raw = rank0_figures(job, device, memory, losses, times, busy, sync, optim, mine, saver, grad_norms,
                        compiled=cfg.compile)
    params = gather_params(job) if cfg.collect_params else None
    return None if raw is None else {**raw, "params": params}


def _resume(job: Job, optimizer, pf: PlanFile, cfg: RunConfig, total: int) -> int:
    """The step to start from: 0, or the step of the newest verified checkpoint with --resume
    (its weights, optimizer states and, under the plan it was saved with, this rank's RNG), with
    --resume-if-present where there is one. A first attempt without either in a directory of
    earlier checkpoints stops: its own would sit among theirs, and a later resume take theirs.
    Writes cut short alone are no checkpoint: --resume-if-present and a restart start from step 0."""
    if not cfg.checkpoint_dir:
        return 0
    root = Path(cfg.checkpoint_dir)
    if checkpoint.interrupted_only(root) and (cfg.resume_if_present or restart_count()):
        return 0   # only writes cut short, which no run resumes from (the saver replaces a step's own)
    if not (cfg.resume or restart_count()):   # a restart resumes by itself
        earlier = checkpoint.any_attempt(root)
        if not earlier:
            return 0
        if not cfg.resume_if_present:
            raise checkpoint.CheckpointRefused(
                f"--checkpoint-dir {root} holds checkpoints of an earlier run ({', '.join(earlier[-3:])}): launch "
                "with --resume or --resume-if-present to continue from them, or clear it")
    # every file's size, and each rank a share of the checksums: a damaged newer one is skipped
    path, _, skipped = checkpoint.resume_point(root, pf, total, checkpoint.verify_together)
    if skipped and dist.get_rank() == 0:
        print(f"[planner run] {checkpoint.skipped_line(skipped, path)}", file=sys.stderr, flush=True)
    return 0 if path is None else checkpoint.load(path, job.modules, optimizer, pf)


class _ForwardTimer:
    """Seconds this rank spends inside its layers' forwards (after FSDP's gathers, which its
    pre-hooks run first; TP collectives included): unlike a step's time, which every rank shares
    by waiting for the slowest at the next collective, this is a rank's own."""

    def __init__(self, job: Job) -> None:
        self.total_s, self._start = 0.0, 0.0
        for mod in job.modules.values():
            for layer in mod.layers.values():
                layer.register_forward_pre_hook(self._enter)
                layer.register_forward_hook(self._leave)

    def _enter(self, *_args) -> None:
        self._start = time.perf_counter()

    def _leave(self, *_args) -> None:
        self.total_s += time.perf_counter() - self._start


def _poison(job: Job, step: int) -> None:
    """Failure tests: this rank's layer outputs turn NaN in step `step` (0-based) of the first
    attempt, as a diverging run's would."""
    def hook(_mod, _args, out):
        return out * math.nan if watchdog.current_step() == step + 1 and not restart_count() else None
    for mod in job.modules.values():
        for layer in mod.layers.values():
            layer.register_forward_hook(hook)


def _slow_down(job: Job) -> None:
    """Failure tests: a straggler, 20 ms slower at the end of every layer's forward (inside what
    _ForwardTimer times, as slow compute would be)."""
    for mod in job.modules.values():
        for layer in mod.layers.values():
            layer.register_forward_hook(lambda *_: time.sleep(0.02), prepend=True)


def restart_count() -> int:
    """How often torchrun has restarted this job's ranks (torchrun --max-restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _maybe_fail(fault: tuple[int, int, str] | None, step: int) -> None:
    """Failure tests: a fault on the first attempt only, so that a restart can get past it."""
    if fault is None or fault[0] != dist.get_rank() or fault[1] != step or restart_count() or fault[2] in ("slow", "nan"):
        return   # "slow" is a straggler, not a failure (_slow_down); "nan" a diverging step (_poison)
    if fault[2] == "exit":
        os._exit(3)   # dies without a Python error, as a killed process would
    if fault[2] == "kill":
        import signal
        os.kill(os.getpid(), signal.SIGKILL)
    if fault[2] == "hang":
        time.sleep(24 * 3600)   # alive, silent, making no progress
    raise RuntimeError("injected fault")


def _drain(device: torch.device) -> None:
    """Wait for the GPU's queue: a host clock read without it times the launches, not the work
    (the step ends with a synchronize anyway; this one costs it at most the optimizer's launches)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(job: Job, optimizer, tokens, labels, track: bool):
    if not track:
        loss = forward_backward(job, tokens, labels)
        sync_tied_embedding(job)
        sync_replicated_over_tp(job)
        health = step_health(job, loss)   # global loss and gradient norm: one small all-reduce
        _drain(job.device)
        start = time.perf_counter()
        if health.finite:   # a non-finite gradient never reaches the weights (runtime.health)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _drain(job.device)
        job.clock.optimizer_s = time.perf_counter() - start
        update_balancing_biases(job, health.finite)   # a few floats per layer, untimed: not the optimizer's
        return health, None
    tracker = TensorBytesTracker(state_tensors(job.modules.values(), optimizer))
    with tracker:
        health, _ = _step(job, optimizer, tokens, labels, False)
    return health, float(tracker.peak_bytes)

