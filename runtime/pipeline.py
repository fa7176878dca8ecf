"""Pipeline split and schedules: the plan's explicit layers per (virtual) stage, placed on
pipeline ranks by `Plan.stage_rank` (loop placement, or V placement for ZBV and DualPipeV),
executed by the `torch.distributed.pipelining` schedule class of the plan's schedule. DualPipeV's
overlapped pairs (OVERLAP_F_B) run as torch's runner runs them without a registered custom
function: the forward, then the other micro-batch's backward, on one stream.

Pipeline buffers live as long as their consumer needs them, as in Megatron-LM's schedules, not
until the step ends as torch keeps them: a stage's receive buffers (one per micro-batch, made
once and kept across steps by `PipelineStage`) are emptied once the micro-batch's backward (its
weight pass, where deferred) is done and filled again at the next receive; the input gradient
sent back is dropped from the receive buffer's `.grad` once sent; and under the multi-stage
runner (`_PipelineScheduleRuntime`, which holds every send's Work until the step's end) the
stage issues its sends itself and lets each go once delivered (`Sends`). Counted by
costmodel.memory (`pipeline_sends_held` off for our runtime), measured by
tests/runtime/test_run_cli.py.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist
from torch.distributed import pipelining
from torch.distributed.pipelining import PipelineStage

from costmodel.plan import Plan
from costmodel.schedules import ScheduleTraits
from runtime.moe import MoE, counted_routes


def schedule_class(traits: ScheduleTraits) -> type:
    """The torch.distributed.pipelining class a schedule's traits name (zb-h1 (Qi et al. 2024)
    is torch's InterleavedZeroBubble; with one stage per rank it is ZB-H1)."""
    return getattr(pipelining, traits.torch_class)


def stage_layer_ids(plan: Plan) -> list[list[int]]:
    """Global layer indices of every virtual stage, in model order."""
    ends = list(accumulate(plan.layers_per_stage))
    return [list(range(end - n, end)) for n, end in zip(plan.layers_per_stage, ends)]


def local_stages(plan: Plan, pp_rank: int) -> list[int]:
    """Virtual stages this pipeline rank runs, in increasing stage order (Plan.stages_of_rank)."""
    return list(plan.stages_of_rank(pp_rank))


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


class Sends:
    """Sends this stage issued, each let go once delivered: polled where the backend reports
    completion (NCCL), else waited by a helper thread (gloo's send Work says it is complete only
    once waited, and its wait blocks until the peer receives)."""

    def __init__(self, poll: bool) -> None:
        self.poll, self._works, self._errors = poll, [], []
        self._queue: queue.Queue | None = None

    def issue(self, ops: list[dist.P2POp]) -> None:
        works = [op.op(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer) for op in ops]
        if self.poll:
            self._works = [w for w in self._works if not w.is_completed()] + works
            return
        if self._queue is None:
            self._queue = queue.Queue()
            threading.Thread(target=self._wait_each, daemon=True, name="pipeline-sends").start()
        for work in works:
            self._queue.put(work)

    def _wait_each(self) -> None:
        while True:
            work = self._queue.get()
            try:
                work.wait()
            except Exception as e:   # noqa: BLE001 - re-raised on the training thread by wait_all
                self._errors.append(e)
            del work
            self._queue.task_done()

    def wait_all(self) -> None:
        """Every send delivered (the step's end, as torch's runner waits them)."""
        for work in self._works:
            work.wait()
        self._works = []
        if self._queue is not None:
            self._queue.join()
        if self._errors:
            raise self._errors.pop()


class TimedStage(PipelineStage):
    """A PipelineStage that adds its compute and its gradient reduction to the job's StepClock,
    and frees its pipeline buffers once used (the module docstring). `sends`: issue the sends
    here (the multi-stage runner), or None to leave them to the schedule (which waits each at
    once). A micro-batch's buffers are released after its last backward action: its full
    backward, or its weight pass where the schedule defers it."""

    def __init__(self, *args, clock: StepClock, sends: Sends | None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.clock, self.sends = clock, sends

    def _received(self, infos) -> list[torch.Tensor]:
        """The receive buffers among `infos` this stage allocated (a stage fed by one on the same
        rank takes that stage's tensor as it is, and leaves it alone)."""
        return [i.buffer for i in infos if not i.is_root_arg and i.buffer is not None and i.source is not None
                and self.stage_index_to_group_rank.get(i.source) != self.group_rank]

    def _release(self, mb: int) -> None:
        """Empty the micro-batch's receive buffers (storage resized to zero, as FSDP2 frees) and
        let go of the tensors a stage on this rank handed over in their place (the next step
        hands them again)."""
        for infos in (self.args_recv_info.get(mb, ()), self.grad_recv_info.get(mb, ())):
            received = self._received(infos)
            for buf in received:
                buf.untyped_storage().resize_(0)
            for info in infos:
                if not info.is_root_arg and info.buffer is not None and not any(info.buffer is r for r in received):
                    info.buffer = None

    @staticmethod
    def _refill(buffers: list[torch.Tensor]) -> None:
        for buf in buffers:
            if buf.untyped_storage().nbytes() == 0:
                buf.untyped_storage().resize_(buf.numel() * buf.element_size())

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        self._refill(self._received(self.args_recv_info[fwd_chunk_id]))
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if self.has_backward and not self.is_last:
            self._refill(self._received(self.grad_recv_info[bwd_chunk_id]))
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def _own(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        if self.sends is None:
            return ops
        self.sends.issue(ops)
        return []

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._own(super().get_fwd_send_ops(fwd_chunk_id))

    def _drop_input_grads(self, mb: int) -> None:
        """The input gradient handed back lives on in its receiver (a send, or the stage before
        on this rank) alone."""
        for info in self.args_recv_info.get(mb, ()):
            if not info.is_root_arg and info.buffer is not None:
                info.buffer.grad = None

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self._drop_input_grads(bwd_chunk_id)
        return self._own(ops)

    def get_local_bwd_output(self, mb_index: int):
        out = super().get_local_bwd_output(mb_index)
        self._drop_input_grads(mb_index)
        return out

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
        with counted_routes(self.submod):   # not torch's shape-inference forward
            return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        out = self._timed(super().backward_one_chunk, bwd_chunk_id, loss=loss, full_backward=full_backward,
                          last_backward=last_backward)
        if full_backward:
            self._release(bwd_chunk_id)
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        out = self._timed(super().backward_weight_one_chunk, bwd_chunk_id, *args, **kwargs)
        self._release(bwd_chunk_id)
        return out


def build_schedule(plan: Plan, modules: dict[int, torch.nn.Module], pp_group, device: torch.device,
                   loss_fn, clock: StepClock):
    """One PipelineStage per local virtual stage, driven by the plan's schedule class."""
    traits = plan.schedule.traits
    for mod in modules.values():
        for moe in (m for m in mod.modules() if isinstance(m, MoE)):
            moe.count_routes = False   # but in forward_one_chunk
    sends = Sends(poll=device.type == "cuda") if traits.multi_stage else None
    stages = [TimedStage(mod, j, plan.num_virtual_stages, device, group=pp_group, clock=clock, sends=sends)
              for j, mod in sorted(modules.items())]
    cls = schedule_class(traits)
    if sends is not None:
        cls = type(cls.__name__, (_WaitsOwnSends, cls), {"_sends": sends})
    target = stages if traits.multi_stage else stages[0]
    return cls(target, n_microbatches=plan.num_micro_batches, loss_fn=loss_fn)


class _WaitsOwnSends:
    """A multi-stage schedule whose stages issue their own sends: the step ends once they are
    delivered, as torch's runner ends once it has waited its own."""

    _sends: Sends

    def step(self, *args, **kwargs):
        try:
            return super().step(*args, **kwargs)
        finally:
            self._sends.wait_all()
