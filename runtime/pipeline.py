"""Pipeline split and schedules: the plan's explicit layers per (virtual) stage, placed on
pipeline ranks by `Plan.stage_rank` (loop placement, or V placement for ZBV), executed by the
`torch.distributed.pipelining` schedule class of the plan's schedule."""
from __future__ import annotations

import time
from itertools import accumulate

import torch
from torch.distributed import pipelining
from torch.distributed.pipelining import PipelineStage

from costmodel.plan import Plan, ScheduleTraits


def schedule_class(traits: ScheduleTraits) -> type:
    """The torch.distributed.pipelining class a schedule's traits name (zb-h1 (Qi et al. 2024)
    is torch's InterleavedZeroBubble; with one stage per rank it is ZB-H1)."""
    return getattr(pipelining, traits.torch_class)


def stage_layer_ids(plan: Plan) -> list[list[int]]:
    """Global layer indices of every virtual stage, in model order."""
    ends = list(accumulate(plan.layers_per_stage))
    return [list(range(end - n, end)) for n, end in zip(plan.layers_per_stage, ends)]


def local_stages(plan: Plan, pp_rank: int) -> list[int]:
    """Virtual stages this pipeline rank runs, in increasing stage order."""
    return [j for j in range(plan.num_virtual_stages) if plan.stage_rank(j) == pp_rank]


class TimedStage(PipelineStage):
    """A PipelineStage that adds up the seconds it computes (forward, backward, backward for
    weights, including the tensor-parallel collectives inside them) and the seconds of its
    data-parallel gradient reduction at the end of the step; the rest of a rank's pipeline
    phase is waiting (the bubble) and point-to-point transfer."""

    busy_s = 0.0
    dp_sync_s = 0.0
    optimizer_s = 0.0   # set by the train loop: the optimizer step follows the pipeline phase

    def _timed(self, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TimedStage.busy_s += time.perf_counter() - start

    def perform_reduce_grad(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super().perform_reduce_grad(*args, **kwargs)
        finally:
            TimedStage.dp_sync_s += time.perf_counter() - start

    def forward_one_chunk(self, *args, **kwargs):
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)


def build_schedule(plan: Plan, modules: dict[int, torch.nn.Module], pp_group, device: torch.device,
                   loss_fn):
    """One PipelineStage per local virtual stage, driven by the plan's schedule class."""
    stages = [TimedStage(mod, j, plan.num_virtual_stages, device, group=pp_group)
              for j, mod in sorted(modules.items())]
    traits = plan.schedule.traits
    cls = schedule_class(traits)
    target = stages if traits.multi_stage else stages[0]
    return cls(target, n_microbatches=plan.num_micro_batches, loss_fn=loss_fn)
