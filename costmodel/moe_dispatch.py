"""The expert all-to-alls of one layer: the routed rows dispatched to their experts' ranks and
the outputs combined back, and what a per-node dispatcher saves on the network.

Each EP rank sends the rows it routes (tokens x top_k, the busiest rank's share:
costmodel.kernels.expert_rows), h values each. costmodel.comm prices an all-to-all over an EP
group of m ranks on each of k nodes as its in-node part (1/k of the buffer stays in the node) and
its cross-node part (the whole buffer on a ring over the nodes, whose (k-1)/k leaves the node).

A dispatcher that sends a token once to each node holding some of its experts and forwards it
there to their GPUs (DeepSeek-V3, arXiv 2412.19437 Sec. 3.2.2: "each token will be dispatched to
at most 4 nodes" over InfiniBand, then over NVLink; DeepEP's internode kernels, Megatron-Core's
flex dispatcher: FrameworkTraits.dispatch_per_node) puts one copy of a token on the network per
node its experts lie on, instead of top_k, and delivers it over NVLink once to each rank holding
some of its experts (which permutes it to them), not once per expert. The two legs run at once:
DeepEP's internode kernels pair each channel's RDMA senders with warps that forward what arrives
over NVLink through chunked ring buffers
(csrc/kernels/internode.cu), and NVIDIA's Hybrid-EP overlaps its InfiniBand sends with the
in-node forwarding the same way (DeepEP hybrid-ep branch, docs/Hybrid-EP_Implementation.md), so
an all-to-all takes its slower leg. DeepEP's published internode rates bear this out (README, now
docs/legacy.md: H800 with a 400 Gb/s ConnectX-7 a GPU, the DGX H100's NIC; bytes counted once per
node a token reaches, its own node included): combine 57 GB/s at EP 32 and 50 at EP 64, which the
slower leg gives with the H100 profile's InfiniBand efficiency (56 and 48); the legs one after the
other would give 44 and 39. The NVLink leg is the dispatcher's own kernels on the few SMs it is
given, not NCCL's ring, so it runs at their published forwarding rate (the node tier's
forward_bytes_per_s): Hybrid-EP's H100 table shows it binding over 2 nodes (EP 16: 63-77 GB/s in
kernel time, 61-67 through the torch API Megatron-Core calls less a copy priced as the
permutation, below the 85 its InfiniBand alone would give) and not over 4 or 8. The combine
returns the same rows the same way. The experts lie consecutively on the EP group's ranks
(runtime.parallel, placement.expert_layout), num_experts/k a node:
- node-limited routing (DeepSeek-V3 Sec. 2.1.2; ModelSpec.topk_groups of num_expert_groups):
  each token's experts are chosen within its best topk_groups groups, a group covers
  ceil(k / groups) of the k nodes, so a token's experts lie on at most
  min(k, topk_groups x ceil(k / groups)) nodes (routing_nodes). The router ranks groups by their
  best experts, so each chosen group holds about top_k / topk_groups of them, spread over the
  group's nodes: over 16 nodes (a group on 2) 4 x 2 (1 - 16/32 x 15/31) = 6.06 copies, not the
  bound's 8; over 32, 7.10 (V3's router on 20,000 tokens of random sigmoid scores: 5.73 and
  6.85, and 3.97 over 8 nodes, where this gives the bound, 4: tests/costmodel/test_moe_dispatch.py
  simulates it); where several groups share a
  node (k < groups), its copies are the nodes
  its topk_groups groups lie on, k (1 - C(groups - groups/k, topk_groups) / C(groups, topk_groups))
  on average, the chosen groups spread evenly (DeepSeek-V3's 8 groups on 4 nodes: 3.14, not 4);
- otherwise, routing spread evenly over the experts (the balancing loss's aim), a node holds none
  of a token's top_k distinct experts with probability C(E - E/k, top_k) / C(E, top_k), so a
  token reaches k (1 - that) nodes on average; the same over the ranks gives its deliveries
  (under node-limited routing, over the ranks of its chosen groups: token_ranks).
Without such a dispatcher every routed row is sent alone.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

from costmodel.comm import Collective, collective_time_s
from costmodel.frameworks import FrameworkTraits
from costmodel.hardware import ClusterSpec
from costmodel.params import ceil_div
from costmodel.placement import AxisSpan
from costmodel.specs import ModelSpec, TrainSpec


def routing_nodes(model: ModelSpec, num_nodes: int) -> int:
    """The most nodes of an EP group over `num_nodes` nodes a token's experts can lie on."""
    if model.num_expert_groups == 1 or model.topk_groups == model.num_expert_groups:
        return num_nodes
    return min(num_nodes, model.topk_groups * ceil_div(num_nodes, model.num_expert_groups))


def limits_groups(model: ModelSpec) -> bool:
    """Whether the router picks a token's experts within fewer groups than there are (node-limited
    routing: DeepSeek built the limit for a per-node dispatcher, and Megatron-Core runs one for it,
    planner.exports.megatron)."""
    return 1 < model.num_expert_groups and model.topk_groups < model.num_expert_groups


def per_node(model: ModelSpec, cluster: ClusterSpec) -> bool:
    """Whether the dispatch sends a token once per node: a per-node dispatcher, and experts to
    route to (a dense layer of a mixture, DeepSeek's first ones, routes nothing)."""
    return dispatches_per_node(model, cluster.framework)


def dispatches_per_node(model: ModelSpec, traits: FrameworkTraits) -> bool:
    """per_node under the framework's `traits`."""
    return traits.dispatch_per_node and model.is_moe


def needs_per_node_dispatcher(model: ModelSpec, cluster: ClusterSpec, span: AxisSpan) -> bool:
    """Whether the plan's price over the EP group laid out as `span` needs the per-node
    dispatcher (Megatron-Core's flex dispatcher, planner.exports.megatron): it crosses nodes, or
    a token's experts share ranks, so that sending it once to each moves fewer bytes than every
    routed row, which the all-to-all dispatcher sends (Qwen3's top-8 of 128 experts over EP 8:
    5.3 ranks a token; Mixtral's top-2 of 8 over EP 8: 2, the same bytes either way)."""
    return traits_need_per_node_dispatcher(model, cluster.framework, span)


def traits_need_per_node_dispatcher(model: ModelSpec, traits: FrameworkTraits, span: AxisSpan) -> bool:
    """needs_per_node_dispatcher under the framework's `traits`."""
    return dispatches_per_node(model, traits) and (span.crosses_nodes
                                                   or token_ranks(model, span) < model.experts_per_token - 1e-9)


def _spread(num_experts: float, holders: float, top_k: int) -> float:
    """The holders (nodes or ranks, num_experts / holders experts each) a token's top_k distinct
    experts lie on, routing spread evenly: a holder has none with probability
    C(E - E/holders, top_k) / C(E, top_k)."""
    per_holder = num_experts / holders
    missed = prod((num_experts - per_holder - i) / (num_experts - i) for i in range(top_k))
    return holders * (1 - max(missed, 0.0))


def _in_chosen_groups(model: ModelSpec, holders: float) -> float:
    """The holders (at least one a group: nodes or ranks) a token's experts lie on under node-limited
    routing: the router picks the topk_groups groups by their best experts' scores (DeepSeek-V3
    Sec. 2.1.2: the sum of each group's top 2), so each chosen group holds about top_k /
    topk_groups of the token's experts, spread over that group's holders."""
    groups, chosen = model.num_expert_groups, model.topk_groups
    per_group = max(1, round(model.experts_per_token / chosen))
    return min(model.experts_per_token, chosen * _spread(model.num_experts / groups, holders / groups, per_group))


def token_nodes(model: ModelSpec, num_nodes: int) -> float:
    """A token's copies on the network under a per-node dispatcher over an EP group on `num_nodes`
    nodes: the nodes its experts lie on (the module's docstring derives the cases)."""
    if limits_groups(model):
        if num_nodes < model.num_expert_groups:   # several groups a node: the nodes its groups lie on
            return _spread(model.num_expert_groups, num_nodes, model.topk_groups)
        return _in_chosen_groups(model, num_nodes)
    return _spread(model.num_experts, num_nodes, model.experts_per_token)


def token_ranks(model: ModelSpec, span: AxisSpan) -> float:
    """A token's copies a per-node dispatcher delivers to the ranks of the EP group laid out as
    `span`: one per rank some of its experts lie on (its experts then permuted on that rank), the
    routing spread evenly. Under node-limited routing its experts lie in topk_groups of the
    num_expert_groups groups (consecutive blocks of experts): over at least as many ranks as
    groups, on the ranks of those groups; over fewer (several groups a rank), on the ranks the
    chosen groups lie on."""
    e, k, n = model.num_experts, model.experts_per_token, span.size
    if not limits_groups(model):
        return _spread(e, n, k)
    groups, chosen = model.num_expert_groups, model.topk_groups
    if n >= groups:
        return _in_chosen_groups(model, n)
    ranks = _spread(groups, n, chosen)
    return min(ranks, _spread(e * chosen / groups, ranks, k))


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchBytes:
    """One all-to-all (dispatch or combine) of one EP rank, as two parts."""

    in_node_bytes: float      # the buffer the in-node all-to-all moves
    cross_node_bytes: float   # the buffer the all-to-all over the nodes moves


def dispatch_bytes(model: ModelSpec, train: TrainSpec, rows: float, span: AxisSpan,
                   cluster: ClusterSpec) -> DispatchBytes:
    """The bytes of one all-to-all of `rows` routed rows over the EP group laid out as `span`. A
    per-node dispatcher delivers token_ranks / top_k of them to the ranks over NVLink (its own
    copies included, as its benchmarks count them) and sends token_nodes / top_k across nodes;
    otherwise comm's plain split (1/k in the node, the whole buffer over the nodes)."""
    whole = train.compute_dtype.num_bytes * rows * model.hidden_size
    k = span.num_nodes
    if not per_node(model, cluster):
        return DispatchBytes(in_node_bytes=whole / k, cross_node_bytes=whole if k > 1 else 0.0)
    delivered = whole * token_ranks(model, span) / model.experts_per_token
    crossing = whole * token_nodes(model, k) / model.experts_per_token if k > 1 else 0.0
    return DispatchBytes(in_node_bytes=delivered, cross_node_bytes=crossing)


def _forward_s(delivered_bytes: float, members_per_node: int, cluster: ClusterSpec) -> float:
    """A per-node dispatcher's NVLink leg across nodes: the bytes delivered to a rank at the rate
    the dispatcher's kernels forward at while their network leg runs (the node tier's
    forward_bytes_per_s), or as the tier's all-to-all where no rate is published."""
    if members_per_node == 1:
        return 0.0
    tier = cluster.device.intra_node
    if tier.forward_bytes_per_s > 0:
        return tier.base_latency_s + delivered_bytes / tier.forward_bytes_per_s
    in_node = AxisSpan(size=members_per_node, members_per_node=members_per_node, num_nodes=1)
    return collective_time_s(Collective.ALL_TO_ALL, delivered_bytes, in_node, cluster)


def dispatch_combine_s(model: ModelSpec, train: TrainSpec, rows: float, span: AxisSpan,
                       cluster: ClusterSpec) -> float:
    """One direction (forward or backward) of one layer: the dispatch and the combine, two
    all-to-alls of `rows` rows each (computation waits on both); across nodes under a per-node
    dispatcher each takes the slower of its NVLink and network legs, which overlap."""
    if not per_node(model, cluster):
        whole = train.compute_dtype.num_bytes * rows * model.hidden_size
        return 2 * collective_time_s(Collective.ALL_TO_ALL, whole, span, cluster)
    parts = dispatch_bytes(model, train, rows, span, cluster)
    if not span.crosses_nodes:
        return 2 * collective_time_s(Collective.ALL_TO_ALL, parts.in_node_bytes, span, cluster)
    k = span.num_nodes
    nodes = AxisSpan(size=k, members_per_node=1, num_nodes=k, same_rail=span.same_rail)
    return 2 * max(_forward_s(parts.in_node_bytes, span.members_per_node, cluster),
                   collective_time_s(Collective.ALL_TO_ALL, parts.cross_node_bytes, nodes, cluster))
