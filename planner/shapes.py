"""What the split solver and its bounds read from the cost model, per pipeline rank: affine
coefficients in the rank's layer count L and recomputed-layer count n (micro-batch time, the
schedule's fill, optimizer, memory, each data-parallel term), evaluated with costmodel's own
functions (tests/planner/test_partition.py checks the affinity at many points)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from costmodel.groups import rank_views
from costmodel.hardware import ClusterSpec
from costmodel.memory import AffineBytes, reserved_bytes, stage_memory_shapes
from costmodel.params import dense_layers_first_rank, rank_params_at
from costmodel.pipeline_closed_form import fill_s
from costmodel.plan import Plan
from costmodel.rank_time import (
    RankTimeModel,
    RankTimes,
    after_pipeline_s,
    dp_bucket_s,
    dp_groups,
    dp_term_comm_s,
    dp_terms,
    dp_window_s,
    grad_accumulation_s,
    one_replica_fsdp_s,
    rank_time_model,
    spans,
)
from costmodel.specs import ModelSpec, TrainSpec


def affine(f, x0: int, x1: int) -> tuple[float, float]:
    """(intercept, slope) of f from two points (the affinity itself is checked in the tests)."""
    y0, y1 = f(x0), f(x1)
    slope = (y1 - y0) / (x1 - x0)
    return y0 - slope * x0, slope


class Coefficients(NamedTuple):
    """A quantity affine in a rank's layers L and recomputed layers n: base + per_layer·L +
    per_recomputed·n."""
    base: float
    per_layer: float
    per_recomputed: float


class Linear(NamedTuple):
    """A quantity affine in the layers L only: intercept + slope·L."""
    intercept: float
    slope: float


class DpTermShape(NamedTuple):
    """One data-parallel term of a rank: multiplier · max(comm - window, bucket)."""
    multiplier: float
    comm: Linear              # the collective's time in the rank's parameters
    window: Coefficients      # the compute it can hide behind
    bucket: float             # one layer's bucket: never hidden


@dataclass(frozen=True, slots=True)
class RankShape:
    """Everything the solver needs about one pipeline rank, read from costmodel. Each quantity
    is affine in (L, n) for a fixed outer choice (tests/planner/test_partition.py checks it
    against the cost model at many points): coefficients (per rank, per layer, per recomputed
    layer) of the micro-batch time t and the schedule's fill f (costmodel.pipeline_closed_form.
    fill_s), (intercept, slope in L) of the optimizer step, per DP term (multiplier, comm, window,
    bucket), and memory as costmodel states it (AffineBytes: base, per layer, per recomputed
    layer, jump once n > 0)."""

    t: Coefficients
    f: Coefficients
    opt: Linear
    dp: list[DpTermShape]
    memory: AffineBytes


def _pipeline_rows(rtm: RankTimeModel, plan: Plan, edge: RankTimes) -> tuple[tuple, tuple]:
    """(t, f) coefficients of a rank whose fixed part (edges, sends) is `edge`."""
    parts = (edge, rtm.per_layer, rtm.per_recomputed_layer)
    return (Coefficients(*(p.total_s for p in parts)),
            Coefficients(*(fill_s(plan.schedule.traits, p) for p in parts)))


def pipeline_rows(rtm: RankTimeModel, plan: Plan,
                  dense: Sequence[int] | None = None) -> tuple[list[tuple], list[tuple]]:
    """Per pipeline rank, the t and f coefficients of RankShape (what the pipeline bound needs),
    without the optimizer and DP parts; `dense`: per rank, the dense first layers it holds (by
    default all on the first rank)."""
    rtm = rtm.with_schedule(plan.vpp, plan.num_micro_batches)   # the sends waited for at its micro-batches
    first, last = plan.stage_rank(0), plan.stage_rank(plan.num_virtual_stages - 1)
    dense = dense or dense_layers_first_rank(rtm.first_k_dense, plan)
    rows: dict[tuple, tuple] = {}
    per_rank = []
    for r in range(plan.pp):
        own = rtm.for_rank(r)   # its own sends (costmodel.rank_time.RankTimeModel.sends_s)
        kind = (r == first, r == last, own.pp_comm_s, dense[r])
        if kind not in rows:
            rows[kind] = _pipeline_rows(own, plan, own.at(0, 0, r == first, r == last, dense[r]))
        per_rank.append(rows[kind])
    return [t for t, _ in per_rank], [f for _, f in per_rank]


def _time_shape(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan, rtm: RankTimeModel,
                first: bool, last: bool, dp_shape: list, dense: int) -> tuple:
    """(t, f, opt, dp) of a rank holding `dense` dense first layers: the same on every rank in the
    middle of the pipeline that holds none."""
    edge_times = rtm.at(0, 0, first, last, dense)
    t, f = _pipeline_rows(rtm, plan, edge_times)
    # read at layer counts a rank holding `dense` dense layers can have (fewer would leave it
    # negative expert parameters, where the optimizer's per-step floor bends the line)
    lo = max(1, dense)
    held = {L: rank_params_at(model, plan, L, first, last, cluster.framework, dense) for L in (0, 1, lo, lo + 1)}
    sp = spans(plan, cluster)
    # what a rank does after the pipeline: a TP-replicated mixture's gradient sync, then the
    # optimizer and the step's host work; and its gradient accumulation and a one-replica plan's
    # FSDP reduce and gathers, priced beside them
    opt = Linear(*affine(lambda L: sum(after_pipeline_s(model, train, plan, cluster, sp, held[L], L))
                         + grad_accumulation_s(model, train, plan, cluster, held[L], L)
                         + one_replica_fsdp_s(model, train, plan, cluster, held[L], L), lo, lo + 1))
    # DP collectives per gradient group: comm = alpha + beta·P in the group's parameters P,
    # each affine in L (P = edge + L·per layer), so their sum is too
    overlap = cluster.device.efficiency.overlap
    edge, one = held[0], held[1]
    traits = cluster.framework
    groups = [(n0, n1 - n0) for (n0, _, _), (n1, _, _) in zip(dp_groups(model, plan, sp, edge, traits),
                                                              dp_groups(model, plan, sp, one, traits))]
    dp = []
    for mult, term, coeffs, bucket in dp_shape:
        intercept = sum(alpha + beta * n0 for (alpha, beta), (n0, _) in zip(coeffs, groups))
        slope = sum(beta * per_layer for (_, beta), (_, per_layer) in zip(coeffs, groups))
        dp.append(DpTermShape(mult, Linear(intercept, slope),
                              Coefficients(dp_window_s(term, edge_times, overlap),
                                           dp_window_s(term, rtm.per_layer, overlap),
                                           dp_window_s(term, rtm.per_recomputed_layer, overlap)), bucket))
    return t, f, opt, dp


def _dp_shape(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> list:
    """Per DP term: (multiplier, term, [(alpha, beta) per gradient group], bucket) with a group's
    comm(P params) = alpha + beta·P."""
    sp = spans(plan, cluster)
    if sp.dp.size == 1 and not plan.offload_optimizer:   # offloaded states copy even alone
        return []
    groups = dp_groups(model, plan, sp, rank_params_at(model, plan, 1, False, False, cluster.framework),
                       cluster.framework)
    out = []
    for term in dp_terms(model, train, plan, cluster):
        coeffs = []
        for _, unit, span in groups:
            alpha, beta = affine(lambda k: dp_term_comm_s(term, k * unit, cluster, span, unit), 1, 2)  # noqa: B023
            coeffs.append((alpha, beta / unit))
        out.append((term.multiplier, term, coeffs, dp_bucket_s(model, plan, term, cluster, sp, groups)))
    return out


def _reserved(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec) -> float:
    return reserved_bytes(model, train, plan, cluster.device, cluster.framework, cluster.devices_per_node)


def rank_shapes(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan,
                memory: list[AffineBytes] | None = None, rtm: RankTimeModel | None = None,
                dense: Sequence[int] | None = None) -> list[RankShape]:
    """`memory` (the plan's `stage_memory_shapes`) and `rtm` (its rank time model): when the
    caller already has them; `dense`: per rank, how many of DeepSeek's dense first layers it
    holds (by default all on the first rank). On a mixed cluster each rank's shape is its group's
    (`rtm` is then not taken: the groups' differ), and memory is priced with the first group's
    reserve, as costmodel.groups.rank_caps_bytes budgets it."""
    dense = dense or dense_layers_first_rank(model.first_k_dense, plan)
    if cluster.is_mixed:
        memory = memory or stage_memory_shapes(model, train, plan, _reserved(model, train, plan, cluster),
                                               cluster.framework, dense)
        views = rank_views(plan, cluster)
        by_view = {view: rank_shapes(model, train, view, plan, memory, dense=dense) for view in set(views)}
        return [by_view[view][r] for r, view in enumerate(views)]
    rtm = (rtm or rank_time_model(model, train, plan, cluster, spans(plan, cluster))).with_schedule(
        plan.vpp, plan.num_micro_batches)
    dp_shape = _dp_shape(model, train, cluster, plan)
    memory = memory or stage_memory_shapes(model, train, plan, _reserved(model, train, plan, cluster),
                                          cluster.framework, dense)
    first, last = plan.stage_rank(0), plan.stage_rank(plan.num_virtual_stages - 1)
    times: dict[tuple[bool, bool, float, int], tuple] = {}
    out = []
    for r, mem in enumerate(memory):
        own = rtm.for_rank(r)   # its own sends (costmodel.rank_time.RankTimeModel.sends_s)
        key = (r == first, r == last, own.pp_comm_s, dense[r])
        if key not in times:
            times[key] = _time_shape(model, train, cluster, plan, own, r == first, r == last, dp_shape, dense[r])
        t, f, opt, dp = times[key]
        out.append(RankShape(t, f, opt, dp, mem))
    return out
