"""How the profiler times a kernel, and the budget every curve and phase obeys.

Every curve obeys a `Budget`: sizes grow only while the next point's expected time (from the
rate just measured) stays under the per-point budget and the phase's share of the total, so a
dtype the hardware does not accelerate (bf16 on a CPU without AMX: ~1 GFLOP/s) stops at small
sizes instead of taking minutes. All ranks stop together (`_agree`)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


CALLS_PER_POINT = 4                                       # best_s: one warm-up + three timed


# Training-step probes: the median of PROBE_STEPS after PROBE_WARMUP (a shared 2-core machine
# moved single steps by 10-30 %; the fitted per-kernel cost moved 13 -> 60 us between profiles
# with 3 steps after 1).
PROBE_STEPS, PROBE_WARMUP = 5, 2


# Below this share of fp32's rate at equal FLOPs a dtype is "not accelerated" here.
ACCELERATED_RATIO = 0.5


# ... judged at calls this large and up: smaller ones are dominated by dispatch and conversions
# (bf16 on an AMX CPU reaches fp32's rate only from ~1e7 FLOPs, and twice it beyond).
ACCELERATED_CHECK_FLOPS = 3e7


# Each phase's share of the budget left when the microbenchmarks start ("units": the per-parameter
# and per-element costs). The probes' share is nominal: they take what the microbenchmarks leave,
# less the fit's reserve (planner.commands.profile).
PHASE_SHARES = {"gemm": 0.25, "memory": 0.06, "attention": 0.08, "units": 0.06, "collectives": 0.08,
                "probes": 0.37}


CURVE_PHASES = ("gemm", "memory", "attention")   # what a CPU's second pass measures again


@dataclass(frozen=True)
class Budget:
    """How long a profile may take (`total_s`) and one curve point (`point_s`: warm-up and
    repetitions together)."""
    total_s: float
    point_s: float

    def phase_s(self, phase: str) -> float:
        return self.total_s * PHASE_SHARES[phase]


# (total_s, point_s) per mode and device kind: the ceilings are 60 s on a 2-core CPU and
# 120 s on one GPU for the default; the totals leave room for start-up and the fit.
BUDGETS = {("quick", "cpu"): Budget(30.0, 0.15), ("default", "cpu"): Budget(45.0, 0.4),
           ("thorough", "cpu"): Budget(240.0, 2.0), ("quick", "cuda"): Budget(45.0, 0.2),
           ("default", "cuda"): Budget(90.0, 0.5), ("thorough", "cuda"): Budget(400.0, 2.0)}


def _agree(stop: bool) -> bool:
    """True on every rank when any rank wants to stop (their clocks differ slightly)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return stop
    flag = torch.tensor([1 if stop else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _over(expected_s: float, phase_start: float, phase_s: float, point_s: float) -> bool:
    return expected_s > point_s or time.perf_counter() - phase_start + expected_s > phase_s


def best_s(fn: Callable[[], object], repeat: int = 3, sync: Callable[[], None] = lambda: None,
           batch_s: float = 0.0, pick: Callable[[list[float]], float] = min) -> float:
    """The best of `repeat` timings of `fn` after one warm-up call (`pick`: another statistic of
    them, e.g. the median for sustained clocks). batch_s > 0: each timing is of as many calls
    back to back as fill batch_s (at most MAX_BATCH), divided by their number."""
    fn()
    sync()
    calls = 1
    if batch_s > 0:
        start = time.perf_counter()
        fn()
        sync()
        calls = max(1, min(MAX_BATCH, int(batch_s / max(time.perf_counter() - start, 1e-9))))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - start) / calls)
    return pick(times)


# A GPU runs the kernels a training step queues back to back; one call between two
# synchronisations times the launch and the synchronisation instead (~15 us on an H100 with
# torch 2.11, more than a small kernel's own work), so its points are timed in batches.
GPU_BATCH_S, MAX_BATCH = 2e-3, 64


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _timed(device: torch.device) -> dict:
    """best_s's keywords for kernels on `device`."""
    return {"sync": _sync(device), "batch_s": GPU_BATCH_S if device.type == "cuda" else 0.0}


def _device(device_type: str) -> torch.device:
    device = torch.device(device_type, dist.get_rank() if device_type == "cuda" else 0)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    return device
