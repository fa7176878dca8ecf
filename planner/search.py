"""`planner search`: the fastest plan that fits, exact under the cost model.

Outer choices (tp, cp, pp, dp, micro-batch, virtual stages, schedule, ZeRO stage, sequence
parallelism, recompute mode, rank placement) are enumerated; each gets a valid lower bound on its
step time from the cost model's per-rank shape (the slowest rank takes at least the average share
of all ranks' work, times m micro-batches). Candidates are taken in order of that bound and solved
exactly by CP-SAT (layer split and per-rank recompute under the memory cap, planner.partition);
the search stops once the bound of the next candidate is no better than the K-th best plan found.
So the result is the optimum over the whole space whenever every CP-SAT solve proved optimality.

All of this reasons with the closed-form pipeline (`estimate(..., simulate=False)`), which the
bounds and CP-SAT's affine model are derived from, so the proof is consistent. The best plans of
that search (REPRICED of them) are then priced by the event simulation, which is what is shown
and ranked; one whose simulated memory does not fit is dropped.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

from costmodel.check import check_structure
from costmodel.cluster import ClusterSpec
from costmodel.estimate import Estimate, estimate
from costmodel.plan import Plan, Recompute, Schedule
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.timing import spans
from planner.bounds import lower_bound_s, zero_floor_s
from planner.partition import (SolverTimeout, apply_split, lower_bound_with_memory_s, rank_shapes, solve_split,
                               split_exists)
from planner.space import Choice, build_plan, degrees_plan, divisors

MAX_MICRO_BATCH = 64
REPRICED = 20   # closed-form best plans re-priced by simulation for the final ranking
MAX_CP = 8


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchOptions:
    top_k: int = 5
    max_tp: int | None = None  # None: devices per node (TP across nodes is never competitive)
    fixed: dict = field(default_factory=dict)  # field name -> value, e.g. {"pp": 4}
    no_recompute: bool = False
    objective: str = "time"  # or "memory": least memory within 5 % of the best time
    time_limit_s: float = 60.0  # then stop: best found so far, not proven optimal
    progress: Callable[[str], None] | None = None


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


def _orders(degrees: dict[str, int], cluster: ClusterSpec) -> list[tuple[str, ...]]:
    """Mesh axis orders that place groups differently (others are equivalent for the model)."""
    seen, out = set(), []
    for order in itertools.permutations(("pp", "dp", "cp", "tp")):
        key = spans(degrees_plan(**degrees, mesh_axis_order=order), cluster)
        if key not in seen:
            seen.add(key)
            out.append(order)
    return out


def _allowed(options: SearchOptions, name: str, values: list) -> list:
    if name in options.fixed:
        return [v for v in values if v == options.fixed[name]]
    return values


def _dominant(options: SearchOptions, name: str, values: list, best) -> list:
    """Keep only the value that dominates the others under the cost model, unless the user fixed
    this field (then honour their choice)."""
    if name in options.fixed:
        return _allowed(options, name, values)
    return [best] if best in values else values


def _schedules(pp: int, vpp: int, mode: Recompute) -> tuple[list[Schedule], Schedule]:
    """(valid schedules, the dominant one). Under the model GPipe equals 1F1B in time and needs
    more memory; ZB-H1 has 1F1B's memory and a smaller fill, but cannot run with selective
    recomputation (check_plan)."""
    if pp == 1:
        return [Schedule.ONE_F_ONE_B], Schedule.ONE_F_ONE_B
    if vpp > 1:
        return [Schedule.INTERLEAVED], Schedule.INTERLEAVED
    valid = [Schedule.GPIPE, Schedule.ONE_F_ONE_B] + ([] if mode is Recompute.SELECTIVE else [Schedule.ZB_H1])
    return valid, valid[-1]


def _max_cp(cluster: ClusterSpec) -> int:
    """CPU ranks cannot run context parallelism (torch 2.13 has no context-parallel rule for the
    CPU attention kernel, so the runtime refuses it): plans for them keep cp = 1."""
    return 1 if cluster.device.kind == "cpu" else MAX_CP


def time_keys(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions,
              stats: SearchStats) -> Iterator[Choice]:
    """Every outer choice except the ZeRO stage (which the time bound does not depend on)."""
    world, L = cluster.world_size, model.num_layers
    max_tp = options.max_tp or cluster.devices_per_node
    tp_all = [t for t in divisors(math.gcd(model.num_heads, model.num_kv_heads, model.ffn_hidden_size))
              if t <= max(max_tp, options.fixed.get("tp", 0)) and world % t == 0]
    for tp in _allowed(options, "tp", tp_all):
        cp_all = [c for c in divisors(world // tp) if c <= _max_cp(cluster) and train.seq_len % c == 0]
        for cp in _allowed(options, "cp", cp_all):
            for pp in _allowed(options, "pp", [p for p in divisors(world // (tp * cp)) if p <= L]):
                dp = world // (tp * cp * pp)
                if train.global_batch_size % dp:
                    stats.prune("global batch not divisible by dp")
                elif options.fixed.get("dp", dp) == dp:
                    yield from _keys_for_degrees(model, train, cluster, options, tp, cp, pp, dp, stats)


def _keys_for_degrees(model, train, cluster, options, tp, cp, pp, dp, stats) -> Iterator[Choice]:
    L, per_replica = model.num_layers, train.global_batch_size // dp
    modes = [Recompute.NONE] if options.no_recompute else list(Recompute)
    # SP dominates no-SP: the same collective volume (AG + RS = AR), less memory, less elementwise work
    sps = _dominant(options, "sequence_parallel",
                    [True, False] if tp > 1 and (train.seq_len // cp) % tp == 0 else [False], True)
    orders = _orders({"tp": tp, "cp": cp, "pp": pp, "dp": dp}, cluster)
    for mbs in _allowed(options, "micro_batch_size", [b for b in divisors(per_replica) if b <= MAX_MICRO_BATCH]):
        m = per_replica // mbs
        # interleaving as Megatron-LM runs it: equal chunks (pp x vpp divides the layers)
        vpps = [1] + ([v for v in divisors(L // pp)[1:] if L % pp == 0 and m % pp == 0] if pp > 1 else [])
        for vpp, mode, sp, order in itertools.product(_allowed(options, "vpp", vpps),
                                                      _allowed(options, "recompute", modes), sps, orders):
            valid, best = _schedules(pp, vpp, mode)
            for sched in _dominant(options, "schedule", valid, best):
                stats.num_candidates += 1
                yield Choice(tp=tp, pp=pp, cp=cp, dp=dp, zero_stage=0, recompute=mode, sequence_parallel=sp,
                             micro_batch_size=mbs, vpp=vpp, schedule=sched, mesh_axis_order=order)


def _zero_stages(options: SearchOptions, plan: Plan) -> list[int]:
    return _allowed(options, "zero_stage", [0, 1, 2, 3] if plan.dp * plan.cp > 1 else [0])


def search(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
           options: SearchOptions = SearchOptions()) -> SearchResult:
    start = time.perf_counter()
    stats = SearchStats()
    bounded: list[tuple[float, int, Plan]] = []
    for choice in time_keys(model, train, cluster, options, stats):
        try:
            plan = build_plan(model, train, cluster, choice)
        except ValueError:
            stats.prune("does not divide")
            continue
        problems = check_structure(model, train, cluster, plan)
        if problems:
            stats.prune(problems[0].split(" (")[0][:60])
            continue
        time_bound = lower_bound_s(model, train, cluster, plan)
        for zero in _zero_stages(options, plan):
            with_zero = replace(plan, zero_stage=zero)
            bound = time_bound + zero_floor_s(model, train, cluster, with_zero)
            bounded.append((bound, len(bounded), with_zero))
    bounded.sort(key=lambda item: item[:2])
    stats.num_candidates = len(bounded) + sum(stats.pruned_by_reason.values())
    _say(options, f"{len(bounded)} valid candidates; solving in order of their lower bound")
    seeds = _seeds(model, train, cluster, bounded)
    _say(options, f"{len(seeds)} seed plans, best {min((f.estimate.step_time_s for f in seeds), default=math.inf):.3f} s")
    result = _branch_and_bound(model, train, cluster, options, stats, bounded, start + options.time_limit_s, seeds)
    stats.wall_s = time.perf_counter() - start
    return result


def _say(options: SearchOptions, text: str) -> None:
    if options.progress:
        options.progress(text)


def _seeds(model, train, cluster, bounded) -> list[Found]:
    """Feasible plans of the kind Megatron-LM users start from (the largest TP, SP, ZeRO-1,
    micro-batch 1, one stage per rank, even split, every layer recomputed when the mode asks),
    priced by `estimate`. They only tighten the cutoff early; the search still examines every
    candidate whose bound is below it, so the result stays exact."""
    top_tp = max((plan.tp for _, _, plan in bounded), default=1)
    seeds = []
    for _, _, plan in bounded:
        zero = 1 if plan.dp * plan.cp > 1 else 0  # ZeRO-1 wherever there is a group to shard over
        if (plan.tp, plan.micro_batch_size, plan.vpp, plan.zero_stage) != (top_tp, 1, 1, zero):
            continue
        counts = tuple(plan.layers_on_rank(r) if plan.recompute is not Recompute.NONE else 0 for r in range(plan.pp))
        concrete = replace(plan, recompute_num_layers=counts)
        est = estimate(model, train, cluster, concrete, simulate=False)
        if est.fits:
            seeds.append(Found(plan=concrete, estimate=est))
    return seeds


def _branch_and_bound(model, train, cluster, options, stats, bounded, deadline: float,
                      seeds: list[Found]) -> SearchResult:
    found: list[Found] = list(seeds)
    too_big: list[Plan] = []
    for index, (bound, _, plan) in enumerate(bounded):
        if bound >= _cutoff(found, options):
            stats.pruned_by_reason["bound"] = stats.pruned_by_reason.get("bound", 0) + len(bounded) - index
            break
        if time.perf_counter() > deadline:
            stats.optimal = False
            stats.lower_bound_s = bound
            stats.pruned_by_reason["time limit"] = len(bounded) - index
            _say(options, f"time limit reached after {index:,} of {len(bounded):,} candidates")
            break
        if index and index % 500 == 0:
            _say(options, f"examined {index}, solved {stats.num_solved}, best so far "
                          f"{min((f.estimate.step_time_s for f in found), default=math.inf):.3f} s")
        shapes = rank_shapes(model, train, cluster, plan)
        cap, total = cluster.device.memory_bytes, model.num_layers
        if not split_exists(shapes, plan, cap, total):
            stats.prune("memory")
            too_big.append(plan)
            continue
        if lower_bound_with_memory_s(shapes, plan, cap, total) >= _cutoff(found, options):
            stats.prune("bound")
            continue
        try:
            split = solve_split(model, train, cluster, plan, ranks=shapes,
                                time_limit_s=max(1.0, deadline - time.perf_counter()))
        except SolverTimeout:
            stats.optimal = False
            stats.prune("solver time limit")
            continue
        stats.num_solved += 1
        if split is None:
            stats.prune("memory")
            too_big.append(plan)
            continue
        stats.optimal &= split.optimal
        concrete = apply_split(plan, split)
        est = estimate(model, train, cluster, concrete, simulate=False)
        if not est.fits:  # integer rounding at the very edge
            stats.prune("memory")
            continue
        stats.num_feasible += 1
        found.append(Found(plan=concrete, estimate=est))
    if stats.optimal:
        stats.lower_bound_s = min((f.estimate.step_time_s for f in found), default=math.inf)
    closest = None
    if not found:  # only then does anyone need to know how far the plans are from fitting
        for plan in too_big[:2000]:
            closest = _closer(model, train, cluster, plan, closest)
    ranked = _rank(found, replace(options, top_k=max(REPRICED, options.top_k)))
    simulated = {id(f): Found(plan=f.plan, estimate=estimate(model, train, cluster, f.plan)) for f in ranked}
    evaluated = [simulated.get(id(f), f) for f in found]
    plans = _rank([f for f in simulated.values() if f.estimate.fits], options)
    return SearchResult(plans=plans, stats=stats, evaluated=evaluated, closest=closest)


def _cutoff(found: list[Found], options: SearchOptions) -> float:
    """No candidate whose bound reaches this can enter the answer."""
    times = sorted(f.estimate.step_time_s for f in found)
    if len(times) < options.top_k:
        return math.inf
    cutoff = times[options.top_k - 1]
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
