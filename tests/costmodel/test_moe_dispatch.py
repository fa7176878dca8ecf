"""The expert all-to-all under a per-node dispatcher (costmodel.moe_dispatch): the bytes a token
puts on the network are those of the nodes its experts lie on, bounded under node-limited routing
and on average otherwise."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.comm import Collective, collective_time_s
from costmodel.frameworks import FRAMEWORKS, RUNTIME
from costmodel.hardware import parse_cluster
from costmodel.moe_dispatch import dispatch_bytes, dispatch_combine_s, routing_nodes, token_nodes, token_ranks
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


def test_cross_node_bytes_are_a_copy_per_node_a_token_reaches():
    whole = 2 * ROWS * V3.hidden_size       # bf16
    eight = dispatch_bytes(V3, TRAIN, ROWS, _span(8), CORE)
    assert eight.cross_node_bytes == whole * 4 / 8
    assert eight.in_node_bytes == pytest.approx(whole * token_ranks(V3, _span(8)) / 8)
    sixteen = dispatch_bytes(V3, TRAIN, ROWS, _span(16), CORE)   # 8 nodes reachable, about 6 reached
    assert sixteen.cross_node_bytes == pytest.approx(whole * token_nodes(V3, 16) / 8) and token_nodes(V3, 16) < 6.1
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
    assert spread.cross_node_bytes == pytest.approx(whole * nodes / 8)
    assert token_nodes(resolve_model("qwen3-235b-a22b"), 4) == pytest.approx(4 * (1 - comb(96, 8) / comb(128, 8)))
    assert token_nodes(free, 1) == pytest.approx(1.0) and token_nodes(V3, 8) == 4   # limited: the bound


def test_where_groups_share_a_node_a_token_reaches_the_nodes_its_chosen_groups_lie_on():
    """DeepSeek-V3's 4 of 8 groups over 4 nodes (2 groups a node): a node holds none of the
    chosen groups with probability C(6, 4) / C(8, 4), so 4 x (1 - 15/70) = 3.14 nodes, not the
    bound's 4; over 2 nodes 2 x (1 - 1/70); over 8 or more nodes a group a node, the bound."""
    from math import comb
    assert token_nodes(V3, 4) == pytest.approx(4 * (1 - comb(6, 4) / comb(8, 4)))
    assert token_nodes(V3, 2) == pytest.approx(2 * (1 - 1 / comb(8, 4)))
    assert token_nodes(V3, 4) < routing_nodes(V3, 4) == 4


@pytest.mark.parametrize("nodes, copies", [(8, 4.0), (16, 4 * 2 * (1 - 16 / 32 * 15 / 31)),
                                           (32, 4 * 4 * (1 - 24 / 32 * 23 / 31))])
def test_where_a_group_spans_nodes_each_chosen_group_holds_top_k_over_topk_groups_experts(nodes, copies):
    """The router picks DeepSeek-V3's 4 groups by their best experts, so each holds about 2 of a
    token's 8, spread over the group's nodes: over 16 nodes (a group on 2) 6.06 copies, not the
    8 the groups could reach; over 32, 7.10 (V3's router simulated:
    test_the_spread_is_what_v3_s_router_reaches_within_6_percent). The ranks of an EP 8 group (a
    group a rank) alike: 4."""
    assert token_nodes(V3, nodes) == pytest.approx(copies, rel=1e-12)
    assert routing_nodes(V3, nodes) >= token_nodes(V3, nodes)
    assert token_ranks(V3, _span(1)) == pytest.approx(4.0)


def _v3_router_nodes(nodes: int, tokens: int = 20_000) -> float:
    """DeepSeek-V3's router (arXiv 2412.19437 Sec. 2.1.2) on random sigmoid scores: each group
    scored by the sum of its top 2 experts, the best topk_groups groups kept, the top_k experts
    within them; the mean number of the EP group's nodes (experts consecutive on them) a token
    reaches."""
    import numpy as np
    e, g, c, k = V3.num_experts, V3.num_expert_groups, V3.topk_groups, V3.experts_per_token
    scores = 1 / (1 + np.exp(-np.random.default_rng(0).normal(size=(tokens, e))))
    grouped = scores.reshape(tokens, g, e // g)
    group_score = np.sort(grouped, axis=2)[:, :, -2:].sum(axis=2)
    kept = np.zeros((tokens, g), bool)
    np.put_along_axis(kept, np.argsort(-group_score, axis=1)[:, :c], True, axis=1)
    chosen = np.argsort(-np.where(np.repeat(kept, e // g, axis=1), scores, -1.0), axis=1)[:, :k]
    node = chosen // (e // nodes)
    return float(np.mean([len(set(row)) for row in node]))


def test_the_spread_is_what_v3_s_router_reaches_within_6_percent():
    """The expected copies token_nodes prices against V3's router simulated (_v3_router_nodes):
    3.97, 5.73 and 6.85 nodes over 8, 16 and 32 nodes, against the 4, 6.06 and 7.10 priced (the
    bound said 4, 8 and 8): the spread counts each chosen group's 2 experts as drawn at random,
    where the router's 2 of a group fall on one node a little more often."""
    for nodes in (8, 16, 32):
        simulated = _v3_router_nodes(nodes)
        assert token_nodes(V3, nodes) == pytest.approx(simulated, rel=0.06)
        assert routing_nodes(V3, nodes) > simulated * 1.15 or nodes == 8


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


def test_a_per_node_dispatcher_delivers_a_token_once_to_each_rank_its_experts_lie_on():
    """DeepEP and Hybrid-EP send a token once to each rank holding some of its experts, which
    permutes it to them: Qwen3-30B-A3B's top-8 of 128 experts over EP 16 (8 a rank) reach
    16 x (1 - C(120, 8) / C(128, 8)) = 6.60 ranks, not 8; DeepSeek-V3's node-limited routing
    puts about 2 of its 8 in each of its 4 groups, over the group's 8 ranks at EP 64, on the
    group's rank on one node (a group a rank)."""
    from math import comb
    qwen = resolve_model("qwen3-30b-a3b")
    assert token_ranks(qwen, _span(2)) == pytest.approx(16 * (1 - comb(120, 8) / comb(128, 8)))
    assert token_ranks(qwen, _span(2)) == pytest.approx(6.597, abs=1e-3)
    assert token_ranks(V3, _span(8)) == pytest.approx(4 * 8 * (1 - 28 / 32 * 27 / 31))
    assert token_ranks(V3, _span(1)) == pytest.approx(4.0)
    assert token_ranks(V3, AxisSpan(size=4, members_per_node=4, num_nodes=1)) <= 4
    whole = 2 * ROWS * qwen.hidden_size
    assert dispatch_bytes(qwen, TRAIN, ROWS, _span(2), CORE).in_node_bytes == pytest.approx(whole * 6.597 / 8, rel=1e-3)


# Hybrid-EP's H100 table (DeepEP hybrid-ep branch, docs/README_Hybrid-EP.md): 4096 tokens, hidden
# 7168, top-8 of 128 experts (8 a rank), 8 and 16 SMs, bf16 dispatch and combine, GB/s of bytes
# counted once per node a token reaches (tests/test_hybrid_ep.py). Over 4 and 8 nodes, where the
# network leg binds, the kernels' time; over 2, where the forwarding binds, its torch API's (what
# Megatron-Core calls: dispatch at 8 and 16 SMs, then combine), less the copy of the rank's
# deliveries the model prices as the permutation (_less_copy_gb_s)
HYBRID_EP_H100_GB_S = {4: (54.5, 57.69), 8: (49.77, 51.03)}
HYBRID_EP_H100_TORCH_API_EP16_GB_S = (57.74, 54.47, 56.96, 53.35)
QWEN_LIKE = replace(resolve_model("qwen3-235b-a22b"), hidden_size=7168)   # the table's shape


def _less_copy_gb_s() -> list[float]:
    """The torch API's EP 16 rates without the copy of the rank's deliveries out of (into) the
    buffer that its call without permute makes (csrc/hybrid_ep/executor/executor.cu), read and
    written at the profile's memory-bound rate: 61-67 GB/s."""
    m, dev = QWEN_LIKE, CORE.device
    counted = 4096 * token_nodes(m, 2) * m.hidden_size * 2
    copy_s = 2 * 4096 * token_ranks(m, _span(2)) * m.hidden_size * 2 / (
        dev.memory_bandwidth_bytes_per_s * dev.efficiency.memory)
    return [counted / (counted / (rate * 1e9) - copy_s) / 1e9 for rate in HYBRID_EP_H100_TORCH_API_EP16_GB_S]


def test_the_forwarding_rate_is_hybrid_eps_torch_api_less_its_copy():
    """The H100 profile's forward_bytes_per_s is the mean of those rates in bytes a GPU receives
    (token_ranks deliveries for token_nodes counted a token)."""
    rates = _less_copy_gb_s()
    assert 60 < min(rates) and max(rates) < 68
    per_token = token_ranks(QWEN_LIKE, _span(2)) / token_nodes(QWEN_LIKE, 2)
    assert CORE.device.intra_node.forward_bytes_per_s == pytest.approx(1e9 * per_token * sum(rates) / 4, rel=0.01)


@pytest.mark.parametrize("nodes", [2, 4, 8])
def test_the_forwarding_leg_binds_at_two_nodes_as_hybrid_eps_h100_table_shows(nodes):
    """Over 2 nodes the NVLink forwarding (the H100 profile's forward_bytes_per_s) is the slower
    leg, below the 85 GB/s InfiniBand alone would give; over 4 and 8 the network leg is."""
    model = QWEN_LIKE
    rows = 4096 * model.experts_per_token
    counted = 2 * 4096 * token_nodes(model, nodes) * model.hidden_size
    rate_gb_s = counted / (dispatch_combine_s(model, TRAIN, rows, _span(nodes), CORE) / 2) / 1e9
    low, high = (min(_less_copy_gb_s()), max(_less_copy_gb_s())) if nodes == 2 else HYBRID_EP_H100_GB_S[nodes]
    assert low * 0.94 <= rate_gb_s <= high * 1.06   # as DeepEP's rates above
    network_alone = replace(CORE, device=replace(CORE.device, intra_node=replace(
        CORE.device.intra_node, forward_bytes_per_s=1e15)))
    faster = counted / (dispatch_combine_s(model, TRAIN, rows, _span(nodes), network_alone) / 2) / 1e9
    assert (faster > 1.1 * rate_gb_s) == (nodes == 2)


def test_within_a_node_a_per_node_dispatcher_moves_its_deliveries_not_every_routed_copy():
    """One node, no network leg: the all-to-all of the rows a rank delivers (token_ranks per
    token), not of top_k copies a token as Megatron's alltoall dispatcher sends; the export then
    writes the flex dispatcher (needs_per_node_dispatcher), and the all-to-all one only where
    both move the same bytes (Mixtral's top-2 of 8 experts over EP 8: one expert a rank)."""
    from costmodel.moe_dispatch import needs_per_node_dispatcher
    qwen = resolve_model("qwen3-30b-a3b")
    whole = 2 * ROWS * qwen.hidden_size
    delivered = whole * token_ranks(qwen, _span(1)) / qwen.experts_per_token
    assert delivered < 0.7 * whole
    assert dispatch_combine_s(qwen, TRAIN, ROWS, _span(1), CORE) == pytest.approx(
        2 * collective_time_s(Collective.ALL_TO_ALL, delivered, _span(1), CORE))
    plain = replace(CORE, framework=RUNTIME)
    assert dispatch_combine_s(qwen, TRAIN, ROWS, _span(1), plain) == pytest.approx(
        2 * collective_time_s(Collective.ALL_TO_ALL, whole, _span(1), plain))
    mixtral = resolve_model("mixtral-8x7b")
    assert needs_per_node_dispatcher(qwen, CORE, _span(1)) and needs_per_node_dispatcher(V3, CORE, _span(1))
    assert not needs_per_node_dispatcher(mixtral, CORE, _span(1)) and needs_per_node_dispatcher(mixtral, CORE, _span(2))
    assert not needs_per_node_dispatcher(qwen, plain, _span(2))


@pytest.mark.parametrize("old, new", [
    ("forward_bytes_per_s = 212e9", 'forward_bytes_per_s = "fast"'),
    ("forward_bytes_per_s = 212e9", "forward_bytes_per_s = -1.0"),
    ('name = "ib-ndr"', 'name = "ib-ndr"\nforward_bytes_per_s = 100e9')])
def test_a_forwarding_rate_is_a_positive_rate_of_the_node_tier(tmp_path, old, new):
    """The profile boundary: a forwarding rate that is not a number, is negative or sits on
    another tier than the node's is refused with the file and the key named."""
    from costmodel.hardware import load_profile, profile_dir
    from costmodel.inputs import UserError
    text = (profile_dir() / "H100-SXM5-80GB.toml").read_text()
    assert old in text
    path = tmp_path / "odd.toml"
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(UserError, match="forward_bytes_per_s") as err:
        load_profile(path)
    assert str(path) in str(err.value)
