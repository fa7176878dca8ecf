"""The cluster's network as a graph (networkx), and the tier a group of nodes crosses on it.

Vertices: each node's GPUs `("gpu", node, rail)` (a GPU's rail is its local rank: its own NIC),
the node's NVLink/NVSwitch domain `("domain", node)`, each middle tier's switches
`("middle", i, block)` (a rack's switch, a multi-node NVLink domain: blocks of `max_nodes`
consecutive nodes), the cluster tier's leaf switches and its spine. Every edge carries the
`NetworkTier` a byte crossing it moves at and its level (0 innermost).

Routes. Inside the NVLink family a GPU reaches its node's domain, and domains reach each other
through a middle tier's switch; the innermost such route wins (NCCL prefers NVLink to the
network). Otherwise a GPU's traffic leaves through its own NIC to a leaf switch (no PXN: NCCL's
forwarding over NVLink to the NIC on the destination's rail is not modelled). Rail-optimised
(`FabricSpec.rail_optimized`), leaf `(block, rail)` connects GPU `rail` of every node of its
block of `nodes_per_leaf` nodes, so same-rail traffic inside a block is one switch hop and traffic
between rails or blocks crosses the spine; otherwise a node's NICs all sit on its block's leaf.
The spine's links carry the cluster tier at 1/`spine_oversubscription` of its bandwidth per
device (2:1 halves it); a leaf hop carries the cluster tier as the profile gives it.

The tier a route crosses is its outermost edge's. A group over N consecutive nodes is taken to
start at a block boundary, as the row-major placement lays out the group holding rank 0
(costmodel.placement.group_span), so every level's blocks start at its first node and its
farthest members are on its first and last node: the graph is built over those two nodes only
(and two rails, the same one or not), which keeps a derivation a few small-graph operations,
cached per (nodes, same rail).

Defaults, when a profile has no `[fabric]` table: the compute fabric of NVIDIA's DGX SuperPOD
reference architecture (DGX H100, RA-11333-001, "Network Fabrics": "Each group of 32 nodes is
rail-aligned. Traffic per rail of the DGX H100 systems is always one hop away from the other 31
nodes in a SU. Traffic between nodes, or between rails, traverses the spine layer"; its
component table has as many leaf-spine cables as node-leaf ones: a non-blocking fat tree).
Non-blocking, the leaf and the spine price a byte alike, so the default reproduces the profile's
tiers: the node's, the innermost middle tier spanning the group, else the cluster's.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import networkx as nx

    from costmodel.hardware.records import NetworkTier


SUPERPOD_SOURCE = ("NVIDIA DGX SuperPOD reference architecture, DGX H100 (RA-11333-001), Network Fabrics: "
                   "32-node rail-aligned scalable units, non-blocking leaf-spine fat tree")


@dataclass(frozen=True, kw_only=True, slots=True)
class FabricSpec:
    """A profile's `[fabric]` table: how the cluster tier's switches connect the nodes."""

    rail_optimized: bool = True      # leaf i connects NIC i of each node of its block
    nodes_per_leaf: int = 32         # nodes one leaf switch (one per rail when rail-optimised) connects
    spine_oversubscription: float = 1.0   # leaf downlink over uplink bandwidth: 2.0 is 2:1
    source: str = SUPERPOD_SOURCE


NVLINK, NIC = "nvlink", "nic"   # the two families of links a route may take


@dataclass(frozen=True, kw_only=True, slots=True)
class Fabric:
    """A profile's tiers and fabric as a switch graph; `tier` answers which tier a group crosses."""

    node: NetworkTier
    middle: tuple[NetworkTier, ...]
    cluster: NetworkTier
    spec: FabricSpec = FabricSpec()
    # (num_nodes, same_rail) -> tier: the search asks tens of thousands of times for a handful
    # of answers, so each is derived once per fabric
    _memo: dict[tuple[int, bool], NetworkTier] = field(default_factory=dict, init=False, repr=False,
                                                       compare=False)

    @property
    def spine(self) -> NetworkTier:
        """The cluster tier as the spine carries it: 1/oversubscription of the bandwidth."""
        ratio = self.spec.spine_oversubscription
        if ratio == 1.0:
            return self.cluster
        return replace(self.cluster, name=f"{self.cluster.name} over a {ratio:g}:1 spine",
                       bandwidth_bytes_per_s=self.cluster.bandwidth_bytes_per_s / ratio)

    def tier(self, num_nodes: int, same_rail: bool = True) -> NetworkTier:
        """The slowest tier a group over `num_nodes` consecutive nodes crosses (see the module
        docstring), with its bandwidth per device and latency; `same_rail`: its members on
        different nodes sit at the same local rank. A non-blocking spine carries the cluster tier
        as its leaves do, so there the graph's answer is the tiers' own (tested against the graph,
        graph_tier) and the search, which asks tens of thousands of times, never imports networkx."""
        if self.spec.spine_oversubscription == 1.0:
            if num_nodes <= 1:
                return self.node
            return next((t for t in self.middle if num_nodes <= (t.max_nodes or 0)), self.cluster)
        return self.graph_tier(num_nodes, same_rail)

    def graph_tier(self, num_nodes: int, same_rail: bool = True) -> NetworkTier:
        """`tier` read off the switch graph: the outermost level on the route between the group's
        farthest members."""
        hit = self._memo.get((num_nodes, same_rail))
        if hit is None:
            path = self.route(num_nodes, same_rail)
            graph = fabric_graph(self, _ends(num_nodes), 2)
            hit = self._memo[num_nodes, same_rail] = max((graph.edges[a, b] for a, b in zip(path, path[1:])),
                                                         key=lambda e: e["level"])["tier"]
        return hit

    def route(self, num_nodes: int, same_rail: bool = True) -> list[tuple]:
        """The vertices a byte passes between the group's farthest members: GPU 0 of its first
        node and GPU 0 (or, members on different rails, GPU 1) of its last."""
        import networkx as nx  # see fabric_graph

        graph = fabric_graph(self, _ends(num_nodes), 2)
        src, dst = ("gpu", 0, 0), ("gpu", max(num_nodes, 1) - 1, 0 if same_rail and num_nodes > 1 else 1)
        for family in (NVLINK, NIC):
            links = nx.subgraph_view(graph, filter_edge=lambda a, b, f=family: graph.edges[a, b]["family"] == f)
            if nx.has_path(links, src, dst):
                return nx.shortest_path(links, src, dst, weight="weight")
        raise AssertionError(f"no route between {src} and {dst}")   # every GPU has a leaf and a spine


def _ends(num_nodes: int) -> tuple[int, ...]:
    return tuple(sorted({0, max(num_nodes, 1) - 1}))


@lru_cache(maxsize=256)
def fabric_graph(fabric: Fabric, nodes: tuple[int, ...], num_rails: int) -> nx.Graph:
    """The switch graph over `nodes` (node indices in the cluster) with `num_rails` GPUs each.
    Edge weights grow with the level, so a shortest route takes the innermost tier that
    connects its ends."""
    # imported here: networkx takes tenths of a second to import, which commands that price
    # nothing (`planner models`, `planner devices`, `--help`) need not pay
    import networkx as nx

    graph = nx.Graph()
    def link(a: tuple, b: tuple, tier: NetworkTier, level: int, family: str) -> None:
        graph.add_edge(a, b, tier=tier, level=level, family=family, weight=level + 1)
    top = len(fabric.middle) + 1   # the leaves' level; the spine's is one more
    spec = fabric.spec
    for n in nodes:
        for rail in range(num_rails):
            link(("gpu", n, rail), ("domain", n), fabric.node, 0, NVLINK)
            leaf = ("leaf", n // spec.nodes_per_leaf, rail if spec.rail_optimized else 0)
            link(("gpu", n, rail), leaf, fabric.cluster, top, NIC)
            link(leaf, ("spine",), fabric.spine, top + 1, NIC)
        for i, tier in enumerate(fabric.middle):
            assert tier.max_nodes is not None, "a middle tier connects max_nodes nodes"
            link(("domain", n), ("middle", i, n // tier.max_nodes), tier, i + 1, NVLINK)
    return graph
