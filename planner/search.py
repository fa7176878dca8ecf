"""`planner search`: the fastest plan that fits, exact under the cost model.

Outer choices (tp, cp, pp, dp, micro-batch, virtual stages, schedule, ZeRO stage, sequence
parallelism, recompute mode, rank placement) are enumerated, each with a valid lower bound on its
step time read from the rank time model (planner.bounds), computed lazily (planner.search_order:
a group of choices is priced under its mesh orders only once its floor is below the cutoff and
some split of it fits). Candidates are taken in order of that bound; each is checked for memory
once per placement-free choice, bounded again with the slowest
rank's least time over every split that fits (planner.bounds.pipeline_floor_s) and the full
per-rank shapes, and only then solved exactly by CP-SAT (layer split and per-rank recompute under
the memory cap, told the cutoff so far: planner.cutoff). The search stops once the bound of the
next candidate is no better than the cutoff (the K-th best row found), so the result is the optimum over the
whole space whenever every CP-SAT solve proved optimality.

All of this reasons with the closed-form pipeline (`estimate(..., simulate=False)`), which the
bounds and CP-SAT's affine model are derived from, so the proof is consistent. The best plans of
that search are then priced by the event simulation (planner.repricing), which is what is shown
and ranked; one whose simulated memory does not fit is dropped.
"""
from __future__ import annotations

import gc
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Iterator

from costmodel.check_levers import offload_problems
from costmodel.estimate import estimate
from costmodel.fidelity import error_band
from costmodel.hardware import ClusterSpec
from costmodel.plan import Plan
from costmodel.rank_time import RankTimeModel
from costmodel.schedules import Schedule
from costmodel.specs import ModelSpec, TrainSpec
from planner.bounds import MemoryFit, lower_bound_with_memory_s, min_max_time_s
from planner.candidates import placement_groups
from planner.cutoff import Cutoff
from planner.dense_spreads import DenseChoice, DenseDelta, dense_spreads, reachable
from planner.halves import HALVES, in_halves
from planner.partition import FREE, SolverTimeout, SplitRules, apply_split, solve_split
from planner.repricing import result
from planner.search_options import STATE_OPTIONS, SearchOptions
from planner.search_order import Queue
from planner.search_result import Found, SearchResult, SearchStats
from planner.search_state import SharedModels
from planner.shapes import RankShape, rank_shapes
from planner.shares import search_shares
from planner.space import Choice
from planner.split_model import cp_sat


def search(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
           options: SearchOptions = SearchOptions()) -> SearchResult:
    """`_search_levers` with the cyclic garbage collector held back (`_few_collections`), under
    the cluster's error band unless the options set one."""
    if options.error_band is None:
        options = replace(options, error_band=error_band(cluster)[0])
    cp_sat()   # the solver's import: before the search's clock, and once, not in each forked half
    with _few_collections():
        return _search_levers(model, train, cluster, options)


@contextmanager
def _few_collections() -> Iterator[None]:
    """The search allocates millions of short-lived records, nearly none in reference cycles
    (reference counting frees them), and the cyclic collector's passes over everything alive
    (the imported packages, the search's growing caches) took a fifth of its time, a tenth even
    at a threshold of 50,000 allocations: it is off for the few seconds of a search, and what
    was alive before is frozen out of its later passes until the search ends."""
    enabled = gc.isenabled()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
        gc.unfreeze()


def _search_levers(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions) -> SearchResult:
    """The fastest plans under the cost model. Offloading the optimizer states to the host is a
    memory lever whose price rests on datasheets no run of ours has checked (costmodel.comm,
    costmodel.kernels.host_optimizer_step_s), and so is offloading activations: unless the user
    fixes them, states and activations stay on the devices, and only when no plan fits that way
    is the search run again with both levers free (SearchResult.offloaded_because says so)."""
    levers = ("offload_optimizer", "offload_activations")
    if offload_problems(cluster, 1, True) or all(lever in options.fixed for lever in levers):
        return _search(model, train, cluster, options)
    start = time.perf_counter()
    on_device = _search(model, train, cluster, replace(options, fixed={
        **{lever: False for lever in levers}, **options.fixed}))
    if on_device.plans or not on_device.stats.optimal:
        return on_device
    _say(options, "no plan fits with states and activations on the devices; searching again with the host")
    left = max(1.0, options.time_limit_s - (time.perf_counter() - start))
    offloaded = _search(model, train, cluster, replace(options, time_limit_s=left))
    offloaded.offloaded_because = "no plan fits with the optimizer states and activations on the devices"
    offloaded.stats.wall_s = time.perf_counter() - start
    if not offloaded.plans:   # the closest plan to fitting is the on-device one
        offloaded.closest = on_device.closest or offloaded.closest
    return offloaded


def _search(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions) -> SearchResult:
    start = time.perf_counter()
    shared = SharedModels(model, train, cluster, options)
    deadline = start + options.time_limit_s
    halves = in_halves(lambda i: _half(shared, options if i == 0 else replace(options, progress=None), i, deadline))
    stats = _merged(halves)
    found = [f for h in halves for f in h.found]
    result = _after_branch_and_bound(shared, options, stats, found, [c for h in halves for c in h.too_big],
                                     deadline, [h.cutoff for h in halves])
    if not stats.enumerated:
        stats.lower_bound_s = 0.0   # what was never listed has no bound
    stats.wall_s = time.perf_counter() - start
    return result


@dataclass(frozen=True, slots=True)
class _Half:
    """One half's branch and bound (planner.halves): its plans, the choices found too big (for
    the closest plan when nothing fits), and its statistics."""
    found: list[Found]
    too_big: list[tuple[Choice, int, Schedule, int]]
    stats: SearchStats
    cutoff: Cutoff


def _half(shared: SharedModels, options: SearchOptions, index: int, deadline: float) -> _Half:
    """The branch and bound over the `index`-th half of the listing (planner.halves: every other
    shape, planner.candidates.placement_groups' `share`); the
    listing's own refusals (a batch dp does not divide) are counted by the first half only."""
    stats = SearchStats()
    refused = []

    def prune(reason: str) -> None:
        if index == 0:
            stats.prune(reason)
            refused.append(reason)
    groups = placement_groups(shared.model, shared.train, shared.cluster, options, prune, (index, HALVES))
    queue = Queue(shared, groups, stats, deadline)
    if not stats.enumerated:
        _say(options, f"time limit reached while listing the space ({queue.num_candidates:,} candidates so far)")
    stats.num_candidates = queue.num_candidates + len(refused)
    _say(options, f"{queue.num_candidates:,} valid candidates in this half of the space; "
                  "solving in order of their lower bound")
    cutoff = Cutoff(options)
    found = _branch_and_bound(shared, options, stats, queue, deadline, cutoff)
    return _Half(found, queue.too_big + queue.roomless, stats, cutoff)


def _merged(halves: list[_Half]) -> SearchStats:
    """The halves' statistics as one search's. Not proven optimal, a half's bound is where it
    stopped; a finished one's unexamined candidates are bounded below by its best plan."""
    stats = SearchStats(optimal=all(h.stats.optimal for h in halves),
                        enumerated=all(h.stats.enumerated for h in halves))
    for h in halves:
        stats.num_candidates += h.stats.num_candidates
        stats.num_feasible += h.stats.num_feasible
        stats.num_solved += h.stats.num_solved
        for reason, count in h.stats.pruned_by_reason.items():
            stats.prune(reason, count)
    if not stats.optimal:
        stats.lower_bound_s = min(h.stats.lower_bound_s if not h.stats.optimal
                                  else min((f.estimate.step_time_s for f in h.found), default=math.inf)
                                  for h in halves)
    return stats


def _say(options: SearchOptions, text: str) -> None:
    if options.progress:
        options.progress(text)


def _branch_and_bound(shared: SharedModels, options, stats, queue: Queue, deadline: float,
                      pruning: Cutoff) -> list[Found]:
    found: list[Found] = []
    cutoff = pruning.s
    examined = 0
    for candidate in queue.in_order():
        if candidate.bound_s >= cutoff:
            queue.taken -= 1   # not examined: pruned by the bound with the rest
            break
        if time.perf_counter() > deadline:
            queue.taken -= 1
            stats.optimal = False
            stats.lower_bound_s = candidate.bound_s
            stats.prune("time limit", queue.num_candidates - queue.taken)
            _say(options, f"time limit reached after {examined:,} of {queue.num_candidates:,} candidates")
            break
        examined += 1
        if examined % 500 == 0:
            _say(options, f"examined {examined:,}, solved {stats.num_solved}, best so far "
                          f"{min((f.estimate.step_time_s for f in found), default=math.inf):.3f} s (closed form)")
        c = candidate
        outcome = _examine(shared, stats, c.base, c.zero, c.plan, c.fit, cutoff, deadline)
        if outcome is None:
            stats.prune("memory")
            queue.too_big.append((c.base, c.vpp, c.schedule, c.zero))
        elif isinstance(outcome, Found):
            found.append(outcome)
            pruning.add(outcome)
            cutoff = pruning.s
    if queue.taken < queue.num_candidates and "time limit" not in stats.pruned_by_reason:
        stats.prune("bound", queue.num_candidates - queue.taken)
    return found


def _after_branch_and_bound(shared: SharedModels, options: SearchOptions, stats: SearchStats, found: list[Found],
                            too_big: list[tuple[Choice, int, Schedule, int]], deadline: float,
                            cutoffs: list[Cutoff]) -> SearchResult:
    """A mixed cluster's replicas on groups, then the ranking of every plan found: complete below
    the lowest of the searches' cutoffs, where every faster plan was examined."""
    joint = Cutoff(options)
    if shared.cluster.is_mixed:
        for f in found:
            joint.add(f)
        cutoffs = [*cutoffs, joint]
    shares, too_big_shares = _replicas_on_groups(shared, options, stats, deadline, joint)
    found += shares
    if stats.optimal:
        stats.lower_bound_s = min((f.estimate.step_time_s for f in found), default=math.inf)
    # a search stopped by its time limit proved nothing past where it stopped: its rows are the best found
    complete_below_s = min(c.s for c in cutoffs) if stats.optimal else math.inf
    return result(shared, options, stats, found, too_big, too_big_shares, deadline, complete_below_s)


def _replicas_on_groups(shared: SharedModels, options: SearchOptions, stats: SearchStats, deadline: float,
                        cutoff: Cutoff) -> tuple[list[Found], list[Plan]]:
    """A mixed cluster's plans without a pipeline, replicas on groups with their own batch
    shares (planner.shares), under the cutoff the rest of the space left."""
    if not shared.cluster.is_mixed:
        return [], []
    stages = sorted({o.zero_stage for o, ok in zip(STATE_OPTIONS, shared.zero_allowed) if ok and not o.offload_optimizer})
    return search_shares(shared.model, shared.train, shared.cluster, options, stages, stats, cutoff, deadline)


def _examine(shared: SharedModels, stats: SearchStats, base: Choice, zero: int, plan: Plan, fit: MemoryFit,
             cutoff: float, deadline: float) -> Found | bool | None:
    """A candidate some split of which fits: the pipeline floor, then the full bound (per spread of
    the dense first layers where a mixture's may move: planner.dense_spreads), then CP-SAT. The
    plan found, False when pruned (bound, solver time limit), None when no split fits after all."""
    model, train, cluster = shared.model, shared.train, shared.cluster
    if shared.pipeline_floor_s(base, zero, plan, fit, cutoff) >= cutoff:
        stats.prune("bound")
        return False
    if plan.mesh_axis_order != base.mesh_axis_order:
        plan = replace(plan, mesh_axis_order=base.mesh_axis_order)
    rtm = shared.plan_rtm(shared.time_model(base).rtm, plan)
    if len(dense_spreads(model, plan)) == 1:
        shapes, dense = rank_shapes(model, train, cluster, plan, memory=fit.memory, rtm=rtm), None
        if lower_bound_with_memory_s(shapes, plan, fit, model.num_layers) >= cutoff:
            stats.prune("bound")
            return False
    else:
        chosen = _dense_choice(shared, base, zero, plan, fit, rtm, cutoff)
        if chosen == "memory":   # the least over the spreads fitted, no spread does
            return None
        if chosen == "bound":
            stats.prune("bound")
            return False
        shapes, dense, fit = chosen
    try:
        split = solve_split(model, train, cluster, plan, ranks=shapes, cutoff_s=cutoff, fit=fit,
                            time_limit_s=max(1.0, deadline - time.perf_counter()), rules=_rules(shared.options),
                            dense=dense)
    except SolverTimeout:
        stats.optimal = False
        stats.prune("solver time limit")
        return False
    stats.num_solved += 1
    if split is None:
        if math.isinf(cutoff):
            return None
        stats.prune("bound")  # no split that fits beats the cutoff
        return False
    stats.optimal &= split.optimal
    if dense is not None and not any(s.admits(split.layers, plan.vpp) for s in dense.spreads):
        raise RuntimeError(f"the split {split.layers} solved for {plan.short()} puts the dense first layers "
                           f"in none of the spreads {[s.per_stage for s in dense.spreads]}")
    concrete = apply_split(plan, split)
    space = shared.options.space
    if space is not None and (changes := space.problems(concrete)):   # the split rules and the export disagree
        raise RuntimeError(f"the split solved for {space.name} is not one it runs ({concrete.short()}): {changes[0]}")
    est = estimate(model, train, cluster, concrete, simulate=False)
    if not est.fits:  # integer rounding at the very edge
        return None
    stats.num_feasible += 1
    return Found(plan=concrete, estimate=est, alternatives=shared.zero1_twin(concrete))


def _dense_choice(shared: SharedModels, base: Choice, zero: int, plan: Plan, fit: MemoryFit, rtm: RankTimeModel,
                  cutoff: float) -> tuple[list[RankShape], DenseChoice, MemoryFit] | str:
    """Where a mixture's dense first layers may go (planner.dense_spreads): the spreads some split
    of which fits with a bound below the cutoff, and the shapes, choice and fit CP-SAT solves them
    with (one spread: its own; several: the shapes with none, what each adds, `fit`: each rank's
    least); "memory" when no spread fits, "bound" when every one that does reaches the cutoff."""
    model, train, cluster, total = shared.model, shared.train, shared.cluster, shared.model.num_layers
    memory = shared.spread_memory(base, zero, plan)
    live, fitting = [], False
    for spread in dense_spreads(model, plan):
        held = spread.per_rank(plan.pp)
        spread_fit = MemoryFit(memory[held], plan, fit.caps, total, spread.layer_bounds(plan.pp, plan.vpp, total))
        if not spread_fit.fits:
            continue
        fitting = True
        shapes = rank_shapes(model, train, cluster, plan, memory=spread_fit.memory, rtm=rtm, dense=held)
        if lower_bound_with_memory_s(shapes, plan, spread_fit, total) < cutoff:
            live.append((spread, shapes, spread_fit))
    if not live:
        return "bound" if fitting else "memory"
    if len(live) == 1:
        spread, shapes, spread_fit = live[0]
        return shapes, DenseChoice((spread,)), spread_fit
    none, most = (0,) * plan.pp, reachable(model, plan)
    without, full = (rank_shapes(model, train, cluster, plan, memory=memory[held], rtm=rtm, dense=held)
                     for held in (none, most))
    deltas = tuple(DenseDelta.between(a, b, count) if count else None for a, b, count in zip(without, full, most))
    slowest_s = min(min_max_time_s([r.t for r in shapes], plan, spread_fit, total) for _, shapes, spread_fit in live)
    return without, DenseChoice(tuple(spread for spread, _, _ in live), deltas, slowest_s), fit


def _rules(options: SearchOptions) -> SplitRules:
    space = options.space
    return FREE if space is None else SplitRules(split=space.split, recompute_counts=space.recompute_counts)
