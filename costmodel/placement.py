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

    @property
    def crosses_nodes(self) -> bool:
        return self.num_nodes > 1


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
    members = [(strides[axis], degree) for axis, degree in zip(order, degrees) if axis in axes]
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


def axis_span(order: tuple[str, ...], degrees: tuple[int, ...], axis: str,
              devices_per_node: int) -> AxisSpan:
    return group_span(order, degrees, (axis,), devices_per_node)


def stage_pair_span(pp_span: AxisSpan) -> AxisSpan:
    """The two ranks holding the first and last pipeline stage: in one node unless the pipeline
    axis crosses nodes."""
    return AxisSpan(size=2, members_per_node=1 if pp_span.crosses_nodes else 2,
                    num_nodes=2 if pp_span.crosses_nodes else 1, same_rail=pp_span.same_rail)
