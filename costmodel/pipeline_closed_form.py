"""Closed-form pipeline time for one optimizer step: what the search's bounds and CP-SAT model
reason with and the event simulator (costmodel.pipeline_simulation, which prices the plans
shown) must agree with on uniform stages.

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

from costmodel.plan import Plan
from costmodel.rank_time import RankTimes
from costmodel.schedules import ScheduleTraits


def pipeline_time_s(plan: Plan, ranks: list[RankTimes]) -> tuple[float, int]:
    """(time of all micro-batches through the pipeline, index of the critical rank)."""
    totals = [r.total_s for r in ranks]
    critical = max(range(len(totals)), key=totals.__getitem__)
    if plan.pp == 1:
        return plan.num_micro_batches * totals[critical], critical
    traits = plan.schedule.traits
    if not traits.closed_form:
        raise ValueError(f"schedule {plan.schedule} has no closed form here: its order needs the "
                         "event-level pipeline simulator")
    fill = [fill_s(traits, r) for r in ranks]
    return closed_form_s(traits, plan.num_micro_batches, totals[critical], sum(fill), max(fill), plan.vpp), critical


def fill_s(traits: ScheduleTraits, times: RankTimes) -> float:
    """A rank's part in its schedule's fill and drain (linear in the times, so it applies to
    per-layer coefficients too)."""
    return zero_bubble_fill_s(times) if traits.fill == "zero-bubble" else times.total_s


def scaled_closed_form(traits: ScheduleTraits, m, slowest, fill_sum, fill_max, vpp: int):
    """v times the pipeline's closed form, m·T + (Σf - max f)/v: the one formula the estimate,
    the search's bounds and its CP-SAT split model all use (any numbers or linear expressions:
    scaled by v so that CP-SAT's integers need no division). T is the slowest rank's time per
    micro-batch, f each rank's fill (`fill_s`); 1F1B's fill is its stage time (the bubble
    (p-1)/m of Narayanan et al. 2021), interleaving divides it by v, ZB-H1's is F + B - W."""
    v = vpp if traits.fill_divided_by_vpp else 1
    return v * m * slowest + fill_sum - fill_max


def closed_form_s(traits: ScheduleTraits, m: int, slowest_s: float, fill_sum_s: float, fill_max_s: float,
                  vpp: int) -> float:
    v = vpp if traits.fill_divided_by_vpp else 1
    return scaled_closed_form(traits, m, slowest_s, fill_sum_s, fill_max_s, vpp) / v


def zero_bubble_fill_s(times: RankTimes) -> float:
    """A rank's part in ZB-H1's fill and drain: F + B - W, its time less twice the deferred
    weight-gradient pass (linear in the times, so it applies to per-layer coefficients too)."""
    return times.total_s - 2 * times.backward_weight_s


def uniform_1f1b_bubble_fraction(pp: int, num_micro_batches: int) -> float:
    """Idle share of the pipeline phase of 1F1B (and GPipe) on uniform stages: (p-1)/(m+p-1)."""
    return (pp - 1) / (num_micro_batches + pp - 1)
