"""The simulator's operation orders are the ones torch.distributed.pipelining executes."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import pipelining as tp

from costmodel.schedule_orders import rank_orders
from costmodel.schedules import Schedule
from planner.space import degrees_plan

MULTI = {Schedule.INTERLEAVED: tp.ScheduleInterleaved1F1B,
         Schedule.ZB_H1: tp.ScheduleInterleavedZeroBubble, Schedule.ZBV: tp.ScheduleZBVZeroBubble,
         Schedule.DUALPIPEV: tp.ScheduleDualPipeV}
V_SHAPED = (Schedule.ZBV, Schedule.DUALPIPEV)   # torch is handed a rank's two stages


def _plan(schedule: Schedule, p: int, m: int, v: int):
    base = degrees_plan(dp=1, tp=1, pp=p, cp=1, num_micro_batches=m, num_layers=p * v)
    return replace(base, schedule=schedule, vpp=v, layers_per_stage=(1,) * (p * v))


def _stage(index: int, num_stages: int, p: int, rank: int):
    return SimpleNamespace(stage_index=index, num_stages=num_stages, group_size=p, group_rank=rank,
                           is_first=index == 0, is_last=index == num_stages - 1,
                           submod=torch.nn.Module())


def _torch_order(schedule: Schedule, p: int, m: int, v: int) -> list[list[tuple]]:
    """torch's action lists, an overlapped pair (DualPipeV's OVERLAP_F_B) as its two
    sub-actions in the order its runner executes them."""
    n = p * v
    stages = ([_stage(0, n, p, 0), _stage(n - 1, n, p, 0)] if schedule in V_SHAPED
              else [_stage(j, n, p, 0) for j in range(0, n, p)])
    sched = MULTI[schedule](stages, n_microbatches=m)
    return [[(b.stage_index, b.computation_type.value, b.microbatch_index)
             for a in sched.pipeline_order[r] if a is not None for b in (a.sub_actions or (a,))]
            for r in range(p)]


@pytest.mark.parametrize("schedule, p, m, v", [
    (Schedule.INTERLEAVED, 2, 4, 2), (Schedule.INTERLEAVED, 4, 8, 2), (Schedule.INTERLEAVED, 4, 12, 3),
    (Schedule.INTERLEAVED, 4, 4, 4), (Schedule.ZB_H1, 2, 4, 1), (Schedule.ZB_H1, 4, 8, 1),
    (Schedule.ZB_H1, 4, 6, 1), (Schedule.ZB_H1, 4, 8, 2), (Schedule.ZBV, 2, 4, 2),
    (Schedule.ZBV, 4, 8, 2), (Schedule.ZBV, 4, 3, 2), (Schedule.ZBV, 8, 32, 2), (Schedule.DUALPIPEV, 2, 4, 2),
    (Schedule.DUALPIPEV, 2, 7, 2), (Schedule.DUALPIPEV, 3, 9, 2), (Schedule.DUALPIPEV, 4, 8, 2),
    (Schedule.DUALPIPEV, 4, 13, 2), (Schedule.DUALPIPEV, 8, 32, 2)])
def test_multi_stage_orders_equal_torch_action_lists(schedule, p, m, v):
    assert [list(o) for o in rank_orders(_plan(schedule, p, m, v))] == _torch_order(schedule, p, m, v)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 4), (4, 9)])
def test_single_stage_orders_follow_torch_step_loops(p, m):
    """Schedule1F1B / ScheduleGPipe run their own loops (their pipeline_order is display only):
    1F1B warms up with min(m, p - s) forwards, then alternates backward / forward."""
    orders = rank_orders(_plan(Schedule.ONE_F_ONE_B, p, m, 1))
    for r, ops in enumerate(orders):
        warm = min(m, p - r)
        assert [k for _, k, _ in ops[:warm]] == ["F"] * warm
        assert ops[warm] == (r, "B", 0)
        assert sorted(ops) == sorted([(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)])
    gpipe = rank_orders(_plan(Schedule.GPIPE, p, m, 1))
    assert list(gpipe[0]) == [(0, "F", i) for i in range(m)] + [(0, "B", i) for i in range(m)]


def test_every_schedule_is_described_once_and_runs_on_torch():
    """The traits table is the schedule's home: each one has traits, a torch class the runtime
    can look up, and rules that check_plan and the search share."""
    from torch.distributed import pipelining

    from costmodel.schedules import SCHEDULE_TRAITS, Schedule
    assert set(SCHEDULE_TRAITS) == set(Schedule)
    for schedule, traits in SCHEDULE_TRAITS.items():
        assert isinstance(getattr(pipelining, traits.torch_class), type), schedule
        assert traits.accepts_vpp(traits.min_vpp)
        assert traits.dominated_by is None or traits.dominated_by.traits.closed_form
    assert [s for s in Schedule if not s.traits.closed_form] == [Schedule.ZBV, Schedule.DUALPIPEV]
    assert {s for s in Schedule if s.traits.defers_weight_grad} == {Schedule.ZB_H1, Schedule.ZBV, Schedule.DUALPIPEV}


def _torch_refuses(schedule: Schedule, p: int, m: int, v: int) -> bool:
    n = p * v
    try:
        if schedule in MULTI:
            stages = ([_stage(0, n, p, 0), _stage(n - 1, n, p, 0)] if schedule in V_SHAPED
                      else [_stage(j, n, p, 0) for j in range(0, n, p)])
            MULTI[schedule](stages, n_microbatches=m)
        else:
            getattr(tp, schedule.traits.torch_class)(_stage(0, p, p, 0), n_microbatches=m)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("schedule, v", [(Schedule.GPIPE, 1), (Schedule.ONE_F_ONE_B, 1), (Schedule.ZB_H1, 1),
                                         (Schedule.INTERLEAVED, 2), (Schedule.ZBV, 2), (Schedule.DUALPIPEV, 2)])
def test_micro_batch_rules_are_torch_s(schedule, v):
    """What torch's schedule classes refuse for a micro-batch count (1F1B: fewer than the stages;
    the round-based ones: not whole rounds; DualPipeV: fewer than its 2p stages), check_plan and the search refuse too, so that no
    plan they emit fails at its first step (as pp2 1F1B with one micro-batch would).
    Interleaving's m % pp rule is stricter than torch's, never looser."""
    for p in (2, 4):
        for m in range(1, 13):
            ours = bool(schedule.traits.problems(str(schedule), p, v, m, False, torch_pipelining=True))
            theirs = _torch_refuses(schedule, p, m, v)
            assert ours if theirs else (not ours or schedule is Schedule.INTERLEAVED), (schedule, p, m, ours, theirs)
