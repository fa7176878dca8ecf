"""Mesh axis orders the search prices for one set of degrees: one per distinct placement of the
groups on the cluster (costmodel.rank_time.spans), under a framework only those it lays ranks out
by, and none whose every link is at least as slow as another's.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from costmodel.groups import views
from costmodel.hardware import ClusterSpec
from costmodel.placement import expert_layout
from costmodel.rank_time import Spans, link_costs, spans
from planner.space import degrees_plan

if TYPE_CHECKING:
    from planner.search_options import FrameworkSpace


def _placements(degrees: dict[str, int], cluster: ClusterSpec,
                space: FrameworkSpace | None = None) -> list[tuple[tuple[str, ...], Spans]]:
    """One mesh order per distinct placement of the groups (its spans); on a mixed cluster the
    pipeline axis outermost; under a framework, only the orders it lays ranks out by."""
    placed: dict[Spans, tuple[str, ...]] = {}
    layouts = None if space is None else {_layout(o, degrees) for o in space.mesh_orders}
    seen = set()   # orders of one layout place ranks alike: the first of them stands for it
    for order in itertools.permutations(("pp", "dp", "cp", "tp")):
        if cluster.is_mixed and order[0] != "pp":
            continue
        layout = _layout(order, degrees)
        if (layouts is not None and layout not in layouts) or layout in seen:
            continue
        if not (_lays_out_ep(order, degrees, cluster) and shards_whole_nodes(order, degrees)):
            continue
        seen.add(layout)
        placed.setdefault(spans(degrees_plan(**degrees, mesh_axis_order=order), cluster), order)
    return [(order, sp) for sp, order in placed.items()]


def _lays_out_ep(order: tuple[str, ...], degrees: dict[str, int], cluster: ClusterSpec) -> bool:
    """Whether the framework lays the expert-parallel groups out under this order (a framework
    that folds them takes the innermost ranks: costmodel.placement.expert_layout)."""
    ep, etp = degrees.get("ep", 1), degrees.get("etp", 1)
    return ep * etp == 1 or expert_layout(order, tuple(degrees[a] for a in order), ep, cluster.framework.ep_folds_over_tp,
                                          etp) is not None


def shards_whole_nodes(order: tuple[str, ...], degrees: dict[str, int]) -> bool:
    """Under hybrid sharding (degrees' dp_replicate > 1), whether each shard group is a block of
    consecutive ranks, the pipeline outside the data-parallel axis and TP and CP inside it: then
    its tp x cp x dp / r ranks fill whole nodes (planner.candidates.replica_counts takes only such
    counts); otherwise its ranks are strided over nodes it shares with other groups."""
    if degrees.get("dp_replicate", 1) == 1:
        return True
    i = order.index("dp")
    return all(degrees[a] == 1 or (order.index(a) > i) == (a != "pp") for a in ("pp", "cp", "tp"))


def _layout(order: tuple[str, ...], degrees: dict[str, int]) -> tuple[str, ...]:
    """The axes of more than one rank in `order`: orders with the same layout place ranks alike."""
    return tuple(a for a in order if degrees[a] > 1)


def distinct_orders(degrees: dict[str, int], cluster: ClusterSpec) -> list[tuple[str, ...]]:
    """One mesh order per distinct placement, dominated or not (a mixed cluster's replicas)."""
    return [order for order, _ in _placements(degrees, cluster)]


def mesh_orders(degrees: dict[str, int], cluster: ClusterSpec,
                space: FrameworkSpace | None = None) -> list[tuple[str, ...]]:
    """Mesh axis orders worth pricing: one per distinct placement of the groups, and none whose
    every link is at least as slow as another's (costmodel.rank_time.link_costs: such a placement
    cannot give a faster plan, and memory does not depend on placement). On a mixed cluster the
    pipeline axis stays outermost (each stage a run of whole nodes of one group,
    costmodel.groups), and a link must be no slower on every group's profile."""
    items = [(order, tuple(c for view in views(cluster) for c in link_costs(sp, view)))
             for order, sp in _placements(degrees, cluster, space)]
    out = []
    for i, (order, costs) in enumerate(items):
        # dominated: another is no slower anywhere, and faster somewhere or listed first
        if not any(j != i and all(a <= b for a, b in zip(other, costs)) and (other != costs or j < i)
                   for j, (_, other) in enumerate(items)):
            out.append(order)
    return out
