"""Collective and point-to-point times: the latency-bandwidth (alpha-beta) model.

Ring algorithms (Thakur, Rabenseifner & Gropp 2005; what NCCL uses for large messages): over n
ranks an all-gather or reduce-scatter of a B-byte (unsharded) buffer moves (n-1)/n·B bytes per
rank in n-1 steps; an all-reduce is a reduce-scatter followed by an all-gather. A group that spans
nodes runs hierarchically: the intra-node part on NVLink at full size and the inter-node part on
the B/m shard each of the m local ranks owns, every rank using its own NIC (bandwidth per device
per direction, as the profiles give it), the two added (_cross_node_transfer_s says why). Its
latency is NCCL's own model (src/graph/tuning.cc,
`ncclTopoTuneModel`): a base latency once per collective, and the ring runs through every rank,
so an all-gather or reduce-scatter over n ranks on k nodes pays n-1 steps, k-1 of them across
nodes at the network's step latency and the rest at NVLink's (twice that for an all-reduce); the
profiles hold NCCL's figures for its Simple protocol, which carries training's large buffers.
Over thousands of ranks that is milliseconds per collective, which is why NCCL may run an
all-reduce across nodes as a tree: 2·((m-1) NVLink steps + floor(log2 k) network steps) of
latency, at 0.92 of the ring's bus bandwidth (NCCL's tree factor; its further cap of 80-110 GB/s
per tree is not modelled). Both are priced and the faster taken, as NCCL's tuner does: the tree
for small buffers, the ring for large ones. An all-gather or reduce-scatter with one rank a node
(a data-parallel group beside TP 8) may likewise run as NCCL's PAT (gather_algorithms_s). NVLink
SHARP (NVLS) for an all-reduce inside a node is not priced: only a TP group without sequence
parallelism all-reduces there.

An all-to-all (expert parallelism's token dispatch) of a B-byte send buffer, B/n to each rank,
moves (n-1)/n·B bytes per rank, pairwise in n-1 steps; across nodes each rank sends the
(k-1)/k·B bytes bound for other nodes through its own NIC and the rest over NVLink, both counted
(not overlapped: the same copy engines and SMs serve both).

Offloaded states (Plan.offload_optimizer) add two copies that are not collectives but travel
with them: FSDP2 copies a rank's fp32 shard from the host before each all-gather and the reduced
gradient shard back after each reduce-scatter, on the same stream, over the device's own PCIe
link (the profile's [host], its bandwidth per device when every device of the node copies at
once). Their time is the shard's bytes over that link; FSDP2 copies parameter by parameter, and
that per-copy latency is not counted. Under ZeRO-2/3 without a pipeline each micro-batch reduces
its gradients, and FSDP2 (torch 2.13, `_fsdp_collectives.foreach_reduce`) copies a shard out
without blocking only while the host holds none yet: every later micro-batch's copy blocks, and
its shard is added to the host's on the host's cores (HOST_ADD: 12 bytes per parameter over the
node's shared DRAM).
"""
from __future__ import annotations

from dataclasses import replace
from enum import StrEnum
from functools import lru_cache

import numpy as np

from costmodel.hardware import RING_COLLECTIVES, ClusterSpec, NetworkTier
from costmodel.placement import AxisSpan


class Collective(StrEnum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    HOST_TO_DEVICE = "host_to_device"   # an offloaded shard copied in (see the module docstring)
    DEVICE_TO_HOST = "device_to_host"   # a reduced gradient shard copied out
    HOST_ADD = "host_add"               # a copied-out gradient shard added to the host's on its cores
    # FSDP2's gathered parameters copied out on the compute stream (costmodel.kernels.optimizer:
    # gather_copy_out_s): device work, not a collective, beside the gather it follows
    GATHER_COPY_OUT = "gather_copy_out"
    # each of the n ranks broadcasts its 1/n shard of the buffer in turn (owner_broadcasts_s)
    OWNER_BROADCASTS = "owner_broadcasts"


# what offloading adds beside the collectives: copies over PCIe and the host's own work
HOST_COPIES = (Collective.HOST_TO_DEVICE, Collective.DEVICE_TO_HOST, Collective.HOST_ADD)


def ring_time_s(kind: Collective, num_bytes: float, n: int, tier: NetworkTier) -> float:
    if n <= 1 or num_bytes <= 0:
        return 0.0
    return ring_latency_s(kind, n, tier) + _ring_transfer_s(kind, num_bytes, n, tier)


def ring_latency_s(kind: Collective, n: int, tier: NetworkTier) -> float:
    """A ring collective's latency over n ranks of one tier: the base once, a step a rank a pass."""
    return tier.base_latency_s + _passes(kind) * (n - 1) * tier.latency_for(kind)


def _passes(kind: Collective) -> int:
    """An all-reduce is a reduce-scatter then an all-gather: two passes around the ring."""
    return 2 if kind is Collective.ALL_REDUCE else 1


def _ring_transfer_s(kind: Collective, num_bytes: float, n: int, tier: NetworkTier) -> float:
    """The bandwidth part of a ring collective: (n-1)/n of the buffer per pass."""
    if n <= 1 or num_bytes <= 0:
        return 0.0
    return _passes(kind) * (n - 1) / n * num_bytes / tier.bandwidth_for(kind)


def _ring_rows(kind: str, points: list[tuple[float, float]], world: int) -> list[tuple[float, float]]:
    """A kind's (bytes, seconds) samples as rows of t = steps * alpha + volume / beta, each row
    divided by its t (relative error), with the ring model's steps and per-rank volume."""
    passes = _passes(Collective(kind))
    return [(passes * (world - 1) / t, passes * (world - 1) / world * b / t) for b, t in points]


def _least_squares(rows: list[tuple[float, float]]) -> tuple[float, float, float]:
    a = np.array(rows)
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    alpha, inv_beta = max(alpha, 1e-7), max(inv_beta, 1e-12)
    rms = float(np.sqrt(np.mean((a @ np.array([alpha, inv_beta]) - 1.0) ** 2)))
    return float(alpha), float(1.0 / inv_beta), rms


RING_KINDS = tuple(Collective(k) for k in RING_COLLECTIVES)


def fit_alpha_beta(samples: dict[str, list[tuple[float, float]]], world: int) -> tuple[float, float, float, float]:
    """Least squares of t = steps * alpha + volume / beta over the collectives' microbenchmark
    samples (runtime.profiler.collective_worker), with the ring model's steps and per-rank volume,
    relative error weighting. Returns (alpha_s, beta_bytes_per_s, relative rms error,
    point-to-point latency_s): gloo's send/recv has a much smaller fixed cost than its
    collectives, so it is kept apart (the smallest messages' median time)."""
    rows = [r for kind in RING_KINDS for r in _ring_rows(kind, samples.get(kind, []), world)]
    alpha, beta, rms = _least_squares(rows)
    p2p = float(np.median([t for _, t in samples["p2p"][:4]]))
    return alpha, beta, rms, p2p


# a kind's own fit against the joint one outside these is a broken sample, not the backend
KIND_FACTOR_BOUNDS = (0.05, 20.0)


def kind_factors(samples: dict[str, list[tuple[float, float]]]) -> tuple[tuple[str, float, float], ...]:
    """Each ring collective's own alpha-beta fit over the joint one (fit_alpha_beta): (kind,
    latency factor, bandwidth factor), for NetworkTier.kind_factors. One alpha-beta pair cannot
    serve every kind where the backend runs them differently: gloo's reduce-scatter is the slow one,
    in the microbenchmarks and inside a TP step (`python benchmarks/step_trace.py PLAN --shapes`
    times each kind). A kind with
    fewer than three samples keeps the joint fit. The ring's steps and per-rank share scale every
    row of both fits alike, so the factors do not depend on the ranks that measured them (two
    stand in)."""
    world = 2
    alpha, beta, _ = _least_squares([r for kind in RING_KINDS for r in _ring_rows(kind, samples.get(kind, []), world)])
    lo, hi = KIND_FACTOR_BOUNDS
    out = []
    for kind in RING_KINDS:
        points = samples.get(kind, [])
        if len(points) < 3:
            continue
        a_k, b_k, _ = _least_squares(_ring_rows(kind, points, world))
        out.append((str(kind), min(max(a_k / alpha, lo), hi), min(max(b_k / beta, lo), hi)))
    return tuple(out)


TREE_BANDWIDTH_FRACTION = 0.92   # NCCL tuning.cc: a tree all-reduce's bus bandwidth is 0.92 of the ring's
# NCCL's PAT algorithm (2.23+) for an all-gather or reduce-scatter with one rank a node
# (tuning.cc: ncclPatEnable, baseLatencies[PAT], the PAT latency term and busBw *= .75):
# a base of 8 us, a network step of the tree's latency / 3.5 per doubling of the nodes, 2.8 us
# a rank, at 0.75 of the ring's bus bandwidth
PAT_BASE_LATENCY_S = 8.0e-6
PAT_STEP_DIVISOR = 3.5
PAT_RANK_LATENCY_S = 2.8e-6
PAT_BANDWIDTH_FRACTION = 0.75


def cross_node_ring_latency_s(kind: Collective, n: int, k: int, intra: NetworkTier, inter: NetworkTier) -> float:
    """A ring over n ranks on k nodes (see the module docstring): its base latency once, n-1
    steps, k-1 of them across nodes; a step inside a node costs at least the network's post
    overhead, which every step of a ring that crosses nodes launches (NCCL tuning.cc)."""
    in_node = max(intra.latency_for(kind), inter.post_overhead_s)
    return (max(intra.base_latency_s, inter.base_latency_s)
            + _passes(kind) * ((n - k) * in_node + (k - 1) * inter.latency_for(kind)))


def tree_latency_s(m: int, k: int, intra: NetworkTier, inter: NetworkTier) -> float:
    """NCCL's tree all-reduce over m ranks on each of k nodes: up and down, each (m-1) NVLink
    steps and floor(log2 k) network ones (NCCL's log2i)."""
    ar = Collective.ALL_REDUCE
    return (max(intra.base_latency_s, inter.base_latency_s)
            + 2 * ((m - 1) * intra.latency_for(ar) + (k.bit_length() - 1) * inter.latency_for(ar)))


@lru_cache(maxsize=65536)   # the search prices the same collectives for thousands of candidates
def collective_time_s(kind: Collective, num_bytes: float, span: AxisSpan,
                      cluster: ClusterSpec) -> float:
    """Time of one collective over a group laid out as `span` (see costmodel.placement); for a
    host copy, of this rank's 1/size shard of the `num_bytes` buffer."""
    if kind is Collective.HOST_ADD:
        return host_stream_s(num_bytes / span.size, cluster)
    if kind in HOST_COPIES:
        return host_copy_s(num_bytes / span.size, cluster)
    if kind is Collective.ALL_REDUCE:
        return min(all_reduce_algorithms_s(num_bytes, span, cluster))
    if kind is Collective.OWNER_BROADCASTS:
        return owner_broadcasts_s(num_bytes, span, cluster)
    intra, inter = cluster.device.intra_node, cluster.device.tier_for(span.num_nodes, span.same_rail)
    if not span.crosses_nodes:
        return ring_time_s(kind, num_bytes, span.size, intra)
    m, k = span.members_per_node, span.num_nodes
    if kind is Collective.ALL_TO_ALL:   # 1/k of the buffer stays in the node, (k-1)/k leaves it
        return ring_time_s(kind, num_bytes / k, m, intra) + ring_time_s(kind, num_bytes, k, inter)
    return min(gather_algorithms_s(kind, num_bytes, span, cluster))


def gather_algorithms_s(kind: Collective, num_bytes: float, span: AxisSpan,
                        cluster: ClusterSpec) -> tuple[float, float]:
    """(ring, PAT) times of an all-gather or reduce-scatter over `span`; NCCL runs the faster.
    PAT runs where the group spans nodes with one rank a node on GPUs (NCCL's ncclPatEnable; gloo
    has none), else both are the ring. Each is affine in the bytes (costmodel.rank_time.link_costs
    compares both): PAT's latency grows by 2.8 us a rank where the ring's grows by a network step
    (14 us) a node, so with hundreds of nodes it wins for all but large buffers."""
    intra, inter = cluster.device.intra_node, cluster.device.tier_for(span.num_nodes, span.same_rail)
    if not span.crosses_nodes:
        ring = ring_time_s(kind, num_bytes, span.size, intra)
        return ring, ring
    ring = _cross_node_ring_s(kind, num_bytes, span, intra, inter)
    if (kind not in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER) or span.members_per_node > 1
            or cluster.device.kind == "cpu" or num_bytes <= 0):
        return ring, ring
    k = span.num_nodes
    pat = (PAT_BASE_LATENCY_S + (k.bit_length() - 1) * inter.latency_for(kind) / PAT_STEP_DIVISOR
           + k * PAT_RANK_LATENCY_S
           + _cross_node_transfer_s(kind, num_bytes, span, intra, inter) / PAT_BANDWIDTH_FRACTION)
    return ring, pat


def owner_broadcasts_s(num_bytes: float, span: AxisSpan, cluster: ClusterSpec) -> float:
    """A buffer sharded over the span's n ranks made whole by n broadcasts, one from each shard's
    owner (InternEvo's hybrid ZeRO, costmodel.frameworks `owner_broadcasts`), where a ring
    all-gather makes one collective of it. The bytes are the ring all-gather's (NCCL broadcasts
    along its ring; PAT gathers only); each broadcast runs through all n ranks, so each pays the
    pass's latency, without the network's post overhead (tuning.cc prices ncclFuncBroadcast's
    steps on a branch of their own)."""
    n = span.size
    if n <= 1 or num_bytes <= 0:
        return 0.0
    gather = Collective.ALL_GATHER
    intra, inter = cluster.device.intra_node, cluster.device.tier_for(span.num_nodes, span.same_rail)
    if span.crosses_nodes:
        latency = cross_node_ring_latency_s(gather, n, span.num_nodes, intra, replace(inter, post_overhead_s=0.0))
        return _cross_node_transfer_s(gather, num_bytes, span, intra, inter) + n * latency
    return ring_time_s(gather, num_bytes, n, intra) + (n - 1) * ring_latency_s(gather, n, intra)


def all_reduce_algorithms_s(num_bytes: float, span: AxisSpan, cluster: ClusterSpec) -> tuple[float, float]:
    """(ring, tree) times of an all-reduce over `span`; NCCL runs the faster. Inside a node both
    are the ring. Each is affine in the bytes, the pair is what placement dominance compares
    (costmodel.rank_time.link_costs)."""
    intra, inter = cluster.device.intra_node, cluster.device.tier_for(span.num_nodes, span.same_rail)
    if not span.crosses_nodes:
        ring = ring_time_s(Collective.ALL_REDUCE, num_bytes, span.size, intra)
        return ring, ring
    if num_bytes <= 0:
        return 0.0, 0.0
    transfer = _cross_node_transfer_s(Collective.ALL_REDUCE, num_bytes, span, intra, inter)
    return (_cross_node_ring_s(Collective.ALL_REDUCE, num_bytes, span, intra, inter),
            transfer / TREE_BANDWIDTH_FRACTION + tree_latency_s(span.members_per_node, span.num_nodes, intra, inter))


def _cross_node_ring_s(kind: Collective, num_bytes: float, span: AxisSpan, intra: NetworkTier,
                       inter: NetworkTier) -> float:
    """A ring collective over nodes: the hierarchical transfer and the flat ring's latency."""
    if num_bytes <= 0:
        return 0.0
    return (_cross_node_transfer_s(kind, num_bytes, span, intra, inter)
            + cross_node_ring_latency_s(kind, span.size, span.num_nodes, intra, inter))


def _cross_node_transfer_s(kind: Collective, num_bytes: float, span: AxisSpan, intra: NetworkTier,
                           inter: NetworkTier) -> float:
    """The bandwidth part over nodes, hierarchically: e.g. all-reduce = reduce-scatter in node +
    all-reduce of the 1/m shard across nodes + all-gather in node; the in-node ring all-reduce
    accounts for the first and last parts. The two legs are added, though NCCL's flat ring
    pipelines them over its channels and nccl-tests reaches the slower leg's rate alone (8 NDR
    NICs give 4-node DGX H100 all-reduces ~365 GB/s of bus bandwidth, NVIDIA/nccl-tests#309):
    priced at the slower leg and refitted, the published runs are fitted worse (a larger
    leave-one-source-out error, the A100's inter_node_comm at its lower bound, the H100's attention
    rate below what NeMo's long-context runs show; commit 397fa8c gives the figures). The runs'
    collectives, overlapped with compute and each other at their bucket sizes, move slower than
    nccl-tests' peak by a mechanism not modelled; the sum stands in for it."""
    m, k = span.members_per_node, span.num_nodes
    return _ring_transfer_s(kind, num_bytes, m, intra) + _ring_transfer_s(kind, num_bytes / m, k, inter)


def host_copy_s(num_bytes: float, cluster: ClusterSpec) -> float:
    """Bytes over a device's own link to its host (pinned-memory copies)."""
    return num_bytes / cluster.host_for("host copies").link_effective_bytes_per_s


def host_stream_s(num_bytes: float, cluster: ClusterSpec) -> float:
    """Bytes a device's host-side work streams through the node's DRAM, which all the node's
    devices share (gradient adds here; the optimizer step in costmodel.kernels)."""
    return num_bytes / cluster.host_stream_bytes_per_s("host-side work")


def p2p_time_s(num_bytes: float, tier: NetworkTier) -> float:
    latency = tier.latency_s if tier.p2p_latency_s is None else tier.p2p_latency_s
    return latency + num_bytes / tier.effective_bandwidth_bytes_per_s
