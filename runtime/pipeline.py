"""Pipeline split and schedules: the plan's explicit layers per (virtual) stage, placed on
pipeline ranks by `Plan.stage_rank` (loop placement, or V placement for ZBV), executed by the
`torch.distributed.pipelining` schedule class of the plan's schedule."""
from __future__ import annotations

import time
from dataclasses import dataclass
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


@dataclass
class StepClock:
    """One rank's split of a step, reset by the train loop before each step: the seconds its
    stages compute (forward, backward, backward for weights, with the tensor-parallel collectives
    inside them), its data-parallel gradient reduction after the pipeline, and the optimizer
    step; the rest of the pipeline phase is waiting (the bubble) and point-to-point transfer."""

    busy_s: float = 0.0
    dp_sync_s: float = 0.0
    optimizer_s: float = 0.0

    def reset(self) -> None:
        self.busy_s = self.dp_sync_s = self.optimizer_s = 0.0


class TimedStage(PipelineStage):
    """A PipelineStage that adds its compute and its gradient reduction to the job's StepClock."""

    def __init__(self, *args, clock: StepClock, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clock = clock

    def _timed(self, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.clock.busy_s += time.perf_counter() - start

    def perform_reduce_grad(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super().perform_reduce_grad(*args, **kwargs)
        finally:
            self.clock.dp_sync_s += time.perf_counter() - start

    def forward_one_chunk(self, *args, **kwargs):
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)


def build_schedule(plan: Plan, modules: dict[int, torch.nn.Module], pp_group, device: torch.device,
                   loss_fn, clock: StepClock):
    """One PipelineStage per local virtual stage, driven by the plan's schedule class."""
    stages = [TimedStage(mod, j, plan.num_virtual_stages, device, group=pp_group, clock=clock)
              for j, mod in sorted(modules.items())]
    traits = plan.schedule.traits
    cls = schedule_class(traits)
    target = stages if traits.multi_stage else stages[0]
    return cls(target, n_microbatches=plan.num_micro_batches, loss_fn=loss_fn)
