"""CP-SAT: split layers over pipeline ranks and choose per-rank recomputation under the memory cap
so that the predicted step time is minimal (the AdaPipe idea, Sun et al. 2024).

For one outer choice (degrees, micro-batch, schedule, ZeRO, recompute mode, placement) the cost
model is, per pipeline rank r, affine in its layer count L_r and recomputed-layer count n_r:
micro-batch time t_r, the schedule's fill f_r, optimizer time, memory (plus one step when n_r > 0);
the exposed data-parallel time is a max of affine pieces and a constant. planner.shapes reads those
coefficients from costmodel's own functions (tests/planner/test_partition.py checks they are
affine); the model (planner.split_model) minimises exactly what `estimate` computes:

    m·max(t) + (sum(f) - max(f)) / v + max_r(sum_k mult_k·max(comm_kr - window_kr, one layer's bucket))
    + max_r(optimizer_r + host_r + tp_replica_sync_r)   (+ a constant: tied-embedding sync)

in integer nanoseconds. Within a rank, interleaved virtual stages get an even split (the model
prices a rank by its totals only). A framework other than our runtime narrows the split
(`SplitRules`: equal stages, the first k layers of every virtual stage recomputed, ...); the
bounds of the free split stay valid lower bounds of the narrowed one.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, replace

from costmodel.groups import rank_caps_bytes
from costmodel.hardware import ClusterSpec
from costmodel.memory import AffineBytes, reserved_bytes, stage_memory_shapes
from costmodel.plan import Plan, Recompute, even_layers
from costmodel.specs import ModelSpec, TrainSpec
from planner.bounds import MemoryFit
from planner.dense_spreads import DenseChoice, DenseSpread, dense_spreads, first_stage_spread
from planner.shapes import RankShape, rank_shapes
from planner.split_model import FREE, SplitModel, SplitRules, cp_sat, integer_bytes, recomputes_all

# CP-SAT attempts on a split model, each stopped at a deterministic-time budget (the same on
# every machine, so the answer is too) and the last at the deadline:
# - without presolve almost every model settles in milliseconds; CP-SAT's defaults alone spend
#   an order of magnitude longer in presolve on the large ones (megatron_h100_70B);
# - a few models with deep pipelines and full recomputation need more: symmetry breaking without
#   probing settles some that the defaults alone do not (sc21_t1_530) but leaves others unproven
#   that the defaults prove (sc21_t1_1T); chained as below, both are proven;
# - presolve's dual reductions can loop for seconds of wall time at no deterministic time on the
#   block method's models at a fixed count, where the solve must show that a count cannot beat the
#   best so far (deep pipelines: benchmarks/search_speed.py's deepseek-v3 128x8xH100 --framework
#   megatron case spent most of its time there), so that attempt comes first without them
#   (keep_all_feasible_solutions_in_presolve), then as before.
ATTEMPTS: list[tuple[dict, float | None]] = [
    ({"cp_model_presolve": False}, 0.05),
    ({"symmetry_level": 4, "cp_model_probing_level": 0, "keep_all_feasible_solutions_in_presolve": True}, 0.3),
    ({"symmetry_level": 4, "cp_model_probing_level": 0}, 0.3),
    ({}, None),
]
# A budgeted attempt also stops at this many wall seconds per deterministic second: CP-SAT's
# deterministic clock can fall far behind the wall's (a pp 12 split of Llama 3.1 405B on 1,152
# H100s under full recomputation spent 7.8 s without presolve to reach 0.05 deterministic
# seconds; with presolve the same model is proven in 0.03 s). Generous, so that an ordinary
# model never reaches it and the answer stays the same on every machine.
WALL_PER_DETERMINISTIC_S = 20.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Split:
    layers: tuple[int, ...]      # per pipeline rank
    recomputed: tuple[int, ...]  # per pipeline rank
    optimal: bool


class SolverTimeout(Exception):
    """CP-SAT ran out of time before finding any split (not a proof that none fits)."""


def _single_rank_counts(plan: Plan, rules: SplitRules, total: int) -> list[int]:
    """The recompute counts a single rank of `total` layers may take under the framework's rules."""
    if plan.recompute is Recompute.NONE:
        return [0]
    if recomputes_all(plan, rules):
        return [total]
    if rules.recompute_counts == "every_nth":
        return sorted({total // k for k in range(1, total + 1)} - {0})
    return list(range(1, total + 1))


def _scan_single_rank(shape: RankShape, plan: Plan, total: int, cap: float, cutoff_s: float,
                      choices: list[int]) -> Split | None:
    """pp = 1: the whole objective is a function of n alone; try every n the framework allows
    (`choices`: _single_rank_counts; exact, no solver)."""
    best = None
    for n in choices:
        if shape.memory.at(total, n) > cap:
            continue
        t = shape.t.base + shape.t.per_layer * total + shape.t.per_recomputed * n
        dp = sum(mult * max(c0 + c1 * total - (w0 + w1 * total + w2 * n), bucket)
                 for mult, (c0, c1), (w0, w1, w2), bucket in shape.dp)
        value = plan.num_micro_batches * t + dp + shape.opt.intercept + shape.opt.slope * total
        if value <= cutoff_s and (best is None or value < best[0]):
            best = (value, n)
    return None if best is None else Split(layers=(total,), recomputed=(best[1],), optimal=True)


def solve_split(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan,
                time_limit_s: float = 10.0, ranks: list[RankShape] | None = None,
                cutoff_s: float = math.inf, fit: MemoryFit | None = None,
                rules: SplitRules = FREE, dense: DenseChoice | None = None) -> Split | None:
    """The best (layers, recomputed) per rank for `plan`'s outer choices, or None if no split
    fits with a step time of at most `cutoff_s` (the branch and bound's cutoff so far: the
    solver then only has to show nothing beats it). The objective leaves out the plan's
    constant terms (>= 0), so None never hides a plan that would beat the cutoff. `dense`: where
    the split may put the dense first layers (planner.dense_spreads.DenseChoice; `ranks` and
    `fit` priced so), by default all on the first stage."""
    dense = dense or DenseChoice((first_stage_spread(model),))
    if ranks is None:
        if len(dense.spreads) > 1:   # the joint model reads the shapes with no dense layer its caller prices
            raise ValueError("solve_split over several spreads needs the ranks' shapes (planner.search._dense_choice)")
        ranks = rank_shapes(model, train, cluster, plan, dense=dense.spreads[0].per_rank(plan.pp))
    total = model.num_layers
    fit = fit or MemoryFit([r.memory for r in ranks], plan, rank_caps_bytes(plan, cluster), total)
    if not fit.fits:
        return None
    if plan.pp == 1:
        return _scan_single_rank(ranks[0], plan, total, fit.caps[0], cutoff_s, _single_rank_counts(plan, rules, total))
    deadline = time.perf_counter() + time_limit_s
    cp_model = cp_sat()
    split = SplitModel(model, plan, ranks, fit, cutoff_s, rules, dense=dense)
    shared_count = _shared_block_count(plan, rules)
    budgeted = [attempt for attempt in ATTEMPTS if attempt[1] is not None]   # ATTEMPTS as it is now
    solver, status = split.solve(deadline, budgeted if shared_count else ATTEMPTS, WALL_PER_DETERMINISTIC_S)
    if shared_count and status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE):
        return _solve_per_block_count(model, plan, ranks, fit, cutoff_s, rules, deadline, dense)
    if status == cp_model.UNKNOWN:
        raise SolverTimeout(plan.short())
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    layers, recomputed = split.solution(solver)
    return Split(layers=layers, recomputed=recomputed, optimal=status == cp_model.OPTIMAL)


def _shared_block_count(plan: Plan, rules: SplitRules) -> bool:
    """Whether the split holds the block method's count shared by every rank as min(k, L_r)
    (one virtual stage per rank, some layers recomputed): CP-SAT propagates that min of two
    variables poorly, and deep pipelines can take it tens of seconds to prove."""
    return (rules.recompute_counts == "block" and plan.vpp == 1 and plan.recompute is not Recompute.NONE
            and not recomputes_all(plan, rules))


def _solve_per_block_count(model: ModelSpec, plan: Plan, ranks: list[RankShape], fit: MemoryFit, cutoff_s: float,
                           rules: SplitRules, deadline: float, dense: DenseChoice) -> Split | None:
    """The block method's split solved once per shared count k (each model then settles in a
    fraction of a second), over the counts some split fits (_block_counts), each solve held
    below the best so far; the best of them."""
    best: Split | None = None
    cp_model = cp_sat()
    ceiling, optimal = None, True
    for k in _block_counts(model, plan, fit, dense.spreads):
        if time.perf_counter() >= deadline:   # the counts left unsolved: not proven
            optimal = False
            break
        split = SplitModel(model, plan, ranks, fit, cutoff_s, rules, block_k=k, ceiling=ceiling, dense=dense)
        solver, status = split.solve(deadline, ATTEMPTS, WALL_PER_DETERMINISTIC_S)
        if status == cp_model.UNKNOWN:
            optimal = False
            continue
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            continue
        layers, recomputed = split.solution(solver)
        best = Split(layers=layers, recomputed=recomputed, optimal=True)
        ceiling = round(solver.ObjectiveValue()) - 1
        optimal &= status == cp_model.OPTIMAL
    if best is None and not optimal:
        raise SolverTimeout(plan.short())
    return None if best is None else replace(best, optimal=optimal)


def _block_counts(model: ModelSpec, plan: Plan, fit: MemoryFit, spreads: tuple[DenseSpread, ...]) -> list[int]:
    """The shared counts k worth solving (one virtual stage per rank): those under which every
    rank can hold enough layers for their sum to reach the model's (a rank of L layers keeps
    min(k, L) recomputed: its memory is affine on either side of L = k), from the least up to
    the first under which every rank holds fewer than k layers: not even k + 1 layers, all
    recomputed, fit any rank then, so every larger k is that split, every layer recomputed (at
    exactly k a rank might hold k + 1 with all of them recomputed under k + 1). The ranks that
    hold the dense first layers hold at least as many layers under one of the `spreads`. Memory
    is the fit's (where the dense layers may move, each rank's least over where they go)."""
    total = model.num_layers
    counts = []
    for k in range(1, total + 1):
        most = [_most_layers(memory, cap, k, total) for memory, cap in zip(fit.memory, fit.caps)]
        if (all(m >= 1 for m in most) and sum(most) >= total
                and any(all(m >= d for m, d in zip(most, s.per_stage)) for s in spreads)):
            counts.append(k)
        if max(most) < k:
            break
    return counts


def _most_layers(mem: AffineBytes, cap: float, k: int, total: int) -> int:
    """The most layers (at most `total`) a rank fits with min(k, L) of them recomputed; 0 if
    not even one. Memory in the CP-SAT model's whole bytes (split_model.integer_bytes)."""
    base, per_layer, per_rec, jump = integer_bytes(mem)
    def fits(layers: int) -> bool:
        return base + per_layer * layers + per_rec * min(k, layers) + jump <= int(cap)
    lo, hi = 0, total   # fits() is monotone in L: each layer, recomputed or not, keeps something
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def least_overflow_split(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
                         plan: Plan) -> tuple[Split, float] | None:
    """The split whose worst rank overflows its budget least, every layer of the plan's recompute
    mode recomputed: how close a choice that fits under no split comes, and the least share of its
    budget a rank then leaves free (negative: over; Estimate.min_headroom_fraction of the plan so
    split). Each rank's memory is affine and increasing in its layers
    (costmodel.memory.stage_memory_shapes), so adding the layers one at a time where they overflow
    least, within each rank's layer bounds, is the min-max split; of those, the best over where
    the split may put the dense first layers (planner.dense_spreads, as the search's). None where
    no spread's bounds admit a split (too many virtual stages for the dense layers' chunks)."""
    reserved = reserved_bytes(model, train, plan, cluster.device, cluster.framework, cluster.devices_per_node)
    caps, recompute = rank_caps_bytes(plan, cluster), plan.recompute is not Recompute.NONE
    best: tuple[float, tuple[int, ...]] | None = None
    for spread in dense_spreads(model, plan):
        memory = stage_memory_shapes(model, train, plan, reserved, cluster.framework, dense=spread.per_rank(plan.pp))
        bounds = spread.layer_bounds(plan.pp, plan.vpp, model.num_layers)
        layers = _least_overflow(lambda r, n: memory[r].at(n, n if recompute else 0) - caps[r], bounds,
                                 model.num_layers)
        if layers is not None:
            headroom = min((caps[r] - memory[r].at(n, n if recompute else 0)) / caps[r] for r, n in enumerate(layers))
            if best is None or headroom > best[0]:
                best = (headroom, layers)
    if best is None:
        return None
    headroom, layers = best
    split = Split(layers=layers, recomputed=layers if recompute else (0,) * plan.pp, optimal=True)
    return split, headroom


def _least_overflow(over, bounds: tuple[tuple[int, int], ...], total: int) -> tuple[int, ...] | None:
    """Per rank, layers within its (least, most) `bounds` summing to `total` that minimise the
    largest over(rank, layers) (increasing in the layers), or None if the bounds admit none."""
    layers = [lo for lo, _ in bounds]
    if sum(layers) > total or sum(hi for _, hi in bounds) < total:
        return None
    heap = [(over(r, n + 1), r) for r, n in enumerate(layers) if n < bounds[r][1]]
    heapq.heapify(heap)
    for _ in range(total - sum(layers)):
        _, r = heapq.heappop(heap)
        layers[r] += 1
        if layers[r] < bounds[r][1]:
            heapq.heappush(heap, (over(r, layers[r] + 1), r))
    return tuple(layers)


def short_chunks_first(plan: Plan) -> Plan:
    """The plan with every rank's virtual stages reordered shortest first (apply_split lays out
    all but the last rank so). The closed form prices a rank's activations as its in-flight
    chunks times its mean chunk; the first chunks are the ones most often in flight, so with the
    short ones first that bounds what the simulation finds, and a split the search found to fit
    fits so laid out. apply_split's short chunk last under the LM head is the faster layout,
    tried first (planner.repricing._simulated)."""
    per_stage = list(plan.layers_per_stage)
    for r in range(plan.pp):
        stages = plan.stages_of_rank(r)
        for j, count in zip(stages, sorted(per_stage[j] for j in stages)):
            per_stage[j] = count
    return replace(plan, layers_per_stage=tuple(per_stage))


def apply_split(plan: Plan, split: Split) -> Plan:
    """The concrete plan: rank r's layers spread evenly over its virtual stages (loop placement),
    the short chunks first (those whose micro-batches are in flight longest: short_chunks_first)
    but on the last rank last, under the LM head (costmodel.plan.embedding_loss_split is this
    layout)."""
    per_stage = [0] * plan.num_virtual_stages
    for r, layers in enumerate(split.layers):
        counts = sorted(even_layers(layers, plan.vpp), reverse=r == plan.pp - 1)
        for chunk, count in enumerate(counts):
            per_stage[chunk * plan.pp + r] = count
    return replace(plan, layers_per_stage=tuple(per_stage), recompute_num_layers=split.recomputed)
