"""The search's last stage: its best closed-form plans priced by the event simulation and
ranked (planner.search). A plan whose simulated memory overflows is laid out again with the last
rank's short chunks first, which the closed form bounds, and dropped only if that overflows too;
schedules without a closed form (ZBV, DualPipeV) compete as simulated variants of the best, and
so do the best interleaved plans laid out again where the closed form misses their phase lock
(planner.relayout)."""
from __future__ import annotations

import math
import time
from dataclasses import replace
from functools import partial

from costmodel.check import check_structure
from costmodel.estimate import estimate
from costmodel.plan import Plan, Recompute
from costmodel.schedules import Schedule
from planner.halves import map_in_halves
from planner.partition import short_chunks_first
from planner.ranking import DECISION_K, closer, one_row_per_price, rank, robust_first, undominated
from planner.relayout import phase_locked, relaid
from planner.search_options import STATE_OPTIONS, SearchOptions
from planner.search_result import Found, SearchResult, SearchStats
from planner.search_state import SharedModels
from planner.space import Choice, build_plan, under_schedule

REPRICED = 20   # closed-form best plans re-priced by simulation for the final ranking
CLOSEST_CANDIDATES = 2000   # of the choices that did not fit, those the closest plan is looked for among
_LEAST_KEPT_FIRST = {Recompute.FULL: 0, Recompute.SELECTIVE: 1, Recompute.NONE: 2}
VARIANTS_OF = 5   # best simulated plans laid out for schedules without a closed form (ZBV) or again (relayout)


def _repriced(options: SearchOptions) -> int:
    """How many of the best plans are re-priced by simulation and kept for the ranking."""
    return max(REPRICED, options.top_k)


def _as_run(plan: Plan, options: SearchOptions) -> Plan | None:
    """The plan in a rank order the framework runs it in, None where it runs it in none: a
    closest plan the framework cannot run would be advice it cannot take (plans whose states
    alone overflow were never put to its verdict)."""
    if options.space is None:
        return plan
    for order in (plan.mesh_axis_order, *options.space.mesh_orders):
        placed = replace(plan, mesh_axis_order=order)
        if not options.space.problems(placed):
            return placed
    return None


def result(shared: SharedModels, options: SearchOptions, stats: SearchStats, found: list[Found],
            too_big: list[tuple[Choice, int, Schedule, int]], too_big_plans: list[Plan],
            deadline: float, complete_below_s: float = math.inf) -> SearchResult:
    """Re-price the best plans by simulation and rank them; when nothing fits, the closest plan
    (of those priced before the time limit, at least one). The table's rows after the first are
    those the search found every faster plan for: at most `complete_below_s` in the closed form
    (planner.cutoff)."""
    model, train, cluster = shared.model, shared.train, shared.cluster
    closest, free = None, options.space is None or options.space.split == "free"
    if not found:  # only then does anyone need to know how far the plans are from fitting
        # the fully recomputed first: each keeps less than its twin that recomputes less, and the
        # queue's order (by time bound) would put the unrecomputed first, filling the list
        for base, vpp, schedule, zero in sorted(too_big, key=lambda c: _LEAST_KEPT_FIRST[c[0].recompute])[:CLOSEST_CANDIDATES]:
            if closest is not None and time.perf_counter() > deadline:
                break
            plan = build_plan(model, train, cluster, replace(base, **STATE_OPTIONS[zero]._asdict(), vpp=vpp,
                                                             schedule=schedule))
            if (plan := _as_run(plan, options)) is not None:
                closest = closer(model, train, cluster, plan, closest, free)
        for plan in too_big_plans:
            if (plan := _as_run(plan, options)) is not None:
                closest = closer(model, train, cluster, plan, closest, free)
    # the first plans are chosen among the DECISION_K best, which the cutoff keeps whatever --top
    # asks to show, by their simulated times (robust_first's band, rank's): a closed-form band
    # here could leave out the plan the simulation finds fastest. The rest follow by time
    decision = rank(found, replace(options, top_k=DECISION_K))
    # the decision's plans and the REPRICED best (and fastest, under another objective: the leanest
    # are judged against them) are always simulated, a fraction of a second; the rest a larger
    # --top shows, first in the list, while the time limit lasts
    always = _union(decision, _best(found, options, REPRICED))
    ranked = _union(always, _best(found, options, _repriced(options)))
    # each simulation costs milliseconds to tens of them: half of them on the second core
    priced = map_in_halves(partial(_simulated_by, shared, deadline, len(always)), list(enumerate(ranked)))
    simulated = {id(f): p for f, p in zip(ranked, priced) if p is not None}
    unpriced = [f for f, p in zip(ranked, priced) if p is None]
    if unpriced:   # the rows' order is proven below the fastest left unpriced, no further
        complete_below_s = min(complete_below_s, math.nextafter(min(f.estimate.step_time_s for f in unpriced), 0.0))
    evaluated = [simulated.get(id(f), f) for f in found]
    fitting = [f for f in simulated.values() if f.estimate.fits]
    # a plan that fit under the closed form's memory may overflow once simulated: not feasible
    stats.num_feasible -= len(simulated) - len(fitting)
    proven = min(fitting, key=lambda f: f.estimate.step_time_s) if fitting else None
    # the first is chosen among the decision's plans that fit once simulated: those the cutoff keeps
    # whatever --top asks to show (a display flag never changes the decision)
    chosen = [simulated[id(f)] for f in decision if simulated[id(f)].estimate.fits]
    # variants of the few best simulated plans only: each simulation costs milliseconds to tens of them
    best = sorted(chosen, key=lambda f: f.estimate.step_time_s)[:VARIANTS_OF]
    variants = [f for f in _simulated_variants(shared, options, best) if f.estimate.fits]
    # each simulated plan's closed-form time (a plan laid out again by _simulated included); the
    # best whose interleaved pipeline the closed form found faster than it runs, laid out again
    closed_of = {id(simulated[id(f)]): f.estimate.step_time_s for f in ranked if id(f) in simulated}
    locked = [f for f in best if phase_locked(f, closed_of[id(f)])]
    variants += [r for r in map_in_halves(lambda f: relaid(model, train, cluster, options, f, deadline), locked)
                 if r is not None]
    chosen += variants
    # the proof line names the fastest of every simulated plan, not only of the decision's
    fastest = min(fitting + variants, key=lambda f: f.estimate.step_time_s, default=None)
    ordered, equivalent = robust_first(rank(chosen, replace(options, top_k=len(chosen))),
                                       options.error_band if options.objective == "time" else 0.0)
    first = ordered[:equivalent]
    # the variants of the best are simulated only and kept
    rows, cut = _proven_rows(first, fitting + variants, closed_of, complete_below_s, options)
    cut = complete_below_s if unpriced else cut   # plans left out unpriced bound the rows too
    decided = {f.plan for f in first}
    # counted before --top cuts the table: a display flag never changes what the evidence ties
    equivalent = next((i for i, f in enumerate(rows) if f.plan not in decided), len(rows))
    plans = rows[:options.top_k]
    return SearchResult(plans=plans, stats=stats, evaluated=evaluated + variants, closest=closest,
                        equivalent=equivalent, error_band=options.error_band, fastest=fastest,
                        proven_fastest=proven, rows_proven_to_s=cut, unpriced=len(unpriced))


def _proven_rows(first: list[Found], fitting: list[Found], closed_s: dict[int, float], complete_below_s: float,
                 options: SearchOptions) -> tuple[list[Found], float | None]:
    """The table before --top cuts it: the decision's rows, then the others whose closed-form time
    the search proved (at most `complete_below_s`), each price once, none beaten in both time and
    memory; and the bound when it left a plan out (None when none)."""
    shown = {id(f) for f in first}
    others = [f for f in fitting if id(f) not in shown]
    within = [f for f in others if closed_s.get(id(f), 0.0) <= complete_below_s]
    rest = rank(within, replace(options, top_k=len(within)))
    rows = undominated(one_row_per_price(_union(first, rest)))
    return rows, (complete_below_s if len(within) < len(others) else None)


def _simulated(shared: SharedModels, found: Found) -> Found:
    """A plan priced by simulation; one whose simulated memory overflows with the last rank's
    short chunk last (apply_split) laid out with its short chunks first, which the closed form
    bounded (partition.short_chunks_first)."""
    model, train, cluster = shared.model, shared.train, shared.cluster
    est = estimate(model, train, cluster, found.plan)
    if not est.fits and found.plan.vpp > 1:
        plan = short_chunks_first(found.plan)
        if plan != found.plan and (alt := estimate(model, train, cluster, plan)).fits:
            return Found(plan=plan, estimate=alt, alternatives=found.alternatives)
    return Found(plan=found.plan, estimate=est, alternatives=found.alternatives)


def _best(found: list[Found], options: SearchOptions, k: int) -> list[Found]:
    """The k best by the search's objective, and, under another than time, the k fastest after them."""
    best = rank(found, replace(options, top_k=k))
    if options.objective != "time":
        best = _union(best, rank(found, replace(options, top_k=k, objective="time")))
    return best


def _simulated_by(shared: SharedModels, deadline: float, always: int, item: tuple[int, Found]) -> Found | None:
    """`_simulated` of the item-th plan; None for one past the first `always` once the deadline
    has passed (the search's time limit bounds the repricing of the rows --top adds)."""
    index, found = item
    if index >= always and time.perf_counter() > deadline:
        return None
    return _simulated(shared, found)


def _union(first: list[Found], more: list[Found]) -> list[Found]:
    """`first`, then the plans of `more` not in it, each once, in their orders."""
    seen = {id(f) for f in first}
    return first + [f for f in more if id(f) not in seen]


def _simulated_variants(shared: SharedModels, options: SearchOptions, ranked: list[Found]) -> list[Found]:
    """Schedules without a closed form (ZBV) compete by simulation: each of the best closed-form
    plans with a pipeline, laid out for the schedule (its virtual stages, layers split evenly,
    the same recomputation per rank), priced by the event simulator. They are outside the
    closed-form proof; SearchResult.proven_fastest is what the proof is about."""
    if options.fixed.keys() & {"schedule", "vpp"}:
        return []
    model, train, cluster = shared.model, shared.train, shared.cluster
    variants, seen = [], set()
    for schedule in Schedule:
        if schedule.traits.closed_form or (options.schedules is not None and schedule not in options.schedules):
            continue
        for f in ranked:
            if f.plan.pp < 2 or model.num_layers < f.plan.pp * max(2, schedule.traits.min_vpp):
                continue
            variant = under_schedule(model, f.plan, schedule)
            if variant in seen or check_structure(model, train, cluster, variant):
                continue
            if options.space is not None and options.space.problems(variant):
                continue
            seen.add(variant)
            variants.append(variant)
    return map_in_halves(lambda variant: Found(plan=variant, estimate=estimate(model, train, cluster, variant)),
                         variants)


