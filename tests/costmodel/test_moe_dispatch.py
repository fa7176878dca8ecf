"""Node-limited routing's all-to-all (costmodel.moe_dispatch): the bytes a token puts on the
network are bounded by the nodes its experts can lie on, under a per-node dispatcher."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.comm import Collective, collective_time_s
from costmodel.frameworks import FRAMEWORKS, RUNTIME
from costmodel.hardware import parse_cluster
from costmodel.moe_dispatch import dispatch_bytes, dispatch_combine_s, routing_nodes
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
    # every routed row alone: without a per-node dispatcher, or without groups (comm's plain split)
    for model, cluster in ((V3, replace(CORE, framework=RUNTIME)),
                           (replace(V3, num_expert_groups=1, topk_groups=1), CORE)):
        plain = dispatch_bytes(model, TRAIN, ROWS, _span(8), cluster)
        assert (plain.in_node_bytes, plain.cross_node_bytes) == (whole / 8, whole)


def test_the_time_is_comms_all_to_all_where_nothing_is_saved_and_less_where_it_is():
    whole = 2 * ROWS * V3.hidden_size
    runtime = replace(CORE, framework=RUNTIME)
    plain = 2 * collective_time_s(Collective.ALL_TO_ALL, whole, _span(8), runtime)
    assert dispatch_combine_s(V3, TRAIN, ROWS, _span(8), runtime) == plain
    limited = dispatch_combine_s(V3, TRAIN, ROWS, _span(8), CORE)
    assert limited < 0.7 * 2 * collective_time_s(Collective.ALL_TO_ALL, whole, _span(8), CORE)
