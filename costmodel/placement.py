"""Rank placement: which network tier each mesh axis spans. One pure function, shared by the
cost model (to price collectives) and the runtime (to build the DeviceMesh in the same order).

Ranks are laid out row-major over `mesh_axis_order` (outermost first), so the innermost axis
gets consecutive ranks, and rank // devices_per_node is the node. This is the layout of
`init_device_mesh(device, shape, mesh_dim_names=order)` with torchrun's contiguous ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

import numpy as np


@dataclass(frozen=True, kw_only=True, slots=True)
class AxisSpan:
    """One group of an axis: `members_per_node` ranks in each of `num_nodes` nodes; `same_rail`:
    every node holds its members at the same local ranks, so the cross-node part of a
    hierarchical collective runs between GPUs of one rail (costmodel.hardware.fabric)."""

    size: int
    members_per_node: int
    num_nodes: int
    same_rail: bool = True
    # the node of each member, in the axis's order, where a rule reads it (the pipeline's sends:
    # same_node); empty otherwise
    nodes: tuple[int, ...] = ()

    @property
    def crosses_nodes(self) -> bool:
        return self.num_nodes > 1


def same_node(span: AxisSpan, i: int, j: int) -> bool:
    """Whether members i and j of a group laid out as `span` share a node (its `nodes`,
    axis_nodes); on one node all do."""
    return not span.crosses_nodes or span.nodes[i] == span.nodes[j]


def axis_strides(order: tuple[str, ...], degrees: tuple[int, ...]) -> dict[str, int]:
    """Rank distance between neighbours along each axis."""
    return {axis: prod(degrees[i + 1:]) for i, axis in enumerate(order)}


@lru_cache(maxsize=8192)
def group_span(order: tuple[str, ...], degrees: tuple[int, ...], axes: tuple[str, ...],
               devices_per_node: int) -> AxisSpan:
    """How the group over `axes` (one axis, or several such as dp x cp) that contains rank 0
    spreads over nodes. All groups are alike when devices_per_node divides the strides, the usual
    case; otherwise this describes the first group."""
    strides = axis_strides(order, degrees)
    return _members_span(tuple((strides[axis], degree) for axis, degree in zip(order, degrees) if axis in axes),
                         devices_per_node)


@lru_cache(maxsize=8192)
def _members_span(members: tuple[tuple[int, int], ...], devices_per_node: int) -> AxisSpan:
    """group_span of the group whose axes are (stride, degree) pairs: many meshes share one
    (the axes outside the group change only their own strides), so this is what is cached."""
    if prod(d for _, d in members) > 256:   # a data-parallel group at 16k devices: thousands of ranks
        ranks = np.zeros(1, dtype=np.int64)
        for stride, degree in members:
            ranks = (ranks[:, None] + np.arange(degree, dtype=np.int64) * stride).ravel()
        _, per_node = np.unique(ranks // devices_per_node, return_counts=True)
        local = np.sort(ranks) % devices_per_node   # node by node, each node's local ranks ascending
        same = bool(per_node.min() == per_node.max()
                    and (local.reshape(per_node.size, -1) == local[:per_node[0]]).all())
        return AxisSpan(size=int(ranks.size), members_per_node=int(per_node.max()), num_nodes=int(per_node.size),
                        same_rail=same)
    ranks = [0]
    for stride, degree in members:
        ranks = [r + j * stride for r in ranks for j in range(degree)]
    nodes: dict[int, set[int]] = {}
    for r in ranks:
        nodes.setdefault(r // devices_per_node, set()).add(r % devices_per_node)
    rails = list(nodes.values())
    return AxisSpan(size=len(ranks), members_per_node=max(len(r) for r in rails), num_nodes=len(nodes),
                    same_rail=all(r == rails[0] for r in rails))


@lru_cache(maxsize=8192)
def axis_nodes(order: tuple[str, ...], degrees: tuple[int, ...], axis: str, devices_per_node: int) -> tuple[int, ...]:
    """The node of each member of the `axis` group holding rank 0, in the axis's order."""
    stride = axis_strides(order, degrees)[axis]
    return tuple(j * stride // devices_per_node for j in range(degrees[order.index(axis)]))


def axis_span(order: tuple[str, ...], degrees: tuple[int, ...], axis: str,
              devices_per_node: int) -> AxisSpan:
    return group_span(order, degrees, (axis,), devices_per_node)


def stage_pair_span(pp_span: AxisSpan) -> AxisSpan:
    """The two ranks holding the first and last pipeline stage: in one node unless the pipeline
    axis crosses nodes."""
    return AxisSpan(size=2, members_per_node=1 if pp_span.crosses_nodes else 2,
                    num_nodes=2 if pp_span.crosses_nodes else 1, same_rail=pp_span.same_rail)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertLayout:
    """The mesh with the axes the expert groups cut split apart: `order` and `degrees` as the
    mesh's, a cut axis as two (`axis.out` outer, `axis.in` inner); `etp_axes` group the ranks
    that split each expert (expert tensor parallelism; none at etp 1), `ep_axes` one all-to-all,
    `edp_axes` the ranks holding the same expert shards (their gradients' group)."""

    order: tuple[str, ...]
    degrees: tuple[int, ...]
    ep_axes: tuple[str, ...]
    edp_axes: tuple[str, ...]
    etp_axes: tuple[str, ...] = ()


def _cut(order: tuple[str, ...], degrees: tuple[int, ...], i: int, inner: int) -> tuple[tuple, tuple]:
    """Axis i as two axes, its `inner` consecutive coordinates the inner one."""
    axis = order[i]
    return (order[:i] + (f"{axis}.out", f"{axis}.in") + order[i + 1:],
            degrees[:i] + (degrees[i] // inner, inner) + degrees[i + 1:])


def hybrid_layout(order: tuple[str, ...], degrees: tuple[int, ...],
                  dp_replicate: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The mesh of hybrid sharding (Plan.dp_replicate): dp cut into `dp.out`, its dp_replicate
    replicas (outer), and `dp.in`, the shard group's dp / dp_replicate ranks (inner), as
    torchtitan's mesh (dp_replicate, dp_shard, cp, tp) lays them out. The shard group is dp.in
    with cp, the replicas dp.out (costmodel.rank_time.spans prices them, runtime.mesh builds
    them)."""
    i = order.index("dp")
    return _cut(order, degrees, i, degrees[i] // dp_replicate)


def _take_inner(order: tuple[str, ...], degrees: tuple[int, ...], count: int,
                taken: tuple[str, ...]) -> tuple[tuple, tuple, tuple] | None:
    """The `count` innermost ranks outside the axes already `taken`: whole inner axes, then the
    inner count/(their product) coordinates of the next (cut apart); None where that needs part
    of the pipeline or a coordinate count that does not divide evenly. Returns the (possibly cut)
    mesh and the axes taken."""
    left, mine = count, []
    for i in reversed(range(len(order))):
        axis, degree = order[i], degrees[i]
        if left == 1:
            break
        if degree == 1 or axis in taken:
            continue
        if axis == "pp" or (left % degree and degree % left):
            return None
        if left % degree == 0:
            mine.append(axis)
            left //= degree
        else:
            order, degrees = _cut(order, degrees, i, left)
            mine.append(f"{axis}.in")
            left = 1
    return (order, degrees, tuple(mine)) if left == 1 else None


@lru_cache(maxsize=4096)
def expert_layout(order: tuple[str, ...], degrees: tuple[int, ...], ep: int, fold: bool,
                  etp: int = 1) -> ExpertLayout | None:
    """Where the ranks of an expert-parallel group lie; None where `fold` cannot lay them out.

    Carved from data parallelism (fold False; our runtime, which has no expert TP: etp must be 1):
    ep consecutive data-parallel coordinates, the experts' gradient group the rest of dp with cp
    (TP ranks hold the experts whole and sync them apart). Folded (Megatron-Core, MoE parallel
    folding: Liu et al. 2025, arXiv 2504.14960; parallel_state.py builds the expert ranks as
    tp-ep-dp-pp over the same ranks as the dense tp-cp-dp-pp, its tp there being the expert TP
    size): the etp innermost ranks split each expert, the next ep innermost ranks are the EP
    group, each taking whole inner axes (tp, then cp, then dp in Megatron's order) and the inner
    coordinates of the next; every other non-pipeline rank holding the same expert shards is
    their gradient group (world / (etp x ep x pp) ranks). A group cannot take part of a pipeline
    or a coordinate count that does not divide evenly, and where ranks lie outside the pipeline
    axis (Megatron's tp-cp-ep-pp-dp) the expert groups must be the ranks inside it whole
    (Megatron asserts the expert data-parallel size equals dp there)."""
    if not fold:
        i = order.index("dp")
        if degrees[i] % ep or etp != 1:
            return None
        split = order[:i] + ("edp", "ep") + order[i + 1:]
        sizes = degrees[:i] + (degrees[i] // ep, ep) + degrees[i + 1:]
        return ExpertLayout(order=split, degrees=sizes, ep_axes=("ep",), edp_axes=("edp", "cp"))
    inner = _take_inner(order, degrees, etp, ())
    if inner is None:
        return None
    order, degrees, etp_axes = inner
    outer = _take_inner(order, degrees, ep, etp_axes)
    if outer is None:
        return None
    order, degrees, ep_axes = outer
    i = order.index("pp")
    if degrees[i] > 1 and prod(degrees[:i]) > 1 and etp * ep != prod(degrees[i + 1:]):
        return None   # ranks outside the pipeline too: the expert groups must be the ranks inside it (edp = dp)
    rest = tuple(a for a in order if a not in etp_axes + ep_axes and not a.startswith("pp"))
    return ExpertLayout(order=order, degrees=degrees, ep_axes=ep_axes, edp_axes=rest, etp_axes=etp_axes)
