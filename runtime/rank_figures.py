"""What a rank hands back of its steps: the figures every rank takes part in gathering (step
times, per-stage peaks and busy times, all-reduced) and rank 0 returns, and the full parameters
tests compare against a single process."""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

from runtime import checkpoint
from runtime.job import Job


def per_rank_median(values: list[float]) -> list[float]:
    """Every rank's median of its own values, gathered in rank order."""
    table = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    table[dist.get_rank()] = statistics.median(values) if values else 0.0
    dist.all_reduce(table)
    return table.tolist()


def rank0_figures(job: Job, device: torch.device, memory: float | None, losses, times, busy, sync,
             optim, mine, saver: checkpoint.Saver | None = None, grad_norms=None,
             compiled: bool = False) -> dict | None:
    """Rank 0's raw figures of the steps so far (every rank takes part: peaks are all-reduced)."""
    reserved = None
    if device.type == "cuda":
        memory = torch.cuda.max_memory_allocated()
        reserved = peak_per_stage(job, torch.cuda.max_memory_reserved())   # the allocator's own share too
    peak = peak_per_stage(job, memory)
    rank_forward = per_rank_median(mine)
    saves = slowest_rank(saver.wait_s) if saver and saver.wait_s else None
    if dist.get_rank() != 0:
        return None
    return {"losses": losses, "grad_norms": grad_norms, "step_times_s": times, "peak_memory_bytes": peak,
            "peak_reserved_bytes": reserved,
            # the median, as for the step time (runtime.measure), so that work <= step holds
            "stage_busy_s": [statistics.median(col) for col in zip(*busy)] if busy else None,
            "stage_dp_sync_s": [statistics.median(col) for col in zip(*sync)] if sync else None,
            "stage_optimizer_s": [statistics.median(col) for col in zip(*optim)] if optim else None,
            "rank_forward_s": rank_forward,
            "checkpoint_wait_s": saves,
            "memory_source": ("torch.cuda.max_memory_allocated" if device.type == "cuda" else
                              "live tensor bytes over the last warm-up step, tracked by "
                              "runtime.memtrack (CPU: tensors only, no allocator or interpreter "
                              "overhead)" if memory is not None else
                              "not measured (a compiled run's: torch.compile refuses the tensor tracker's "
                              "dispatch mode)" if compiled else
                              "not measured (a CPU's is taken over a warm-up step: none ran here; --warmup >= 1 "
                              "in a run from step 0, which a resumed one is not)"),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}


def slowest_rank(values: list[float]) -> list[float]:
    """Each entry's maximum over the ranks (every rank has as many)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def slowest_s(elapsed_s: float) -> float:
    """The slowest rank's step time."""
    slowest = torch.tensor([elapsed_s])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)   # CPU tensors: gloo, also under "cpu:gloo,cuda:nccl"
    return float(slowest[0])


def per_stage_max(job: Job, value: float) -> list[float]:
    """Per pipeline rank, the largest value over its ranks (one small all-reduce, untimed)."""
    table = torch.zeros(job.plan.pp, dtype=torch.float64)
    table[job.coords["pp"]] = value
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return table.tolist()


def peak_per_stage(job: Job, memory: float | None) -> list[float] | None:
    """Per pipeline rank, the largest peak over its ranks."""
    if memory is None:
        return None
    table = torch.zeros(job.plan.pp, dtype=torch.float64)
    table[job.coords["pp"]] = memory
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return table.tolist()


def gather_params(job: Job) -> dict[str, torch.Tensor] | None:
    """Full parameters by name on rank 0 (DTensor.full_tensor inside each stage, then objects
    across pipeline ranks). For tests: it gathers everything."""
    mine = {}
    for mod in job.modules.values():
        for name, p in mod.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            mine[name.replace("_checkpoint_wrapped_module.", "")] = full.detach().float().cpu()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return None
    out: dict[str, torch.Tensor] = {}
    for part in gathered:
        out.update(part)
    return out
