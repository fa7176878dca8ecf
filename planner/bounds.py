"""Valid lower bounds on a candidate's step time, cheap enough to compute for every candidate.

They order the branch and bound in planner.search; planner.partition adds the memory-aware one.
Both read only what the candidate's rank time model (costmodel.timing) and degrees fix, so the
search computes them without building a plan per candidate.
"""
from __future__ import annotations

from functools import lru_cache

from costmodel.cluster import ClusterSpec
from costmodel.compute import optimizer_step_s
from costmodel.params import layer_params
from costmodel.pipeline import closed_form_s, fill_s
from costmodel.placement import AxisSpan
from costmodel.plan import Plan, Recompute, Schedule
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.timing import RankTimeModel, dp_bucket_s, dp_terms, rank_time_model, spans
from planner.space import degrees_plan


def lower_bound_s(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> float:
    """`time_floor_s` + `zero_floor_s` of a concrete plan."""
    sp = spans(plan, cluster)
    rtm = rank_time_model(model, train, plan, cluster, sp)
    return (time_floor_s(model, rtm, plan.pp, plan.num_micro_batches, plan.schedule, plan.vpp, plan.recompute)
            + zero_floor_s(model, train, cluster, plan.tp, plan.pp, plan.dp * plan.cp, plan.zero_stage,
                           plan.num_micro_batches, sp.dp))


def time_floor_s(model: ModelSpec, rtm: RankTimeModel, pp: int, num_micro_batches: int, schedule: Schedule,
                 vpp: int, recompute: Recompute) -> float:
    """A valid lower bound on the pipeline's time over every layer split and recompute count
    (`rtm` may be priced for any number of virtual stages: `vpp` is what counts).

    With per-rank micro-batch times t_r and T = max t_r >= sum(t)/pp, the pipeline takes
    m·T + (sum(t) - T)/v >= (m - 1/v)·sum(t)/pp + sum(t)/v (1F1B, GPipe: v = 1; interleaved: v),
    or m·T + sum(f) - max(f) >= (m - 1)·sum(t)/pp + sum(f) for ZB-H1 (f = t - 2W <= t <= T).
    sum(t) is fixed by the model up to recomputation, counted here at its minimum (one layer when
    the mode recomputes)."""
    rc = 0 if recompute is Recompute.NONE else 1
    per_layer, first, last = rtm.per_layer, rtm.first_edge, rtm.last_edge
    total = (model.num_layers * per_layer.total_s + rc * rtm.per_recomputed_layer.total_s
             + first.total_s + last.total_s + pp * rtm.pp_comm_with_s(vpp))
    traits = schedule.traits
    fill = (model.num_layers * fill_s(traits, per_layer) + rc * fill_s(traits, rtm.per_recomputed_layer)
            + fill_s(traits, first) + fill_s(traits, last) + pp * rtm.pp_comm_with_s(vpp))
    return closed_form_s(traits, num_micro_batches, total / pp, fill, total / pp, vpp)


def zero_floor_s(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, tp: int, pp: int, group: int,
                 zero: int, num_micro_batches: int, dp_span: AxisSpan) -> float:
    """What a ZeRO stage adds at the least: the DP buckets that never hide (over the dp x cp
    group of `group` ranks spanning `dp_span`), and the optimizer step on the average rank
    (affine in parameters, so the slowest rank is at least that)."""
    dp = _dp_floor_s(model, train, cluster, tp, pp, zero, num_micro_batches, dp_span)
    shards = group if zero >= 1 else 1
    layers_only = model.num_layers * layer_params(model, tp) / pp  # <= the average rank's
    return dp + optimizer_step_s(layers_only / shards, train, cluster.device)


@lru_cache(maxsize=16384)
def _dp_floor_s(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, tp: int, pp: int, zero: int,
                num_micro_batches: int, span: AxisSpan) -> float:
    if span.size == 1:
        return 0.0
    # pp decides only whether gradients stay whole between micro-batches (dp_terms)
    probe = degrees_plan(dp=span.size, tp=tp, pp=min(pp, 2), cp=1, zero_stage=zero,
                         num_micro_batches=num_micro_batches, num_layers=model.num_layers)
    return sum(t.multiplier * dp_bucket_s(model, probe, t, cluster, span)
               for t in dp_terms(model, train, probe, cluster))
