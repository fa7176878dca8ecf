"""Replicas on device groups: the part of a mixed cluster's space without a pipeline.

With pp = 1 each data-parallel replica runs on one group (costmodel.groups), and the replicas of
a group run their own micro-batch size (Plan.micro_batch_sizes): a faster group takes a larger
share of the global batch (Sailor, SOSP '24, and Whale, ATC '22, balance batches the same way).
Every replica runs the same number of micro-batches m (FSDP2's collectives are per micro-batch),
so a share vector is a micro-batch size per group with m·sum(replicas_g·mbs_g) = the global batch.

There is no layer split: a candidate is its degrees, mesh order, share vector, SP, recompute mode
and ZeRO stage, and the one free number is how many layers it recomputes, which the least count
that fits every group's memory decides (time grows with it). The candidates are priced exactly in
order of a valid lower bound (each group's closed-form pipeline floor and ZeRO floor on its own
replica view; the step is the slowest group's), the branch and bound's cutoff stopping them.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Iterator

from costmodel.check import check_structure
from costmodel.estimate import estimate
from costmodel.groups import group_plan, group_replicas, group_train, placement_problems, replica_view
from costmodel.hardware import ClusterSpec
from costmodel.memory import reserved_bytes, stage_memory_shapes
from costmodel.plan import Plan, Recompute
from costmodel.rank_time import rank_time_model, spans
from costmodel.schedules import Schedule
from costmodel.specs import ModelSpec, TrainSpec
from planner.bounds import MemoryFit, time_floor_s, zero_floor_s
from planner.candidates import replica_degrees
from planner.cutoff import Cutoff
from planner.search_options import MAX_MICRO_BATCH, SearchOptions, allowed
from planner.search_result import Found, SearchStats
from planner.space import degrees_plan, divisors


def share_vectors(replicas: list[int], global_batch: int, sizes: list[range]) -> Iterator[tuple[tuple[int, ...], int]]:
    """(micro-batch size per group, micro-batches) with m·sum(replicas_g·mbs_g) = global_batch,
    group g's size taken from sizes[g]: per micro-batch count m, the vectors that add up to
    global_batch / m (solved group by group, never the whole product of the ranges)."""
    if not all(sizes):
        return
    for m in divisors(global_batch):
        for vector in _vectors(tuple(replicas), tuple(sizes), global_batch // m):
            yield vector, m


def _vectors(replicas: tuple[int, ...], sizes: tuple[range, ...], target: int) -> Iterator[tuple[int, ...]]:
    if not replicas:
        if target == 0:
            yield ()
        return
    low = sum(r * s.start for r, s in zip(replicas[1:], sizes[1:]))        # the least the others take
    high = sum(r * (s.stop - 1) for r, s in zip(replicas[1:], sizes[1:]))  # the most
    for size in sizes[0]:
        left = target - replicas[0] * size
        if left < low:
            break
        if left <= high:
            for tail in _vectors(replicas[1:], sizes[1:], left):
                yield (size, *tail)


class _OutOfTime(Exception):
    """The time limit passed while the candidates were being listed."""


def _skeletons(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions,
               leanest_zero: int, too_big: list[Plan], deadline: float) -> Iterator[Plan]:
    """Every pp = 1 layout whose replicas each lie in one group, with its share vectors, SP and
    recompute mode (ZeRO stage 0 here; the stages are the candidates' last axis). A layout no
    group of which holds even one sequence per micro-batch goes to `too_big` instead. With
    experts, equal shares only (their balancing loss is not weighted by shares: check_plan)."""
    modes = [Recompute.NONE] if options.no_recompute else allowed(options, "recompute", list(Recompute))
    lean_mode = max(modes, key=_lean)
    fixed = options.fixed.get("micro_batch_size")
    for tp, cp, dp, orders, sps in replica_degrees(model, train, cluster, options):
        for order in orders:
            probe = degrees_plan(dp=dp, tp=tp, pp=1, cp=cp, mesh_axis_order=order, num_layers=model.num_layers)
            if placement_problems(probe, cluster):   # a replica across two groups
                continue
            replicas = group_replicas(probe, cluster)
            for sp in sps:
                leanest = replace(probe, sequence_parallel=sp, zero_stage=leanest_zero, recompute=lean_mode,
                                  recompute_num_layers=_least_count(lean_mode))
                most = [_most_that_fits(model, train, cluster, leanest, g) for g in range(len(replicas))]
                sizes = [range(1, min(n, fixed or n) + 1) for n in most]
                if not all(sizes) and len(too_big) < TOO_BIG_KEPT and train.global_batch_size % sum(replicas) == 0:
                    too_big.append(replace(leanest, micro_batch_sizes=(1,) * len(replicas),
                                           num_micro_batches=train.global_batch_size // sum(replicas)))
                for vector, m in share_vectors(replicas, train.global_batch_size, sizes):
                    if time.perf_counter() > deadline:
                        raise _OutOfTime
                    if (fixed and max(vector) != fixed) or (model.is_moe and len(set(vector)) > 1):
                        continue
                    for mode in modes:
                        yield replace(probe, micro_batch_size=max(vector), num_micro_batches=m,
                                      micro_batch_sizes=() if model.is_moe else vector,
                                      sequence_parallel=sp, recompute=mode, recompute_num_layers=_least_count(mode))


def _least_count(mode: Recompute) -> tuple[int]:
    """The fewest recomputed layers a one-stage plan of `mode` may name (check_plan's rule)."""
    return (0 if mode is Recompute.NONE else 1,)


def _lean(mode: Recompute) -> int:
    """How little a recompute mode keeps: full < selective < none."""
    return {Recompute.NONE: 0, Recompute.SELECTIVE: 1, Recompute.FULL: 2}[mode]


def _most_that_fits(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, leanest: Plan, group: int) -> int:
    """The largest micro-batch size group `group`'s replicas can hold at all (the leanest ZeRO
    stage and recompute mode allowed; memory grows with it): larger ones are never candidates."""
    n = len(cluster.groups)
    for mbs in range(1, MAX_MICRO_BATCH + 1):
        probe = replace(leanest, micro_batch_size=mbs, micro_batch_sizes=(mbs,) * n)
        if _group_least_recompute(model, train, cluster, probe, group) is None:
            return mbs - 1
    return MAX_MICRO_BATCH


class _Floors:
    """The slowest group's floor: its pipeline (one stage: m times a micro-batch, the least
    recomputation) and what its ZeRO stage adds at the least, on its replica view. The rank
    time model depends on neither m nor the ZeRO stage, the ZeRO floor not on the micro-batch
    size: each is priced once per what it depends on (tens of thousands of candidates)."""

    def __init__(self, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec) -> None:
        self.model, self.train, self.cluster = model, train, cluster
        self._rtm: dict[tuple, object] = {}
        self._zero: dict[tuple, float] = {}

    def bound_s(self, plan: Plan, zero: int) -> float:
        """For `plan` under ZeRO stage `zero` (the candidates are built only when examined)."""
        return max(self._group_s(plan, g, zero) for g in range(len(self.cluster.groups)))

    def _group_s(self, plan: Plan, g: int, zero: int) -> float:
        shape = (g, plan.tp, plan.cp, plan.dp, plan.mesh_axis_order, plan.sequence_parallel)
        key = (*shape, plan.recompute, plan.micro_batch_sizes[g] if plan.micro_batch_sizes else plan.micro_batch_size)
        zkey = (*shape, zero, plan.num_micro_batches)
        if key not in self._rtm or zkey not in self._zero:
            gplan, view = group_plan(plan, self.cluster, g), replica_view(self.cluster, g)
            train = group_train(self.train, plan, self.cluster, g)
            if key not in self._rtm:
                self._rtm[key] = rank_time_model(self.model, train, gplan, view, spans(gplan, view))
            if zkey not in self._zero:
                self._zero[zkey] = zero_floor_s(self.model, train, view, plan.tp, 1, plan.dp * plan.cp,
                                                zero, plan.num_micro_batches, spans(gplan, view))
        return time_floor_s(self.model, self._rtm[key], 1, plan.num_micro_batches, plan.schedule, 1,
                            plan.recompute) + self._zero[zkey]


def _least_recompute(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> int | None:
    """The fewest recomputed layers with which every group's replicas fit (None: none do)."""
    counts = [_group_least_recompute(model, train, cluster, plan, g) for g in range(len(cluster.groups))]
    if None in counts:
        return None
    return max(*_least_count(plan.recompute), *counts)


def _group_least_recompute(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan,
                           group: int) -> int | None:
    view, gplan = replica_view(cluster, group), group_plan(plan, cluster, group)
    shapes = stage_memory_shapes(model, group_train(train, plan, cluster, group), gplan,
                                 reserved_bytes(model, train, gplan, view.device, view.framework, cluster.devices_per_node),
                                 view.framework)
    least = int(MemoryFit(shapes, gplan, [view.memory_budget_bytes], model.num_layers)
                .least_recomputed[0, model.num_layers])
    return None if least < 0 else least


# what "nothing fits" looks at: the first candidates (in bound order) that fit no group's memory
TOO_BIG_KEPT = 200


def search_shares(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions,
                  zero_stages: list[int], stats: SearchStats, pruning: Cutoff,
                  deadline: float) -> tuple[list[Found], list[Plan]]:
    """The best plans of this part of the space under the cutoff (tightened as plans are found),
    and some that fit nowhere (for the closest when nothing fits at all); the candidates are
    counted in `stats`."""
    if not cluster.is_mixed or options.fixed.get("pp", 1) != 1 or options.fixed.get("ep", 1) != 1:
        return [], []
    if not zero_stages or any(options.fixed.get(k) for k in ("offload_optimizer", "offload_activations", "fp8_linears")):
        return [], []
    if options.fixed.get("vpp", 1) != 1 or options.fixed.get("schedule", Schedule.ONE_F_ONE_B) is not Schedule.ONE_F_ONE_B:
        return [], []   # without a pipeline: one stage, 1F1B's (planner.candidates._schedules)
    floors = _Floors(model, train, cluster)
    # (bound, skeleton, ZeRO stage): a plan is built only for the candidates examined
    too_big: list[Plan] = []
    candidates = []
    try:
        for skeleton in _skeletons(model, train, cluster, options, max(zero_stages), too_big, deadline):
            candidates += [(floors.bound_s(skeleton, z), skeleton, z) for z in zero_stages]
    except _OutOfTime:
        stats.optimal = False
        stats.prune("time limit")
    stats.num_candidates += len(candidates)
    candidates.sort(key=lambda c: c[0])
    found: list[Found] = []
    for index, (bound_s, skeleton, zero) in enumerate(candidates):
        if bound_s >= pruning.s:
            stats.prune("bound", len(candidates) - index)
            break
        if time.perf_counter() > deadline:
            stats.optimal = False
            stats.lower_bound_s = min(stats.lower_bound_s or math.inf, bound_s)
            stats.prune("time limit", len(candidates) - index)
            break
        plan = replace(skeleton, zero_stage=zero)
        count = _least_recompute(model, train, cluster, plan)
        if count is None:
            stats.prune("memory")
            if len(too_big) < TOO_BIG_KEPT:
                too_big.append(replace(plan, recompute_num_layers=_least_count(plan.recompute)))
            continue
        plan = replace(plan, recompute_num_layers=(count,))
        if check_structure(model, train, cluster, plan):
            stats.prune("invalid")
            continue
        est = estimate(model, train, cluster, plan, simulate=False)
        if not est.fits:
            stats.prune("memory")
            continue
        stats.num_feasible += 1
        found.append(Found(plan=plan, estimate=est))
        pruning.add(found[-1])
    return found, too_big
