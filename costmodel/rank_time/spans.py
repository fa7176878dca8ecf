"""Which ranks each parallel axis groups, the network tiers those groups cross, and what a byte
costs on each."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from costmodel.comm import (
    HOST_COPIES,
    Collective,
    all_reduce_algorithms_s,
    collective_time_s,
    gather_algorithms_s,
    p2p_time_s,
    ring_time_s,
)
from costmodel.hardware import ClusterSpec
from costmodel.params import folds_ep
from costmodel.placement import AxisSpan, axis_nodes, expert_layout, group_span, hybrid_layout, stage_pair_span
from costmodel.plan import Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class Spans:
    tp: AxisSpan
    cp: AxisSpan
    pp: AxisSpan
    dp: AxisSpan  # the gradient group: dp x cp (context-parallel ranks share weights)
    ep: AxisSpan  # the token all-to-all group (placement.expert_layout)
    etp: AxisSpan  # the ranks splitting each expert (expert TP), which gather the routed rows
    edp: AxisSpan  # the experts' gradient group: the ranks holding the same experts
    # hybrid sharding (Plan.dp_replicate): the ZeRO shard group (dp / dp_replicate inner
    # data-parallel ranks x cp) and the replicas of a shard (the outer dp_replicate ranks);
    # without it the shard group is dp and the replicas one rank
    shard: AxisSpan
    replicas: AxisSpan


def split_dp_axis(order: tuple[str, ...], degrees: tuple[int, ...], ep: int) -> tuple[tuple, tuple]:
    """The mesh with its dp axis split into edp (outer) and ep (inner): EP groups are consecutive
    data-parallel ranks, as runtime.mesh.build_mesh lays them out."""
    layout = expert_layout(order, degrees, ep, False)
    return layout.order, layout.degrees


def spans(plan: Plan, cluster: ClusterSpec) -> Spans:
    return _spans(plan.mesh_axis_order, tuple(plan.degree(a) for a in plan.mesh_axis_order), plan.ep,
                  cluster.devices_per_node, folds_ep(plan, cluster.framework), plan.etp, plan.dp_replicate)


_ONE = AxisSpan(size=1, members_per_node=1, num_nodes=1)


@lru_cache(maxsize=16384)
def _spans(mesh_order: tuple[str, ...], mesh_degrees: tuple[int, ...], ep: int, dpn: int,
           fold: bool = False, etp: int = 1, dp_replicate: int = 1) -> Spans:
    """Cached per layout (the search asks for the same few thousand many times; each group_span
    walks its group's ranks, thousands of them at 16k devices). The expert groups as
    placement.expert_layout lays them out: carved from dp, or folded over TP, CP and DP
    (params.folds_ep)."""
    dp = group_span(mesh_order, mesh_degrees, ("dp", "cp"), dpn)
    tp, cp, pp = (group_span(mesh_order, mesh_degrees, (a,), dpn) for a in ("tp", "cp", "pp"))
    if pp.crosses_nodes:   # which neighbours share a node (layer_comm.pp_rank_sends_s)
        pp = replace(pp, nodes=axis_nodes(mesh_order, mesh_degrees, "pp", dpn))
    shard, replicas = _hybrid_spans(mesh_order, mesh_degrees, dp_replicate, dpn) if dp_replicate > 1 else (dp, _ONE)
    if ep * etp == 1:   # the experts' group is the gradient group and EP is one rank
        return Spans(tp=tp, cp=cp, pp=pp, dp=dp, ep=_ONE, etp=_ONE, edp=dp, shard=shard, replicas=replicas)
    layout = expert_layout(mesh_order, mesh_degrees, ep, fold, etp)
    return Spans(tp=tp, cp=cp, pp=pp, dp=dp, ep=group_span(layout.order, layout.degrees, layout.ep_axes, dpn),
                 etp=group_span(layout.order, layout.degrees, layout.etp_axes, dpn) if etp > 1 else _ONE,
                 edp=group_span(layout.order, layout.degrees, layout.edp_axes, dpn), shard=shard, replicas=replicas)


def _hybrid_spans(order: tuple[str, ...], degrees: tuple[int, ...], dp_replicate: int,
                  dpn: int) -> tuple[AxisSpan, AxisSpan]:
    """The shard group and the replicas of hybrid sharding (placement.hybrid_layout)."""
    split_order, split = hybrid_layout(order, degrees, dp_replicate)
    return group_span(split_order, split, ("dp.in", "cp"), dpn), group_span(split_order, split, ("dp.out",), dpn)


def link_costs(sp: Spans, cluster: ClusterSpec) -> tuple[float, ...]:
    """Every link time the cost model derives from a placement, each as its (latency, seconds
    per byte) pair: each collective over each axis's group, a point-to-point send on the pipeline
    and the context-parallel axis, and the tied-embedding all-reduce between the first and last
    stage. Every time the cost model prices is nondecreasing in each of these, so a placement
    whose every entry is at least another's is never faster (the search drops it). Keep this in
    step with the functions below that take a span."""
    out: list[float] = []
    for span in (sp.tp, sp.cp, sp.pp, sp.dp, sp.ep, sp.etp, sp.edp, sp.shard, sp.replicas):
        out.extend(_group_link_costs(span, cluster))
    for tier in (cluster.pipeline_tier(sp.pp.num_nodes), cluster.device.tier_for(sp.cp.num_nodes)):
        out.extend(_affine(lambda b: p2p_time_s(b, tier)))  # noqa: B023
    out.extend(_affine(lambda b: stage_pair_all_reduce_s(b, sp, cluster)))
    return tuple(out)


def _affine(time_of) -> tuple[float, float]:
    """(latency, seconds per byte): every link time here is affine in the bytes moved."""
    one, two = time_of(1.0), time_of(2.0)
    return 2 * one - two, two - one


@lru_cache(maxsize=16384)
def _group_link_costs(span: AxisSpan, cluster: ClusterSpec) -> tuple[float, ...]:
    """link_costs' entries of one axis's group: each collective over it (the search compares
    thousands of placements, which share a few hundred groups)."""
    out: list[float] = []
    # host copies depend on a group's size, not on where its ranks sit: the same for every
    # placement of the same degrees
    gathers = (Collective.ALL_GATHER, Collective.REDUCE_SCATTER)
    for kind in (k for k in Collective if k not in HOST_COPIES and k is not Collective.ALL_REDUCE and k not in gathers):
        out.extend(_affine(lambda b: collective_time_s(kind, b, span, cluster)))  # noqa: B023
    for algorithm in range(2):   # an all-reduce is the faster of ring and tree: both compared
        out.extend(_affine(lambda b: all_reduce_algorithms_s(b, span, cluster)[algorithm]))  # noqa: B023
    for kind in gathers:   # across nodes, the faster of ring and PAT: both compared
        for algorithm in range(2):
            out.extend(_affine(lambda b: gather_algorithms_s(kind, b, span, cluster)[algorithm]))  # noqa: B023
    return tuple(out)


def stage_pair_all_reduce_s(num_bytes: float, sp: Spans, cluster: ClusterSpec) -> float:
    """An all-reduce between the first and the last pipeline stage's ranks (tied embeddings);
    on a mixed cluster's group view, over the link between the groups."""
    if cluster.pipeline_link is not None:
        return ring_time_s(Collective.ALL_REDUCE, num_bytes, 2, cluster.pipeline_tier(2))
    return collective_time_s(Collective.ALL_REDUCE, num_bytes, stage_pair_span(sp.pp), cluster)
