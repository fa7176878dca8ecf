"""Collective times across nodes: NCCL's ring latency over every rank, and its tree for
all-reduce (costmodel.comm; NCCL src/graph/tuning.cc)."""
import math

import pytest

from costmodel.cluster import parse_cluster
from costmodel.comm import Collective, collective_time_s
from costmodel.placement import AxisSpan

CLUSTER = parse_cluster("64x8xH100")
INTRA, INTER = CLUSTER.device.intra_node, CLUSTER.device.inter_node


def latency_s(kind: Collective, span: AxisSpan) -> float:
    """The byte-independent part: time is affine in the buffer's size."""
    one, two = (collective_time_s(kind, b, span, CLUSTER) for b in (1e6, 2e6))
    return one - (two - one)


@pytest.mark.parametrize("kind", [Collective.ALL_GATHER, Collective.REDUCE_SCATTER])
def test_a_ring_across_nodes_pays_a_step_per_rank(kind):
    """512 ranks on 64 nodes: 511 steps, 63 of them across nodes; the in-node part of each node
    is walked on every node, not once (which made latency grow with nodes only)."""
    span = AxisSpan(size=512, members_per_node=8, num_nodes=64)
    expected = (511 - 63) * INTRA.latency_s + 63 * INTER.latency_s
    assert latency_s(kind, span) == pytest.approx(expected, rel=1e-6)
    small = AxisSpan(size=128, members_per_node=8, num_nodes=16)
    assert latency_s(kind, small) == pytest.approx((127 - 15) * INTRA.latency_s + 15 * INTER.latency_s, rel=1e-6)


def test_an_all_reduce_across_many_nodes_takes_the_tree():
    """Twice the ring's steps against 2 (in-node steps + log2 nodes): the tree wins at scale, the
    ring where the tree's network steps cost more than the ring's few in-node ones."""
    span = AxisSpan(size=512, members_per_node=8, num_nodes=64)
    tree = 2 * (7 * INTRA.latency_s + math.log2(64) * INTER.latency_s)
    ring = 2 * ((511 - 63) * INTRA.latency_s + 63 * INTER.latency_s)
    assert tree < ring and latency_s(Collective.ALL_REDUCE, span) == pytest.approx(tree, rel=1e-6)
    one_per_node = AxisSpan(size=2, members_per_node=1, num_nodes=2)
    assert latency_s(Collective.ALL_REDUCE, one_per_node) == pytest.approx(2 * INTER.latency_s, rel=1e-6)


def test_the_bandwidth_part_stays_hierarchical():
    """Doubling the buffer adds the in-node ring's and the 1/m shard's inter-node transfer."""
    span = AxisSpan(size=64, members_per_node=8, num_nodes=8)
    extra = (collective_time_s(Collective.ALL_GATHER, 2e9, span, CLUSTER)
             - collective_time_s(Collective.ALL_GATHER, 1e9, span, CLUSTER))
    expected = 7 / 8 * 1e9 / INTRA.effective_bandwidth_bytes_per_s + 7 / 8 * 1e9 / 8 / INTER.effective_bandwidth_bytes_per_s
    assert extra == pytest.approx(expected, rel=1e-9)
    assert collective_time_s(Collective.ALL_GATHER, 0.0, span, CLUSTER) == 0.0
