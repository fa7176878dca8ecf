"""Valid lower bounds on a candidate's step time, cheap enough to compute for every candidate.

They order the branch and bound in planner.search: first the ones that read only what a
candidate's rank time model (costmodel.rank_time) and degrees fix, without building a plan; then,
per outer choice, the memory-aware ones over the per-rank coefficients of planner.shapes
(whether any layer split fits, the least recomputation it needs, the exact min-max of the
slowest rank). Every lower bound of the search is here, once.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

from costmodel.deepseek import dense_layer_model
from costmodel.frameworks import FrameworkTraits
from costmodel.hardware import ClusterSpec
from costmodel.kernels import host_optimizer_step_s, optimizer_step_s, step_host_s
from costmodel.memory import AffineBytes, float8_weight_cache_bytes, state_bytes_for
from costmodel.params import layer_expert_params, layer_params
from costmodel.pipeline_closed_form import closed_form_s, fill_s
from costmodel.plan import Plan, Recompute
from costmodel.rank_time import RankTimeModel, Spans, dp_bucket_s, dp_terms, rank_time_model, spans
from costmodel.schedules import Schedule
from costmodel.specs import ModelSpec, TrainSpec
from planner.shapes import RankShape
from planner.space import degrees_plan


def lower_bound_s(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> float:
    """`time_floor_s` + `zero_floor_s` of a concrete plan."""
    sp = spans(plan, cluster)
    rtm = rank_time_model(model, train, plan, cluster, sp)
    return (time_floor_s(model, rtm, plan.pp, plan.num_micro_batches, plan.schedule, plan.vpp, plan.recompute)
            + zero_floor_s(model, train, cluster, plan.tp, plan.pp, plan.dp * plan.cp, plan.zero_stage,
                           plan.num_micro_batches, sp, plan.ep, plan.offload_optimizer, plan.etp))


def time_floor_s(model: ModelSpec, rtm: RankTimeModel, pp: int, num_micro_batches: int, schedule: Schedule,
                 vpp: int, recompute: Recompute, slowest_floor_s: float = 0.0) -> float:
    """A valid lower bound on the pipeline's time over every layer split and recompute count
    (`rtm` may be priced for any number of virtual stages and micro-batches: `vpp` and
    `num_micro_batches` are what count, the sends a step pays reading both).

    With per-rank micro-batch times t_r and T = max t_r >= sum(t)/pp, the pipeline takes
    m·T + (sum(t) - T)/v >= (m - 1/v)·sum(t)/pp + sum(t)/v (1F1B, GPipe: v = 1; interleaved: v),
    or m·T + sum(f) - max(f) >= (m - 1)·sum(t)/pp + sum(f) for ZB-H1 (f = t - 2W <= t <= T).
    sum(t) is fixed by the model up to recomputation, counted here at its minimum (one layer when
    the mode recomputes). `slowest_floor_s`: another lower bound on T (a mixed cluster's,
    `slowest_rank_floor_s`); the bound grows with T (m >= 1 >= 1/v), so the larger one holds."""
    rc = 0 if recompute is Recompute.NONE else 1
    per_layer, first, last, dense = rtm.per_layer, rtm.first_edge, rtm.last_edge, rtm.first_k_dense
    total = (model.num_layers * per_layer.total_s + rc * rtm.per_recomputed_layer.total_s
             + first.total_s + last.total_s + dense * rtm.dense_layer.total_s
             + pp * rtm.pp_comm_with_s(vpp, num_micro_batches))
    traits = schedule.traits
    fill = (model.num_layers * fill_s(traits, per_layer) + rc * fill_s(traits, rtm.per_recomputed_layer)
            + fill_s(traits, first) + fill_s(traits, last) + dense * fill_s(traits, rtm.dense_layer)
            + pp * rtm.pp_comm_with_s(vpp, num_micro_batches))
    slowest = max(total / pp, slowest_floor_s)
    return closed_form_s(traits, num_micro_batches, slowest, fill, slowest, vpp)


def slowest_rank_floor_s(model: ModelSpec, per_layer_s: Sequence[float]) -> float:
    """A lower bound on the slowest rank's time per micro-batch when rank r takes per_layer_s[r]
    per layer (a mixed cluster's groups): n_r·c_r <= T for every rank and sum(n_r) = L give
    T >= L / sum(1/c_r) (every other cost of a rank only adds to it)."""
    return model.num_layers / sum(1.0 / c for c in per_layer_s)


def zero_floor_s(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, tp: int, pp: int, group: int,
                 zero: int, num_micro_batches: int, sp: Spans, ep: int = 1, offload: bool = False,
                 etp: int = 1) -> float:
    """What a ZeRO stage adds at the least: the DP buckets that never hide (over the dp x cp
    group of `group` ranks, and the experts' edp x cp group, as `sp` places them), and the
    optimizer step on the average rank (affine in parameters, so the slowest rank is at least
    that): a ZeRO shard holds every expert's 1/group share, a replica its ep-th of them."""
    dp = _dp_floor_s(model, train, cluster, tp, pp, zero, num_micro_batches, sp, ep, offload, etp)
    return _after_pipeline_floor_s(model, train, cluster, tp, pp, group, zero, ep, offload, dp, etp)


def optimizer_floor_s(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, tp: int, pp: int, group: int,
                      zero: int, ep: int = 1, offload: bool = False, etp: int = 1) -> float:
    """`zero_floor_s` less its DP buckets (>= 0), which alone depend on placement and on the
    micro-batches: a bound for every placement of the degrees."""
    return _after_pipeline_floor_s(model, train, cluster, tp, pp, group, zero, ep, offload, 0.0, etp)


def _after_pipeline_floor_s(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, tp: int, pp: int, group: int,
                            zero: int, ep: int, offload: bool, dp_s: float, etp: int = 1) -> float:
    if zero >= 1:
        # a framework that folds EP (costmodel.params.folds_ep) shards a rank's experts over the
        # tp x cp x dp / ep ranks holding them, tp times the carved edp x cp: divided by tp whenever
        # it might, the floor stays below
        experts = layer_expert_params(model)
        folded = cluster.framework.ep_folds_over_tp and tp > 1 and ep * etp > 1
        shared_tp = cluster.framework.shared_expert_tp
        per_layer = (layer_params(model, tp, shared_expert_tp=shared_tp) - experts) / group \
            + experts / (group * (tp if folded else 1))
    else:
        per_layer = layer_params(model, tp, ep, etp, cluster.framework.shared_expert_tp)
    fixed = dp_s + step_host_s(train, cluster.device)   # after the pipeline, as costmodel.rank_time.after_pipeline_s
    if offload:   # offloaded states step on the host (costmodel.rank_time.after_pipeline_s)
        return fixed + host_optimizer_step_s(model.num_layers * per_layer / pp, train, cluster)
    return fixed + optimizer_step_s(model.num_layers * per_layer / pp, train, cluster.device)


@functools.lru_cache(maxsize=16384)
def _dp_floor_s(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, tp: int, pp: int, zero: int,
                num_micro_batches: int, sp: Spans, ep: int, offload: bool, etp: int = 1) -> float:
    if sp.dp.size == 1 and not offload:
        return 0.0
    # pp decides only whether gradients stay whole between micro-batches (dp_terms)
    probe = degrees_plan(dp=sp.dp.size, tp=tp, pp=min(pp, 2), cp=1, zero_stage=zero,
                         num_micro_batches=num_micro_batches, num_layers=model.num_layers, ep=ep,
                         offload_optimizer=offload, etp=etp)
    return sum(t.multiplier * dp_bucket_s(model, probe, t, cluster, sp)
               for t in dp_terms(model, train, probe, cluster))


def max_layers_that_fit(mem: AffineBytes, cap: float, can_recompute: bool, total: int) -> int:
    """Most layers a rank can hold within `cap`: memory is affine in layers at n = 0 and at n = L
    (every layer recomputed), and recomputing more never needs more memory."""
    base, per_layer, per_rc, jump = mem.base, mem.per_layer, mem.per_recomputed, mem.jump
    options = [(base, per_layer)] + ([(base + jump, per_layer + per_rc)] if can_recompute else [])
    best = -1
    for intercept, slope in options:
        if slope <= 0:
            best = max(best, total if intercept <= cap else -1)
        elif intercept <= cap:
            best = max(best, min(total, int((cap - intercept) // slope)))
    return best


def split_exists(memory: list[AffineBytes], plan: Plan, caps: Sequence[float], total: int,
                 layer_bounds: Sequence[tuple[int, int]] | None = None) -> bool:
    """Exact: some split of `total` layers (at least vpp per rank, within `layer_bounds` per
    rank where given) fits every rank (`memory`: costmodel.memory.stage_memory_shapes; `caps`:
    each rank's budget)."""
    can_recompute, seen = plan.recompute is not Recompute.NONE, {}
    most = []
    for m, cap in zip(memory, caps):   # ranks alike share one answer (by identity: they are alive here)
        key = (id(m), cap)
        if key not in seen:
            seen[key] = max_layers_that_fit(m, cap, can_recompute, total)
        most.append(seen[key])
    if layer_bounds is None:
        return min(most) >= plan.vpp and sum(most) >= total
    return (all(n >= lo for n, (lo, _) in zip(most, layer_bounds)) and sum(lo for lo, _ in layer_bounds) <= total
            and sum(min(n, hi) for n, (_, hi) in zip(most, layer_bounds)) >= total)


def states_floor(model: ModelSpec, train: TrainSpec, plan: Plan, reserved_bytes: float,
                 traits: FrameworkTraits, dense_layers: int | None = None) -> AffineBytes:
    """Below every pipeline rank's memory shape (costmodel.memory.stage_memory_shapes) at every
    layer and recompute count, without pricing activations: the reserve and the training states
    of the rank's layers, at the same bytes per parameter the shapes take. What it leaves out
    never subtracts: the embedding / head states, the buffers, and activations (a recomputed
    layer keeps its checkpoint, >= 0). So when `split_exists` finds no split under this floor,
    none fits the plan (the search skips pricing its activations). A mixture's dense first
    layers may weigh less a device than its expert layers (all of a dense MLP against a share of
    the experts): the base gives back what each of the rank's may weigh less (`dense_layers`:
    the most a split gives it, planner.dense_spreads.reachable; by default all of them)."""
    experts = layer_expert_params(model, plan.ep, plan.etp)
    per_param = sum(state_bytes_for(train, plan, 1.0, traits))
    per_expert = sum(state_bytes_for(train, plan, 1.0, traits, experts=1.0))
    cache = float8_weight_cache_bytes(plan, traits)
    layer = layer_params(model, plan.tp, plan.ep, plan.etp, traits.shared_expert_tp)
    per_layer = per_param * (layer - experts) + per_expert * experts + cache * layer
    base = reserved_bytes
    dense_layers = model.first_k_dense if dense_layers is None else dense_layers
    if dense_layers:
        dense = (per_param + cache) * layer_params(dense_layer_model(model), plan.tp)
        base -= dense_layers * max(0.0, per_layer - dense)
    return AffineBytes(base=base, per_layer=per_layer, per_recomputed=0.0, jump=0.0)


def _columns(memory: list[AffineBytes], caps: Sequence[float]) -> np.ndarray:
    """[rank, 5]: each rank's base, per layer, per recomputed layer, jump and budget."""
    return np.array([(m.base, m.per_layer, m.per_recomputed, m.jump, cap) for m, cap in zip(memory, caps)])


def min_total_recompute(memory: list[AffineBytes], plan: Plan, caps: Sequence[float], total: int,
                        columns: np.ndarray | None = None) -> float:
    """Lower bound on sum(n_r) over all splits (continuous relaxation). A rank's need for
    recomputed layers is convex in its layer count (zero until memory binds, then linear), so the
    cheapest way to place the layers beyond vpp per rank takes the smallest per-layer increments
    over all ranks: sum of needs at vpp layers + the (total - vpp·pp) smallest increments.
    `columns`: `_columns(memory, caps)`, where the caller has them."""
    extra = total - plan.vpp * plan.pp
    if extra < 0:
        return math.inf
    c = _columns(memory, caps) if columns is None else columns
    base, per_layer, per_rc, jump, cap = (c[:, i:i + 1] for i in range(5))
    over = base + per_layer * np.arange(plan.vpp, total + 1)[None, :] - cap
    # a rank that must recompute needs (over + jump) / -per_rc layers of it; none can help where
    # recomputing frees nothing (per_rc >= 0)
    frees = per_rc < 0
    need = np.where(over <= 0, 0.0, np.where(frees, (over + jump) / np.where(frees, -per_rc, 1.0), np.inf))
    start = float(need[:, 0].sum())
    if extra == 0 or math.isinf(start):
        return start
    # each rank's increments; inf where a rank can never hold that many (-inf where it could
    # hold more but not fewer, which no memory shape does)
    finite = np.isfinite(need)
    held = np.where(finite, need, 0.0)
    steps = np.where(finite[:, 1:], np.where(finite[:, :-1], held[:, 1:] - held[:, :-1], -np.inf), np.inf).ravel()
    return start + float(np.partition(steps, extra - 1)[:extra].sum())


def least_recomputed(memory: list[AffineBytes], caps: Sequence[float], recompute: bool, total: int,
                     columns: np.ndarray | None = None) -> np.ndarray:
    """[rank, L] for L = 0..total layers on the rank: the fewest recomputed layers that make them
    fit (-1 where none does). Memory falls by per_rc per recomputed layer after a one-off jump.
    `columns`: `_columns(memory, caps)`, where the caller has them."""
    c = _columns(memory, caps) if columns is None else columns
    base, per_layer, per_rc, jump, cap = (c[:, i:i + 1] for i in range(5))
    layers = np.arange(total + 1)[None, :]
    over = base + per_layer * layers - cap
    need = np.where(over <= 0, 0, -1)
    if recompute:
        frees = per_rc < 0
        # 1e-9: the CP-SAT model and estimate() round differently at the very edge
        n = np.maximum(1, np.ceil((over + jump) / np.where(frees, -per_rc, 1.0) - 1e-9))
        need = np.where((over > 0) & frees & (n <= layers), n, need)
    return need


class MemoryFit:
    """What memory alone says about an outer choice; rank placement (the mesh order) does not
    change it, so the search computes it once for all placements. `caps`: one budget for every
    rank, or one per rank (a mixed cluster's groups, costmodel.groups.rank_caps_bytes). The
    recompute figures are worked out when first asked for (many choices that fit are never
    examined further). `layer_bounds`: per rank, the least and most layers a split may give it
    (planner.dense_spreads: where the dense first layers lie), by default vpp and all of them."""

    def __init__(self, memory: list[AffineBytes], plan: Plan, caps: float | Sequence[float], total: int,
                 layer_bounds: Sequence[tuple[int, int]] | None = None) -> None:
        self.memory = memory  # costmodel.memory.stage_memory_shapes
        self.caps = [float(caps)] * len(memory) if isinstance(caps, (int, float)) else [float(c) for c in caps]
        self.layer_bounds = layer_bounds
        # some split fits these shapes (exact; a relaxation where they are each rank's least over
        # where the dense first layers may go: planner.dense_spreads)
        self.fits = split_exists(memory, plan, self.caps, total, layer_bounds)
        self._plan, self._total = plan, total

    @functools.cached_property
    def columns(self) -> np.ndarray:
        """`_columns` of its memory and caps, which both recompute bounds read."""
        return _columns(self.memory, self.caps)

    @functools.cached_property
    def least_recomputed(self) -> np.ndarray:
        """[rank, L]: see `least_recomputed` (meaningful when it fits)."""
        return least_recomputed(self.memory, self.caps, self._plan.recompute is not Recompute.NONE, self._total,
                                self.columns)

    @functools.cached_property
    def min_recomputed(self) -> float:
        """No split that fits recomputes fewer layers in all."""
        if not self.fits:
            return math.inf
        if self._plan.recompute is Recompute.NONE:   # a split fits (exact), each rank recomputing none
            return 0.0
        floor = 1.0
        return max(min_total_recompute(self.memory, self._plan, self.caps, self._total, self.columns), floor)


def min_max_time_s(ts: list[tuple], plan: Plan, fit: MemoryFit, total: int) -> float:
    """The least possible max_r t_r over every split that fits (exact over integer layer and
    recompute counts, up to the relaxation that a rank may take any layer count whose time fits):
    a rank's fastest way to hold L layers recomputes as few as fit, so for a candidate T each rank
    holds at most max{L : t_min(L) <= T} layers (within the fit's layer bounds), and T is feasible
    when those sum to `total`. `ts`: per rank, (t0, t1, t2) of RankShape.t (a mixed cluster's
    groups differ in all three)."""
    need = fit.least_recomputed
    c = np.array(ts)
    t = c[:, 0:1] + c[:, 1:2] * np.arange(total + 1)[None, :] + c[:, 2:3] * need
    t = np.where(need >= 0, t, np.inf)
    bounds = fit.layer_bounds or [(plan.vpp, total)] * plan.pp   # every virtual stage holds a layer
    for r, (lo, hi) in enumerate(bounds):
        t[r, :lo] = np.inf
        t[r, hi + 1:] = np.inf
    # t[r, L]: fastest way for rank r to hold at least L layers, nondecreasing in L. Within T,
    # rank r holds #{L >= 1 : t[r, L] <= T} layers; those sum to `total` from the total-th
    # smallest t[r, L >= 1] on, and every rank holds its least layers from max_r t[r, least] on.
    t = np.minimum.accumulate(t[:, ::-1], axis=1)[:, ::-1]
    slots = t[:, 1:].ravel()
    enough = np.partition(slots, total - 1)[total - 1]
    return float(max(enough, max(t[r, lo] for r, (lo, _) in enumerate(bounds))))


def pipeline_floor_s(ts: list[tuple], fs: list[tuple], plan: Plan, fit: MemoryFit, total: int,
                     enough_s: float = math.inf) -> float:
    """Lower bound on the pipeline part of the step time (see planner.bounds.time_floor_s) with
    the recomputation needed to fit, and the slowest rank at least as slow as the best
    memory-feasible min-max split allows. `ts`, `fs`: `pipeline_rows`. Placement-aware but
    cheaper than the rank shapes: the search tries it first. `enough_s`: a bound the caller
    prunes at; once the average rank's time alone reaches it, that (smaller) bound is returned
    without the min-max split (which only raises T, and the closed form grows with T)."""
    rc = fit.min_recomputed
    if not fit.fits or math.isinf(rc) or (rc > 0 and plan.recompute is Recompute.NONE):
        return math.inf
    # the least per-layer costs over ranks (equal but on a mixed cluster) keep the sums below the truth
    sum_t = sum(t.base for t in ts) + min(t.per_layer for t in ts) * total + min(t.per_recomputed for t in ts) * rc
    # the closed form with max(f) <= T (f = t for 1F1B, t - 2W for ZB-H1)
    sum_f = sum(f.base for f in fs) + min(f.per_layer for f in fs) * total + min(f.per_recomputed for f in fs) * rc
    traits = plan.schedule.traits
    average = closed_form_s(traits, plan.num_micro_batches, sum_t / plan.pp, sum_f, sum_t / plan.pp, plan.vpp)
    if average >= enough_s:
        return average
    slowest = max(min_max_time_s(ts, plan, fit, total), sum_t / plan.pp)
    return closed_form_s(traits, plan.num_micro_batches, slowest, sum_f, slowest, plan.vpp)


def lower_bound_with_memory_s(shapes: list[RankShape], plan: Plan, fit: MemoryFit, total: int) -> float:
    """Step-time lower bound for this outer choice: `pipeline_floor_s`, the DP buckets that can
    never hide, and the optimizer on the average rank."""
    pipe = pipeline_floor_s([sh.t for sh in shapes], [sh.f for sh in shapes], plan, fit, total)
    if math.isinf(pipe):
        return pipe
    opt = (sum(sh.opt.intercept for sh in shapes) + min(sh.opt.slope for sh in shapes) * total) / plan.pp
    return pipe + _dp_floor_of_shapes_s(shapes, plan, total) + opt


def _dp_floor_of_shapes_s(shapes: list[RankShape], plan: Plan, total: int) -> float:
    """Exposed DP time of the slowest rank >= the rank average >= (by convexity of max) the same
    max at the average layer count; the window is taken with every layer recomputed (its widest),
    so this never exceeds the true value. Ranks whose terms differ in more than their intercepts
    (a mixed cluster's groups): the slowest rank's exposure is at least any rank's buckets."""
    pp = len(shapes)
    if any([(t.multiplier, t.comm.slope, t.window[1:], t.bucket) for t in sh.dp]
           != [(t.multiplier, t.comm.slope, t.window[1:], t.bucket) for t in shapes[0].dp] for sh in shapes):
        return max(sum(t.multiplier * t.bucket for t in sh.dp) for sh in shapes)
    layers = total / pp
    recomputed = layers if plan.recompute is not Recompute.NONE else 0.0
    out = 0.0
    for k, (mult, (_, c1), (_, w1, w2), bucket) in enumerate(shapes[0].dp):
        intercept = sum(sh.dp[k].comm.intercept - sh.dp[k].window.base for sh in shapes) / pp
        out += mult * max(intercept + (c1 - w1) * layers - w2 * recomputed, bucket)
    return out
