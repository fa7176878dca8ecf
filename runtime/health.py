"""A step's health: the global loss, the global gradient norm, and which ranks saw a value that
is not finite, all from one small all-reduce after the backward pass (before the optimizer step,
so that a non-finite step's update can be skipped and the run stopped before it is saved).

The gradient norm is the L2 norm of the whole model's gradient, as one process training the
same batch would compute it (`torch.nn.utils.clip_grad_norm_`'s norm): every rank adds its local
shards' squared norms, each divided by how many ranks hold the same shard. A parameter lives on
the world / pp ranks of its pipeline stage (every virtual stage of a pipeline rank has as many),
split into as many distinct shards as its DTensor's sharded mesh dimensions hold (FSDP2, TP,
experts); the other mesh dimensions, and ranks outside its mesh, hold copies (DDP replicas, TP
ranks of a norm's weight after their sum). The last stage's copy of an embedding split over stages
(a tied output layer, the MTP modules' input) holds the embedding's gradient after
runtime.job.sync_tied_embedding, so it is counted once, as the embedding.
"""
from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from costmodel.inputs import write_text_atomic
from runtime.job import Job
from runtime.launch import DIVERGED


class Diverged(RuntimeError):
    """The loss or the gradient norm stopped being finite for --max-nonfinite-steps steps in a
    row: the run stops (planner run exits 1 naming the step and the rank)."""


@dataclass(frozen=True, kw_only=True)
class StepHealth:
    loss: float              # mean over the global batch
    grad_norm: float         # L2 norm of the whole model's gradient
    bad_ranks: list[int]     # ranks whose own loss was not finite, else those whose gradient shards were not

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


def _tied_copy(job: Job):
    """The last stage's own copy of an embedding split over stages (a tied output layer's, the
    MTP modules'), where this rank holds it."""
    return job.embedding_copy


def grad_sq_share(job: Job) -> torch.Tensor:
    """This rank's share of the squared global gradient norm (float64, on the CPU)."""
    holders = dist.get_world_size() // job.plan.pp
    skip = _tied_copy(job)
    grads, weights = [], []
    for mod in job.modules.values():
        for p in mod.parameters():
            if p.grad is None or p is skip:
                continue
            grad, shards = p.grad, 1
            if isinstance(grad, DTensor):
                # FSDP2 over TP shards places the dp dim as a _StridedShard, which is_shard() denies
                shards = math.prod(grad.device_mesh.size(i) for i, pl in enumerate(grad.placements)
                                   if pl.is_shard() or isinstance(pl, _StridedShard))
                grad = grad.to_local()
            grads.append(grad)
            weights.append(shards / holders)
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    # one fused kernel per device and dtype (the parameters' norms in fp32, as clip_grad_norm_ does for bf16)
    norms = torch.stack([n.to(job.device) for n in torch._foreach_norm(grads, 2, dtype=torch.float32)]).double()
    return (norms * norms * torch.tensor(weights, dtype=torch.float64, device=job.device)).sum().cpu()


def step_health(job: Job, loss: torch.Tensor | None) -> StepHealth:
    """The step's global loss (mean over data-parallel replicas and CP ranks, weighted as
    job.loss_weight says), gradient norm and non-finite ranks; the same on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    contrib = loss.float().cpu() if (loss is not None and job.holds_loss) else torch.zeros(())
    contrib = contrib.double() * job.loss_weight / (job.plan.dp * job.plan.cp)
    share = grad_sq_share(job)
    packed = torch.zeros(2 + 2 * world, dtype=torch.float64)
    packed[0], packed[1] = contrib, share
    packed[2 + rank] = float(not math.isfinite(float(contrib)))
    packed[2 + world + rank] = float(not math.isfinite(float(share)))
    dist.all_reduce(packed)   # CPU tensors: gloo, also under "cpu:gloo,cuda:nccl"
    # a rank's own non-finite loss names it; a gradient reduction spreads one rank's NaN to its peers
    bad = [r for r in range(world) if packed[2 + r] > 0] or [r for r in range(world) if packed[2 + world + r] > 0]
    sq = float(packed[1])
    return StepHealth(loss=float(packed[0]), grad_norm=math.sqrt(sq) if sq >= 0 else math.nan, bad_ranks=bad)


def nonfinite_step(step: int, health: StepHealth, count: int, limit: int, partial: Path | None,
                   figures: Callable[[], dict | None], tag: str) -> None:
    """A step whose loss or gradient norm is not finite: its update was skipped (runtime.health);
    after --max-nonfinite-steps in a row the run stops, rank 0 keeping the figures so far marked
    `diverged` (what planner run turns into measured.json; its step counts the warm-up), and no
    checkpoint of this state. `tag`: the step as the progress lines name it."""
    where = f"{tag} on rank {health.bad_ranks[0] if health.bad_ranks else 0}"
    what = f"loss {health.loss}, gradient norm {health.grad_norm}"
    if count < limit:
        if dist.get_rank() == 0:
            print(f"[planner run] {where}: {what}; update skipped ({count} of --max-nonfinite-steps "
                  f"{limit} in a row)", file=sys.stderr, flush=True)
        return
    raw = figures()   # every rank takes part
    if raw is not None and partial is not None and raw["step_times_s"]:
        raw["diverged"] = {"step": step + 1, "ranks": health.bad_ranks, "loss": health.loss,
                           "grad_norm": health.grad_norm, "consecutive_steps": count}
        write_text_atomic(partial, json.dumps(raw))
    raise Diverged(f"{DIVERGED} at {where}: {what} ({count} non-finite step(s) in a row); no checkpoint of "
                   "this state was saved")
