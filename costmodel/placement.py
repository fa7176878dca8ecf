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


@dataclass(frozen=True, kw_only=True, slots=True)
class AxisSpan:
    """One group of an axis: `members_per_node` ranks in each of `num_nodes` nodes."""

    size: int
    members_per_node: int
    num_nodes: int

    @property
    def crosses_nodes(self) -> bool:
        return self.num_nodes > 1


def axis_strides(order: tuple[str, ...], degrees: tuple[int, ...]) -> dict[str, int]:
    """Rank distance between neighbours along each axis."""
    return {axis: prod(degrees[i + 1:]) for i, axis in enumerate(order)}


@lru_cache(maxsize=4096)
def axis_span(order: tuple[str, ...], degrees: tuple[int, ...], axis: str,
              devices_per_node: int) -> AxisSpan:
    """How the group of `axis` containing rank 0 spreads over nodes (all groups are alike when
    devices_per_node divides the strides, the usual case; otherwise this is the first group)."""
    stride = axis_strides(order, degrees)[axis]
    size = degrees[order.index(axis)]
    nodes: dict[int, int] = {}
    for i in range(size):
        node = (i * stride) // devices_per_node
        nodes[node] = nodes.get(node, 0) + 1
    return AxisSpan(size=size, members_per_node=max(nodes.values()), num_nodes=len(nodes))


def mesh_shape(order: tuple[str, ...], degree_of: dict[str, int]) -> tuple[int, ...]:
    return tuple(degree_of[axis] for axis in order)
