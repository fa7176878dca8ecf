"""`planner search`: the fastest plan that fits, exact under the cost model.

Outer choices (tp, cp, pp, dp, micro-batch, virtual stages, schedule, ZeRO stage, sequence
parallelism, recompute mode, rank placement) are enumerated, each with a valid lower bound on its
step time read from the rank time model (planner.bounds). Candidates are taken in order of that
bound; each is checked for memory once per placement-free choice, bounded again with the slowest
rank's least time over every split that fits (planner.bounds.pipeline_floor_s) and the full
per-rank shapes, and only then solved exactly by CP-SAT (layer split and per-rank recompute under
the memory cap, told the K-th best so far as a cutoff). The search stops once the bound of the
next candidate is no better than the K-th best plan found, so the result is the optimum over the
whole space whenever every CP-SAT solve proved optimality.

All of this reasons with the closed-form pipeline (`estimate(..., simulate=False)`), which the
bounds and CP-SAT's affine model are derived from, so the proof is consistent. The best plans of
that search (REPRICED of them) are then priced by the event simulation, which is what is shown
and ranked; one whose simulated memory does not fit is dropped.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace
from typing import Iterator

import numpy as np

from costmodel.check import check_structure, runtime_executes
from costmodel.cluster import ClusterSpec
from costmodel.estimate import Estimate, estimate
from costmodel.memory import stage_memory_shapes_by_zero
from costmodel.placement import AxisSpan
from costmodel.plan import Plan, Recompute, Schedule
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.timing import RankTimeModel, Spans, rank_time_model, spans
from planner.bounds import MemoryFit, lower_bound_with_memory_s, pipeline_floor_s, time_floor_s, zero_floor_s
from planner.partition import SolverTimeout, apply_split, solve_split
from planner.shapes import pipeline_rows, rank_shapes
from planner.candidates import ZERO_STAGES, SearchOptions, allowed, time_groups
from planner.space import Choice, build_plan, under_schedule

REPRICED = 20   # closed-form best plans re-priced by simulation for the final ranking
VARIANTS_OF = 5   # best simulated plans laid out for schedules without a closed form (ZBV)


@dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    plan: Plan
    estimate: Estimate


@dataclass(kw_only=True)
class SearchStats:
    wall_s: float = 0.0
    num_candidates: int = 0
    num_feasible: int = 0
    num_solved: int = 0
    pruned_by_reason: dict[str, int] = field(default_factory=dict)
    optimal: bool = True
    lower_bound_s: float = 0.0  # no plan left unexamined can beat this (equals the best when optimal)

    def prune(self, reason: str) -> None:
        self.pruned_by_reason[reason] = self.pruned_by_reason.get(reason, 0) + 1

    def to_dict(self) -> dict:
        return {"wall_s": self.wall_s, "num_candidates": self.num_candidates,
                "num_feasible": self.num_feasible, "num_solved": self.num_solved,
                "pruned_by_reason": dict(sorted(self.pruned_by_reason.items())), "optimal": self.optimal,
                "lower_bound_s": self.lower_bound_s}


@dataclass(kw_only=True)
class SearchResult:
    plans: list[Found]
    stats: SearchStats
    evaluated: list[Found]         # every plan the solver produced, for --csv
    closest: Found | None = None   # when nothing fits: the plan that overflows least
    equivalent: int = 1            # the first plans within the error band of the fastest
    error_band: float = 0.0
    fastest: Found | None = None   # the fastest plan found (plans[0] is the most robust)
    # the fastest closed-form plan, which the optimality proof is about (differs from `fastest`
    # when a schedule priced only by simulation, ZBV, beat it)
    proven_fastest: Found | None = None


@dataclass(frozen=True, slots=True)
class _Timed:
    rtm: RankTimeModel  # priced with one virtual stage (RankTimeModel.with_vpp adds more)
    spans: Spans
    zero_floors_s: tuple[float, ...]  # planner.bounds.zero_floor_s per ZeRO stage


class _Shared:
    """What many candidates of one search share, computed once: the rank time model (it does
    not depend on the ZeRO stage or the schedule, and on the virtual stages only through the
    pipeline sends), the ZeRO floor, and the memory shapes (they do not depend on placement)."""

    def __init__(self, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions) -> None:
        self.model, self.train, self.cluster = model, train, cluster
        stages = allowed(options, "zero_stage", list(ZERO_STAGES))
        self.zero_allowed = tuple(zero in stages for zero in ZERO_STAGES)
        self._times: dict[tuple, tuple[RankTimeModel, Spans]] = {}
        self._zero: dict[tuple, float] = {}
        self._memory: dict[tuple, tuple[MemoryFit, Plan]] = {}
        self._rows: dict[tuple, tuple[list, list]] = {}
        self._probes: dict[tuple, Plan] = {}

    def time_model(self, base: Choice) -> "_Timed":
        """`base`: a choice with one virtual stage and no schedule (time_groups)."""
        key = (base.tp, base.cp, base.pp, base.dp, base.micro_batch_size, base.sequence_parallel, base.recompute,
               base.mesh_axis_order)
        if key not in self._times:
            placed = key[:-1]  # the same choice under another placement differs only in its order
            if placed in self._probes:
                probe = replace(self._probes[placed], mesh_axis_order=base.mesh_axis_order)
            else:
                probe = self._probes[placed] = build_plan(self.model, self.train, self.cluster, base)
            sp = spans(probe, self.cluster)
            self._times[key] = _Timed(rank_time_model(self.model, self.train, probe, self.cluster, sp), sp,
                                      self._zero_floors_s(base, probe.num_micro_batches, sp.dp))
        return self._times[key]

    def _zero_floors_s(self, c: Choice, num_micro_batches: int, dp_span: AxisSpan) -> tuple[float, ...]:
        key = (c.tp, c.pp, c.dp * c.cp, num_micro_batches, dp_span)
        if key not in self._zero:
            self._zero[key] = tuple(zero_floor_s(self.model, self.train, self.cluster, c.tp, c.pp, c.dp * c.cp,
                                                 zero, num_micro_batches, dp_span) for zero in ZERO_STAGES)
        return self._zero[key]

    def memory(self, base: Choice, vpp: int, schedule: Schedule, zero: int) -> tuple[MemoryFit, Plan] | None:
        """What memory says about this candidate, and a plan of it under the placement first seen
        (memory and pipeline shape do not depend on placement); None until `add_memory`."""
        return self._memory.get(self._memory_key(base, vpp, schedule, zero))

    def add_memory(self, base: Choice, plan: Plan) -> tuple[MemoryFit, Plan]:
        """Memory fit of `plan`, and of the same choice under the other ZeRO stages the search
        will come to (they share the costly activation shapes)."""
        reserved = self.cluster.device.efficiency.reserved_memory_bytes
        key = lambda zero: self._memory_key(base, plan.vpp, plan.schedule, zero)  # noqa: E731
        stages = tuple(z for z in ZERO_STAGES if key(z) not in self._memory
                       and (z == plan.zero_stage or (self.zero_allowed[z] and base.dp * base.cp > 1)))
        plans = [plan if zero == plan.zero_stage else replace(plan, zero_stage=zero) for zero in stages]
        for sharded, memory in zip(plans, stage_memory_shapes_by_zero(self.model, self.train, plans, reserved,
                                                                                  self.cluster.framework)):
            fit = MemoryFit(memory, sharded, self.cluster.memory_budget_bytes, self.model.num_layers)
            self._memory[key(sharded.zero_stage)] = fit, sharded
        return self._memory[key(plan.zero_stage)]

    @staticmethod
    def _memory_key(c: Choice, vpp: int, schedule: Schedule, zero: int) -> tuple:
        return (c.tp, c.cp, c.pp, c.dp, zero, c.recompute, c.sequence_parallel, c.micro_batch_size, vpp, schedule)

    def pipeline_floor_s(self, base: Choice, zero: int, plan: Plan, fit: MemoryFit) -> float:
        """planner.bounds.pipeline_floor_s + the ZeRO floor, for `plan` under base's placement."""
        timed = self.time_model(base)
        key = (base, plan.vpp, plan.schedule)
        if key not in self._rows:
            self._rows[key] = pipeline_rows(timed.rtm.with_vpp(plan.vpp), plan)
        ts, fs = self._rows[key]
        return pipeline_floor_s(ts, fs, plan, fit, self.model.num_layers) + timed.zero_floors_s[zero]


def search(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
           options: SearchOptions = SearchOptions(), *, _reuse: "_Shared | None" = None) -> SearchResult:
    start = time.perf_counter()
    stats = SearchStats()
    # a narrower search of the same question (the executable alternatives) reuses the wider
    # one's rank time models and memory fits: they depend on the candidate, not the constraints
    shared = _reuse or _Shared(model, train, cluster, options)
    variants, bounds = [], []
    for base, group in time_groups(model, train, cluster, options, stats.prune):
        # a Plan is built only for the candidates the branch and bound examines
        timed = shared.time_model(base)
        m = train.global_batch_size // base.dp // base.micro_batch_size
        for vpp, schedule in group:
            variants.append((base, vpp, schedule))
            bounds.append(time_floor_s(model, timed.rtm, base.pp, m, schedule, vpp, base.recompute))
            bounds.extend(timed.zero_floors_s)
    table = np.array(bounds).reshape(-1, 1 + len(ZERO_STAGES))
    # ZeRO needs a group to shard over: without one, every stage is the same plan as stage 0
    sharded = np.array([base.dp * base.cp > 1 for base, _, _ in variants], dtype=bool)[:, None]
    valid = np.array(shared.zero_allowed)[None, :] & (sharded | (np.arange(len(ZERO_STAGES)) == 0)[None, :])
    candidates = _Candidates(variants, np.where(valid, table[:, :1] + table[:, 1:], np.inf))
    stats.num_candidates = len(candidates) + sum(stats.pruned_by_reason.values())
    _say(options, f"{len(candidates)} valid candidates; solving in order of their lower bound")
    result = _branch_and_bound(shared, options, stats, candidates, start + options.time_limit_s)
    result = _with_executable_alternatives(model, train, cluster, options, result, start, shared)
    stats.wall_s = time.perf_counter() - start
    return result


def _repriced(options: SearchOptions) -> int:
    """How many of the best plans are re-priced by simulation and kept for the ranking."""
    return max(options.repriced or REPRICED, options.top_k)


def _with_executable_alternatives(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
                                  options: SearchOptions, result: SearchResult, start: float,
                                  shared: "_Shared") -> SearchResult:
    """When the fastest plan is one `planner run` cannot execute (context parallelism), the
    fastest plans it can execute are searched too (cp fixed to 1: a smaller space), so that the
    robustness tie-break can prefer one of them when it is within the error band."""
    if (not result.plans or options.error_band <= 0 or options.objective != "time" or "cp" in options.fixed
            or runtime_executes(result.plans[0].plan)):
        return result
    left = options.time_limit_s - (time.perf_counter() - start)
    if left <= 0:
        return result
    alt = search(model, train, cluster, replace(options, fixed={**options.fixed, "cp": 1}, error_band=0.0,
                                                time_limit_s=left, progress=None, repriced=options.top_k),
                 _reuse=shared)
    # the band is measured from the fastest plan of the whole search, which the shown list (cut to
    # top_k in robustness order) may not hold
    extra = [] if result.fastest is None or result.fastest in result.plans else [result.fastest]
    pool = _rank(extra + result.plans + alt.plans,
                 replace(options, top_k=_repriced(options)))
    plans, equivalent = _robust_first(pool, options.error_band)
    return replace(result, plans=plans[:options.top_k], equivalent=equivalent)


def unsatisfiable_constraints(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
                              options: SearchOptions) -> list[str]:
    """When the constraints leave no candidate at all: each fixed field whose value no plan can
    take, with the values it could take; or, when each is possible alone, that they are not
    together."""
    possible: dict[str, set] = {name: set() for name in options.fixed}
    for base, group in time_groups(model, train, cluster, replace(options, fixed={}), lambda reason: None):
        for vpp, schedule in group:
            for zero in ZERO_STAGES if base.dp * base.cp > 1 else (0,):
                choice = replace(base, vpp=vpp, schedule=schedule, zero_stage=zero)
                for name, seen in possible.items():
                    seen.add(getattr(choice, name))
    problems = []
    for name, value in options.fixed.items():
        if value not in possible[name]:
            shown = ", ".join(str(v) for v in sorted(possible[name]))
            problems.append(f"{name}={value} is not possible for {model.name} on {cluster.name} "
                            f"(the search considers: {shown})")
    if not problems and options.fixed:
        pinned = ", ".join(f"{k}={v}" for k, v in options.fixed.items())
        problems.append(f"each of {pinned} is possible, but not all together")
    return problems


def _say(options: SearchOptions, text: str) -> None:
    if options.progress:
        options.progress(text)


@dataclass(frozen=True, slots=True)
class _Candidates:
    """Every outer choice, as (base choice, vpp, schedule) (see time_groups), with its lower
    bound per ZeRO stage (inf where the stage is not a candidate), taken in order of the bound
    (ties: generation order, then ZeRO stage)."""

    variants: list[tuple[Choice, int, Schedule]]
    bounds: np.ndarray  # [variant, ZeRO stage]

    def __len__(self) -> int:
        return int(np.isfinite(self.bounds).sum())

    def in_order(self) -> Iterator[tuple[float, Choice, int, Schedule, int]]:
        flat = self.bounds.ravel()
        order = np.argsort(flat, kind="stable")[: len(self)]
        width = self.bounds.shape[1]
        for index, bound in zip(order.tolist(), flat[order].tolist()):
            yield bound, *self.variants[index // width], index % width


def _branch_and_bound(shared: _Shared, options, stats, candidates: _Candidates, deadline: float) -> SearchResult:
    found: list[Found] = []
    too_big: list[tuple[Choice, int, Schedule, int]] = []  # candidates that cannot fit
    cutoff = _cutoff(found, options)
    count = len(candidates)
    for index, (bound, base, vpp, schedule, zero) in enumerate(candidates.in_order()):
        if bound >= cutoff:
            stats.pruned_by_reason["bound"] = stats.pruned_by_reason.get("bound", 0) + count - index
            break
        if time.perf_counter() > deadline:
            stats.optimal = False
            stats.lower_bound_s = bound
            stats.pruned_by_reason["time limit"] = count - index
            _say(options, f"time limit reached after {index:,} of {count:,} candidates")
            break
        if index and index % 500 == 0:
            _say(options, f"examined {index:,}, solved {stats.num_solved}, best so far "
                          f"{min((f.estimate.step_time_s for f in found), default=math.inf):.3f} s")
        entry = _memory_entry(shared, stats, base, vpp, schedule, zero)
        if entry is None:
            continue
        fit, plan = entry
        outcome = _examine(shared, stats, base, zero, plan, fit, cutoff, deadline) if fit.fits else None
        if outcome is None:
            stats.prune("memory")
            too_big.append((base, vpp, schedule, zero))
        elif isinstance(outcome, Found):
            found.append(outcome)
            cutoff = _cutoff(found, options)
    if stats.optimal:
        stats.lower_bound_s = min((f.estimate.step_time_s for f in found), default=math.inf)
    return _result(shared, options, stats, found, too_big)


def _memory_entry(shared: _Shared, stats: SearchStats, base: Choice, vpp: int, schedule: Schedule,
                  zero: int) -> tuple[MemoryFit, Plan] | None:
    """The candidate's memory fit and a plan of it, built and checked on the first visit of its
    placement-free choice; None when the plan is structurally invalid."""
    entry = shared.memory(base, vpp, schedule, zero)
    if entry is not None:
        return entry
    try:
        plan = build_plan(shared.model, shared.train, shared.cluster,
                          replace(base, zero_stage=zero, vpp=vpp, schedule=schedule))
    except ValueError:
        stats.prune("does not divide")
        return None
    problems = check_structure(shared.model, shared.train, shared.cluster, plan)
    if problems:
        stats.prune(problems[0].split(" (")[0][:60])
        return None
    return shared.add_memory(base, plan)


def _examine(shared: _Shared, stats: SearchStats, base: Choice, zero: int, plan: Plan, fit: MemoryFit,
             cutoff: float, deadline: float) -> Found | bool | None:
    """A candidate some split of which fits: the pipeline floor, then the full bound, then
    CP-SAT. The plan found, False when pruned (bound, solver time limit), None when no split fits
    after all."""
    model, train, cluster = shared.model, shared.train, shared.cluster
    if shared.pipeline_floor_s(base, zero, plan, fit) >= cutoff:
        stats.prune("bound")
        return False
    if plan.mesh_axis_order != base.mesh_axis_order:
        plan = replace(plan, mesh_axis_order=base.mesh_axis_order)
    rtm = shared.time_model(base).rtm.with_vpp(plan.vpp)
    shapes = rank_shapes(model, train, cluster, plan, memory=fit.memory, rtm=rtm)
    if lower_bound_with_memory_s(shapes, plan, fit, model.num_layers) >= cutoff:
        stats.prune("bound")
        return False
    try:
        split = solve_split(model, train, cluster, plan, ranks=shapes, cutoff_s=cutoff, fit=fit,
                            time_limit_s=max(1.0, deadline - time.perf_counter()))
    except SolverTimeout:
        stats.optimal = False
        stats.prune("solver time limit")
        return False
    stats.num_solved += 1
    if split is None:
        if math.isinf(cutoff):
            return None
        stats.prune("bound")  # no split that fits beats the K-th best
        return False
    stats.optimal &= split.optimal
    concrete = apply_split(plan, split)
    est = estimate(model, train, cluster, concrete, simulate=False)
    if not est.fits:  # integer rounding at the very edge
        return None
    stats.num_feasible += 1
    return Found(plan=concrete, estimate=est)


def _result(shared: _Shared, options: SearchOptions, stats: SearchStats, found: list[Found],
            too_big: list[tuple[Choice, int, Schedule, int]]) -> SearchResult:
    """Re-price the best plans by simulation and rank them; when nothing fits, the closest plan."""
    model, train, cluster = shared.model, shared.train, shared.cluster
    closest = None
    if not found:  # only then does anyone need to know how far the plans are from fitting
        for base, vpp, schedule, zero in too_big[:2000]:
            choice = replace(base, zero_stage=zero, vpp=vpp, schedule=schedule)
            closest = _closer(model, train, cluster, build_plan(model, train, cluster, choice), closest)
    ranked = _rank(found, replace(options, top_k=_repriced(options)))
    simulated = {id(f): Found(plan=f.plan, estimate=estimate(model, train, cluster, f.plan)) for f in ranked}
    evaluated = [simulated.get(id(f), f) for f in found]
    fitting = [f for f in simulated.values() if f.estimate.fits]
    proven = min(fitting, key=lambda f: f.estimate.step_time_s) if fitting else None
    # variants of the few best simulated plans only: each simulation costs milliseconds to tens of them
    best = sorted(fitting, key=lambda f: f.estimate.step_time_s)[:max(options.top_k, VARIANTS_OF)]
    variants = [f for f in _simulated_variants(shared, options, best) if f.estimate.fits]
    fitting += variants
    fastest = min(fitting, key=lambda f: f.estimate.step_time_s) if fitting else None
    plans = _rank(fitting, replace(options, top_k=max(REPRICED, options.top_k)))
    # `--objective memory` already picks the leanest plan near the fastest
    band = options.error_band if options.objective == "time" else 0.0
    plans, equivalent = _robust_first(plans, band)
    return SearchResult(plans=plans[:options.top_k], stats=stats, evaluated=evaluated + variants, closest=closest,
                        equivalent=equivalent, error_band=options.error_band, fastest=fastest,
                        proven_fastest=proven)


def _simulated_variants(shared: _Shared, options: SearchOptions, ranked: list[Found]) -> list[Found]:
    """Schedules without a closed form (ZBV) compete by simulation: each of the best closed-form
    plans with a pipeline, laid out for the schedule (its virtual stages, layers split evenly,
    the same recomputation per rank), priced by the event simulator. They are outside the
    closed-form proof; SearchResult.proven_fastest is what the proof is about."""
    if options.fixed.keys() & {"schedule", "vpp"}:
        return []
    model, train, cluster = shared.model, shared.train, shared.cluster
    out, seen = [], set()
    for schedule in Schedule:
        if schedule.traits.closed_form or (options.schedules is not None and schedule not in options.schedules):
            continue
        for f in ranked:
            if f.plan.pp < 2 or model.num_layers < f.plan.pp * max(2, schedule.traits.min_vpp):
                continue
            variant = under_schedule(model, f.plan, schedule)
            if variant in seen or check_structure(model, train, cluster, variant):
                continue
            seen.add(variant)
            out.append(Found(plan=variant, estimate=estimate(model, train, cluster, variant)))
    return out


def _robust_first(ranked: list[Found], band: float) -> tuple[list[Found], int]:
    """The plans within `band` of the fastest, most robust first: one the runtime executes, then
    more memory headroom (in steps of a tenth of the device), then fewer moving parts (context,
    pipeline and virtual stages, tensor ranks, a zero-bubble schedule), then time; the rest by
    time after them. Returns the order and how many are equivalent."""
    if not ranked or band <= 0:
        return ranked, min(len(ranked), 1)
    limit = ranked[0].estimate.step_time_s * (1 + band)
    near = [f for f in ranked if f.estimate.step_time_s <= limit]

    def robustness(f: Found) -> tuple:
        e, p = f.estimate, f.plan
        headroom_tenths = math.floor(10 * (1 - e.max_peak_memory_bytes / e.memory_capacity_bytes))
        return (not runtime_executes(p), -headroom_tenths, p.cp, p.pp * p.vpp, p.tp,
                p.schedule.defers_weight_grad, e.step_time_s)

    near.sort(key=robustness)
    return near + [f for f in ranked if f not in near], len(near)


def _cutoff(found: list[Found], options: SearchOptions) -> float:
    """No candidate whose bound reaches this can enter the answer."""
    if len(found) < options.top_k:
        return math.inf
    times = heapq.nsmallest(options.top_k, (f.estimate.step_time_s for f in found))
    cutoff = times[-1]
    if options.objective == "memory":
        cutoff = max(cutoff, 1.05 * times[0])
    return cutoff


def _outer_key(plan: Plan) -> Plan:
    return replace(plan, layers_per_stage=(), recompute_num_layers=())


def _rank(found: list[Found], options: SearchOptions) -> list[Found]:
    best: dict[Plan, Found] = {}
    for f in found:
        key = _outer_key(f.plan)
        if key not in best or f.estimate.step_time_s < best[key].estimate.step_time_s:
            best[key] = f
    found = list(best.values())
    # equal predicted times (to the microsecond): less memory, then the simpler plan first
    by_time = sorted(found, key=lambda f: (round(f.estimate.step_time_s, 6), f.estimate.max_peak_memory_bytes,
                                           f.plan.cp, f.plan.pp, f.plan.tp, f.plan.vpp, f.plan.short()))
    if options.objective == "memory" and by_time:
        limit = 1.05 * by_time[0].estimate.step_time_s
        near = [f for f in by_time if f.estimate.step_time_s <= limit]
        near.sort(key=lambda f: (f.estimate.max_peak_memory_bytes, f.estimate.step_time_s))
        by_time = near + [f for f in by_time if f not in near]
    return by_time[: options.top_k]


def _closer(model, train, cluster, plan, closest: Found | None) -> Found:
    """The candidate with everything recomputed and layers even: how far from fitting is it?"""
    counts = tuple(plan.layers_on_rank(r) for r in range(plan.pp)) if plan.recompute is not Recompute.NONE \
        else (0,) * plan.pp
    probe = replace(plan, recompute_num_layers=counts)
    est = estimate(model, train, cluster, probe, simulate=False)
    if closest is None or est.max_peak_memory_bytes < closest.estimate.max_peak_memory_bytes:
        return Found(plan=probe, estimate=est)
    return closest
