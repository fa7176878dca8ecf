"""The event simulator against the closed forms (the oracle) on uniform stages, and the
invariants of any simulated timeline."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.estimate import estimate, simulate_plan
from costmodel.memory import backward_working_bytes, in_flight_micro_batches
from costmodel.pipeline_simulation import BACKWARD, BACKWARD_INPUT, FORWARD, SEND, StageCost, simulate
from costmodel.schedules import Schedule
from planner.space import Choice, build_plan, degrees_plan


def _plan(schedule: Schedule, p: int, m: int, v: int = 1):
    base = degrees_plan(dp=1, tp=1, pp=p, cp=1, num_micro_batches=m, num_layers=p * v)
    return replace(base, schedule=schedule, vpp=v, layers_per_stage=(1,) * (p * v))


def _uniform(p: int, v: int, f: float = 1.0, b: float = 2.0, w: float = 1.0, send: float = 0.0):
    c = StageCost(forward_s=f / v, recompute_s=0.0, backward_s=b / v, backward_weight_s=w / v,
                  send_s=send, activation_bytes=1.0, transient_bytes=0.0)
    return [c] * (p * v)


@pytest.mark.parametrize("p, m", [(2, 2), (4, 8), (4, 16), (8, 32)])
def test_1f1b_and_gpipe_bubble_is_p_minus_1_over_m_plus_p_minus_1(p, m):
    for schedule in (Schedule.ONE_F_ONE_B, Schedule.GPIPE):
        sim = simulate(_plan(schedule, p, m), _uniform(p, 1))
        assert sim.time_s == pytest.approx((m + p - 1) * 3.0)
        assert sim.mean_idle_fraction == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 16, 2)])
def test_interleaving_divides_the_bubble_by_v(p, m, v):
    sim = simulate(_plan(Schedule.INTERLEAVED, p, m, v), _uniform(p, v))
    assert sim.time_s - m * 3.0 == pytest.approx((p - 1) * 3.0 / v)


@pytest.mark.parametrize("p, m", [(4, 8), (4, 16), (8, 32)])
def test_zb_h1_bubble_is_about_a_third_of_1f1b(p, m):
    """F = B_input = W (Qi et al. 2023): 1F1B idles (p-1)(F+B+W), ZB-H1 (p-1)(F+B-W)."""
    zb = simulate(_plan(Schedule.ZB_H1, p, m), _uniform(p, 1)).time_s - 3.0 * m
    one = simulate(_plan(Schedule.ONE_F_ONE_B, p, m), _uniform(p, 1)).time_s - 3.0 * m
    assert zb == pytest.approx((p - 1) * 1.0) and one == pytest.approx((p - 1) * 3.0)


def test_zbv_beats_interleaved_at_equal_cost():
    p, m = 4, 16
    zbv = simulate(_plan(Schedule.ZBV, p, m, 2), _uniform(p, 2)).time_s
    inter = simulate(_plan(Schedule.INTERLEAVED, p, m, 2), _uniform(p, 2)).time_s
    assert 3.0 * m < zbv < inter


@pytest.mark.parametrize("schedule, v", [(Schedule.ONE_F_ONE_B, 1), (Schedule.GPIPE, 1),
                                         (Schedule.INTERLEAVED, 2), (Schedule.ZB_H1, 1), (Schedule.DUALPIPEV, 2)])
def test_peak_in_flight_micro_batches_match_the_closed_form(schedule, v):
    p, m = 4, 16
    plan = _plan(schedule, p, m, v)
    sim = simulate(plan, _uniform(p, v))
    # activation_bytes = 1 per stage, v stages per rank: peak / v is in whole-rank units
    assert [x / v for x in sim.peak_activation_bytes] == \
        pytest.approx([in_flight_micro_batches(plan, r) for r in range(p)])


@pytest.mark.parametrize("schedule, v", [(Schedule.INTERLEAVED, 2), (Schedule.ZBV, 2), (Schedule.ZB_H1, 1),
                                         (Schedule.DUALPIPEV, 2)])
def test_timeline_respects_dependencies_and_one_op_at_a_time(schedule, v):
    p, m = 4, 8
    plan = _plan(schedule, p, m, v)
    costs = [replace(c, forward_s=c.forward_s * (1 + j % 3)) for j, c in enumerate(_uniform(p, v, send=0.1))]
    sim = simulate(plan, costs)
    ends = {}   # a whole backward and a backward-for-inputs both hand the gradient on (DualPipeV mixes them)
    for r, stage, kind, mb, start, end in sim.events:
        ends[(stage, BACKWARD if kind == BACKWARD_INPUT else kind, mb)] = end
    for r, stage, kind, mb, start, end in sim.events:
        if kind == FORWARD and stage > 0:
            assert start >= ends[(stage - 1, FORWARD, mb)] - 1e-12
        if kind in (BACKWARD, BACKWARD_INPUT) and stage < p * v - 1:
            assert start >= ends[(stage + 1, BACKWARD, mb)] - 1e-12
    for r in range(p):
        spans = sorted((s, e) for rr, _, _, _, s, e in sim.events if rr == r)
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    sends = [sum(1 for e in sim.events if e[2] == SEND and e[0] == r) for r in range(p)]
    if schedule in (Schedule.ZBV, Schedule.DUALPIPEV):
        # rank p-1 holds stages p-1 and p: the V's turn needs no transfer, so it sends half as
        # often as the middle ranks; rank 0 holds both ends of the pipeline
        assert sends == [2 * m] + [4 * m] * (p - 2) + [2 * m]
    assert sim.time_s == pytest.approx(max(e[5] for e in sim.events))


def test_the_slowest_stage_sets_the_pace():
    p, m = 4, 32
    costs = _uniform(p, 1)
    costs[2] = replace(costs[2], forward_s=2.0, backward_s=4.0)
    sim = simulate(_plan(Schedule.ONE_F_ONE_B, p, m), costs)
    assert sim.time_s >= m * 6.0 and max(sim.busy_s) == pytest.approx(m * 6.0)


def test_estimate_ledger_uses_the_simulation(llama70b, a100_64, train_4k):
    plan = build_plan(llama70b, train_4k, a100_64, Choice(tp=8, pp=4, vpp=2, micro_batch_size=1))
    est = estimate(llama70b, train_4k, a100_64, plan)
    sim = simulate_plan(llama70b, train_4k, a100_64, plan)
    assert sum(est.time_breakdown_s.values()) == pytest.approx(est.step_time_s)
    pipeline = sum(v for k, v in est.time_breakdown_s.items()
                   if k.split("/")[0] in ("compute", "pipeline") or k in
                   ("comm/tp_exposed", "comm/cp_exposed", "comm/pp_exposed"))
    assert pipeline == pytest.approx(sim.time_s)
    # balanced stages: the closed form and the simulation agree to within the edge stages' spread
    assert est.step_time_s == pytest.approx(est.closed_form_step_time_s, rel=0.02)
    # the simulated peak of held activations, plus the one backward's working set
    last = plan.stage_rank(plan.num_virtual_stages - 1)
    assert [m["activations"] for m in est.memory_breakdown_bytes] == [
        peak + backward_working_bytes(llama70b, train_4k, plan, r == last)
        for r, peak in enumerate(sim.peak_activation_bytes)]
