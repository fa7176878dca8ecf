"""Closed-form pipeline time for one optimizer step (the event simulator replaces it later and
must agree with it on uniform stages).

With m micro-batches and per-micro-batch rank times t_r (forward + backward on rank r):
- GPipe and 1F1B (Huang et al. 2019; Narayanan et al. 2021): the slowest rank works m·max(t)
  and the fill/drain adds the other ranks' time once: T = m·max(t) + (sum(t) - max(t)); for
  uniform stages (m + p - 1)·t, a bubble of (p - 1)/(m + p - 1) of the step.
- Interleaved 1F1B with v virtual stages per rank (SC'21 Sec. 2.2.2): the fill/drain shrinks
  by v: T = m·max(t) + (sum(t) - max(t))/v.
- ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 3): deferring the
  weight-gradient pass W fills the drain; the bubble becomes (p - 1)·(F + B - W) per rank instead
  of (p - 1)·(F + B + W), about a third of 1F1B's when F = B = W. With unequal ranks the fill is
  sum(F + B - W) - max(F + B - W) over ranks.
"""
from __future__ import annotations

from costmodel.plan import Plan, Schedule
from costmodel.timing import RankTimes


def pipeline_time_s(plan: Plan, ranks: list[RankTimes]) -> tuple[float, int]:
    """(time of all micro-batches through the pipeline, index of the critical rank)."""
    totals = [r.total_s for r in ranks]
    critical = max(range(len(totals)), key=totals.__getitem__)
    steady = plan.num_micro_batches * totals[critical]
    if plan.pp == 1:
        return steady, critical
    if plan.schedule is Schedule.ZBV:
        raise ValueError("schedule zbv has no closed form here: its V-shaped order needs the "
                         "event-level pipeline simulator")
    if plan.schedule is Schedule.ZB_H1:
        fill = [zero_bubble_fill_s(r) for r in ranks]
    else:
        fill = totals
    drain = sum(fill) - max(fill)  # for 1F1B fill = totals, so this is sum(t) - max(t)
    if plan.schedule is Schedule.INTERLEAVED:
        drain /= plan.vpp
    return steady + drain, critical


def zero_bubble_fill_s(times: RankTimes) -> float:
    """A rank's part in ZB-H1's fill and drain: F + B - W, its time less twice the deferred
    weight-gradient pass (linear in the times, so it applies to per-layer coefficients too)."""
    return times.total_s - 2 * times.backward_weight_s


def uniform_1f1b_bubble_fraction(pp: int, num_micro_batches: int) -> float:
    """Idle share of the pipeline phase of 1F1B (and GPipe) on uniform stages: (p-1)/(m+p-1)."""
    return (pp - 1) / (num_micro_batches + pp - 1)
