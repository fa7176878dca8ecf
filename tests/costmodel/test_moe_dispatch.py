"""The expert all-to-all under a per-node dispatcher (costmodel.moe_dispatch): the bytes a token
puts on the network are those of the nodes its experts lie on, bounded under node-limited routing
and on average otherwise."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.comm import Collective, collective_time_s
from costmodel.frameworks import FRAMEWORKS, RUNTIME
from costmodel.hardware import parse_cluster
from costmodel.moe_dispatch import dispatch_bytes, dispatch_combine_s, routing_nodes, token_nodes
from costmodel.placement import AxisSpan
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec

V3 = resolve_model("deepseek-v3")          # 256 experts in 8 groups, top-8 within the best 4
TRAIN = TrainSpec(seq_len=4096, global_batch_size=1024)
CORE = replace(parse_cluster("16x8xH100"), framework=FRAMEWORKS["megatron-core"])
ROWS = 4096 * 8                            # a micro-batch's tokens, 8 routed copies each


def _span(nodes: int) -> AxisSpan:
    return AxisSpan(size=8 * nodes, members_per_node=8, num_nodes=nodes)


@pytest.mark.parametrize("nodes, reached", [(1, 1), (4, 4), (8, 4), (16, 8), (32, 16)])
def test_a_tokens_experts_lie_on_at_most_topk_groups_groups_nodes(nodes, reached):
    """EP64 over 8 nodes (DeepSeek-V3's layout): a group per node, 4 nodes; over 16 nodes a
    group spans 2 nodes, so 8; over 4 nodes two groups share a node, all 4 reachable."""
    assert routing_nodes(V3, nodes) == reached


def test_cross_node_bytes_are_min_top_k_nodes_copies_per_token():
    whole = 2 * ROWS * V3.hidden_size       # bf16
    eight = dispatch_bytes(V3, TRAIN, ROWS, _span(8), CORE)
    assert (eight.in_node_bytes, eight.cross_node_bytes) == (whole, whole * 4 / 8)
    sixteen = dispatch_bytes(V3, TRAIN, ROWS, _span(16), CORE)   # 8 nodes reachable: no saving
    assert sixteen.cross_node_bytes == whole
    # every routed row alone without a per-node dispatcher (comm's plain split)
    plain = dispatch_bytes(V3, TRAIN, ROWS, _span(8), replace(CORE, framework=RUNTIME))
    assert (plain.in_node_bytes, plain.cross_node_bytes) == (whole / 8, whole)


def test_without_groups_a_token_reaches_the_nodes_its_experts_lie_on_on_average():
    """Unlimited routing over 256 experts on 8 nodes (32 a node), top-8: a node holds none of a
    token's experts with probability C(224, 8) / C(256, 8) = 0.338, so a per-node dispatcher
    (DeepEP) sends 8 x 0.662 = 5.29 copies, not 8; Qwen3-235B's EP 32 over 4 nodes (128 experts,
    32 a node): 3.63 of 8."""
    from math import comb
    whole = 2 * ROWS * V3.hidden_size
    free = replace(V3, num_expert_groups=1, topk_groups=1)
    nodes = 8 * (1 - comb(224, 8) / comb(256, 8))
    assert token_nodes(free, 8) == pytest.approx(nodes, rel=1e-12) and nodes == pytest.approx(5.295, abs=1e-3)
    spread = dispatch_bytes(free, TRAIN, ROWS, _span(8), CORE)
    assert (spread.in_node_bytes, spread.cross_node_bytes) == (whole, pytest.approx(whole * nodes / 8))
    assert token_nodes(resolve_model("qwen3-235b-a22b"), 4) == pytest.approx(4 * (1 - comb(96, 8) / comb(128, 8)))
    assert token_nodes(free, 1) == pytest.approx(1.0) and token_nodes(V3, 8) == 4   # limited: the bound


def test_the_time_is_comms_all_to_all_where_nothing_is_saved_and_less_where_it_is():
    whole = 2 * ROWS * V3.hidden_size
    runtime = replace(CORE, framework=RUNTIME)
    plain = 2 * collective_time_s(Collective.ALL_TO_ALL, whole, _span(8), runtime)
    assert dispatch_combine_s(V3, TRAIN, ROWS, _span(8), runtime) == plain
    limited = dispatch_combine_s(V3, TRAIN, ROWS, _span(8), CORE)
    assert limited < 0.7 * 2 * collective_time_s(Collective.ALL_TO_ALL, whole, _span(8), CORE)


@pytest.mark.parametrize("nodes, published_gb_s", [(4, 57.0), (8, 50.0)])
def test_across_nodes_the_slower_leg_gives_deepeps_published_internode_rates(nodes, published_gb_s):
    """DeepEP's README table (H800, one 400 Gb/s ConnectX-7 a GPU as on a DGX H100; 4096 tokens
    of DeepSeek-V3's routing, bf16 combine): 57 GB/s at EP 32, 50 at EP 64, bytes counted once
    per node a token reaches (its own included). Its NVLink and RDMA legs overlap, so the time is
    the network leg's on the H100 profile's InfiniBand; the legs in series would give 44 and 39."""
    tokens = 4096
    rows = tokens * V3.experts_per_token
    logical_bytes = dispatch_bytes(V3, TRAIN, rows, _span(nodes), CORE).cross_node_bytes
    one_all_to_all_s = dispatch_combine_s(V3, TRAIN, rows, _span(nodes), CORE) / 2
    assert logical_bytes / one_all_to_all_s / 1e9 == pytest.approx(published_gb_s, rel=0.06)
