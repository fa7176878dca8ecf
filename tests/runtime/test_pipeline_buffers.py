"""Pipeline buffers end with their micro-batch (runtime.pipeline), as in Megatron's schedules:
after a step no stage holds a received activation or gradient, nor the input gradient it sent,
and no send is left in flight. The memory this saves is measured per stage against the cost
model by tests/runtime/test_run_cli.py (test_pipeline_schedules_hold_the_memory_the_model_says);
equal losses and gradients by tests/runtime/test_parity.py's pipeline cases."""
from __future__ import annotations

import pytest
import torch
from parity import plan_file

from costmodel.schedules import Schedule
from planner.space import Choice
from runtime.fork import run_forked
from runtime.job import build_job
from runtime.train import forward_backward


def _held_after_a_step(pf) -> dict[str, int]:
    job = build_job(pf, torch.device("cpu"), seed=0)
    n = pf.plan.micro_batch_size * pf.plan.num_micro_batches
    tokens = torch.randint(0, pf.model.vocab_size, (n, pf.train.seq_len), generator=torch.Generator().manual_seed(0))
    forward_backward(job, tokens, tokens)
    held = {"buffer_bytes": 0, "input_grads": 0, "received_buffers": 0}
    for stage in job.schedule._stages if hasattr(job.schedule, "_stages") else [job.schedule._stage]:
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            held["received_buffers"] += len(stage._received(infos))
            # received ones, and those a stage on the same rank handed over (ZBV's turn)
            held["buffer_bytes"] += sum(i.buffer.untyped_storage().nbytes() for i in infos
                                        if not i.is_root_arg and i.buffer is not None)
        held["input_grads"] += sum(i.buffer is not None and i.buffer.grad is not None
                                   for infos in stage.args_recv_info.values() for i in infos)
    sends = getattr(job.schedule, "_sends", None)
    held["sends_in_flight"] = 0 if sends is None else len(sends._works) + (sends._queue.unfinished_tasks
                                                                          if sends._queue is not None else 0)
    return held


@pytest.mark.parametrize("choice", [Choice(pp=2, micro_batch_size=1), Choice(pp=2, vpp=2, micro_batch_size=1),
                                    Choice(pp=2, vpp=2, schedule=Schedule.ZBV, micro_batch_size=1)],
                         ids=["1f1b", "interleaved", "zbv"])
def test_no_pipeline_buffer_outlives_its_micro_batch(choice):
    pf = plan_file(choice, world=2, global_batch=4)
    for held in run_forked(2, _held_after_a_step, pf):
        assert held["received_buffers"] > 0   # the check sees the buffers it checks
        assert held["buffer_bytes"] == 0 and held["input_grads"] == 0 and held["sends_in_flight"] == 0, held
