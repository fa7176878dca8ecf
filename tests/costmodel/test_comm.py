"""Collective times across nodes: NCCL's ring latency over every rank, and its tree for
small all-reduces (costmodel.comm; NCCL src/graph/tuning.cc)."""
import pytest

from costmodel.cluster import parse_cluster
from costmodel.comm import Collective, all_reduce_algorithms_s, collective_time_s
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


def test_an_all_reduce_across_nodes_takes_the_tree_for_small_buffers_and_the_ring_for_large():
    """NCCL's tuner: the tree's 2 (in-node steps + floor(log2 nodes)) steps against the ring's
    twice n-1, at 0.9 of the ring's bandwidth. A small buffer takes the tree, 10 GB the ring."""
    span = AxisSpan(size=512, members_per_node=8, num_nodes=64)
    tree = 2 * (7 * INTRA.latency_s + 6 * INTER.latency_s)
    ring = 2 * ((511 - 63) * INTRA.latency_s + 63 * INTER.latency_s)
    assert tree < ring and latency_s(Collective.ALL_REDUCE, span) == pytest.approx(tree, rel=1e-6)
    ring_s, tree_s = all_reduce_algorithms_s(10e9, span, CLUSTER)
    assert ring_s < tree_s and collective_time_s(Collective.ALL_REDUCE, 10e9, span, CLUSTER) == ring_s
    # 48 nodes: NCCL's log2i rounds down (5 network steps, not 6)
    odd = AxisSpan(size=384, members_per_node=8, num_nodes=48)
    assert latency_s(Collective.ALL_REDUCE, odd) == pytest.approx(2 * (7 * INTRA.latency_s + 5 * INTER.latency_s))
    one_per_node = AxisSpan(size=2, members_per_node=1, num_nodes=2)
    assert latency_s(Collective.ALL_REDUCE, one_per_node) == pytest.approx(2 * INTER.latency_s, rel=1e-6)


def test_a_group_uneven_over_its_nodes_pays_a_step_per_rank_it_has():
    """12 ranks as 8 + 4 on two nodes (members_per_node is the largest count): 11 steps, 1 across."""
    span = AxisSpan(size=12, members_per_node=8, num_nodes=2)
    assert latency_s(Collective.ALL_GATHER, span) == pytest.approx(10 * INTRA.latency_s + INTER.latency_s)


def test_the_bandwidth_part_stays_hierarchical():
    """Doubling the buffer adds the in-node ring's and the 1/m shard's inter-node transfer."""
    span = AxisSpan(size=64, members_per_node=8, num_nodes=8)
    extra = (collective_time_s(Collective.ALL_GATHER, 2e9, span, CLUSTER)
             - collective_time_s(Collective.ALL_GATHER, 1e9, span, CLUSTER))
    expected = 7 / 8 * 1e9 / INTRA.effective_bandwidth_bytes_per_s + 7 / 8 * 1e9 / 8 / INTER.effective_bandwidth_bytes_per_s
    assert extra == pytest.approx(expected, rel=1e-9)
    assert collective_time_s(Collective.ALL_GATHER, 0.0, span, CLUSTER) == 0.0
