"""The cluster's network as a switch graph (costmodel.hardware.fabric): the default fabric prices
every shipped profile's tiers as they are, a rail-optimised or oversubscribed fabric is a
profile change that moves the prices of the groups it concerns, and `[fabric]` is read strictly.

A profile's `[fabric]` table, for example (every key optional but `source`):

    [fabric]
    rail_optimized = true          # leaf i connects NIC i of each node of its block
    nodes_per_leaf = 32            # nodes per leaf switch (per rail switch when rail-optimised)
    spine_oversubscription = 2.0   # leaf downlink over uplink bandwidth: 2:1 halves the spine's
    source = "the cluster's network design document"
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.comm import Collective, collective_time_s
from costmodel.estimate import estimate
from costmodel.hardware import (
    PROFILE_KEYS,
    ClusterSpec,
    Fabric,
    FabricSpec,
    fabric_graph,
    known_profiles,
    load_profile,
    parse_cluster,
)
from costmodel.inputs import UserError
from costmodel.placement import AxisSpan, group_span
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

PROFILES = Path(__file__).resolve().parents[2] / "profiles"
A100 = PROFILES / "A100-SXM4-80GB.toml"
RACK = ('\n[[network]]\nscope = "rack"\nname = "rack switch"\nmax_nodes = 4\n'
        'bandwidth_bytes_per_s = 100e9  # a test figure\nlatency_s = 5e-6\n')


def _profile(tmp_path: Path, table: str, base: Path = A100, name: str = "fabric.toml"):
    path = tmp_path / name
    path.write_text(base.read_text() + "\n[fabric]\n" + table + '\nsource = "a test figure"\n')
    return load_profile(path)


def _tiers_before_the_graph(dev, num_nodes):
    """The rule the graph replaces: the node, the innermost middle tier spanning the group, else
    the cluster tier."""
    if num_nodes <= 1:
        return dev.intra_node
    return next((t for t in dev.middle_tiers if num_nodes <= (t.max_nodes or 0)), dev.inter_node)


def test_the_default_fabric_reproduces_every_shipped_profiles_tiers(tmp_path):
    racked = tmp_path / "racked.toml"
    racked.write_text(A100.read_text() + RACK)
    devices = [*known_profiles().values(), load_profile(racked)]
    assert all(dev.fabric == FabricSpec() for dev in devices)
    for dev in devices:
        for num_nodes in range(1, 65):
            for same_rail in (True, False):
                graph = Fabric(node=dev.intra_node, middle=dev.middle_tiers, cluster=dev.inter_node,
                               spec=dev.fabric).graph_tier(num_nodes, same_rail)
                assert dev.tier_for(num_nodes, same_rail) == graph == _tiers_before_the_graph(dev, num_nodes), \
                    (dev.name, num_nodes, same_rail)
    assert load_profile(racked).tier_for(4).name == "rack switch"


def test_the_graph_holds_gpus_nvlink_domains_leaves_and_a_spine():
    dev = load_profile(A100)
    rails = Fabric(node=dev.intra_node, middle=(), cluster=dev.inter_node, spec=FabricSpec())
    graph = fabric_graph(rails, tuple(range(64)), 8)
    kinds = {}
    for vertex in graph:
        kinds[vertex[0]] = kinds.get(vertex[0], 0) + 1
    assert kinds == {"gpu": 512, "domain": 64, "leaf": 16, "spine": 1}   # 2 blocks of 32 nodes x 8 rails
    leaf = ("leaf", 1, 3)   # rail 3 of nodes 32..63
    assert sorted(v for v in graph[leaf] if v[0] == "gpu") == [("gpu", n, 3) for n in range(32, 64)]
    flat = replace(rails, spec=FabricSpec(rail_optimized=False, nodes_per_leaf=4))
    graph = fabric_graph(flat, tuple(range(64)), 8)
    assert sum(v[0] == "leaf" for v in graph) == 16 and len(graph[("leaf", 0, 0)]) == 4 * 8 + 1


def test_same_rail_traffic_stays_on_its_leaf_and_other_rails_cross_the_spine():
    dev = load_profile(A100)
    rails = Fabric(node=dev.intra_node, middle=(), cluster=dev.inter_node,
                   spec=FabricSpec(spine_oversubscription=2.0))
    assert rails.route(32) == [("gpu", 0, 0), ("leaf", 0, 0), ("gpu", 31, 0)]   # one switch hop
    assert ("spine",) in rails.route(32, same_rail=False) and ("spine",) in rails.route(33)
    assert rails.route(1, same_rail=False) == [("gpu", 0, 0), ("domain", 0), ("gpu", 0, 1)]
    assert rails.tier(32) == dev.inter_node
    across = rails.tier(33)
    assert across.bandwidth_bytes_per_s == dev.inter_node.bandwidth_bytes_per_s / 2
    assert across.latency_s == dev.inter_node.latency_s and rails.tier(8, same_rail=False) == across


def test_a_placement_knows_whether_a_groups_members_share_a_rail():
    # tp fills the node: a data-parallel group holds local rank 0 of every node
    assert group_span(("dp", "tp"), (8, 8), ("dp",), 8).same_rail
    # 3 ranks of tp on 8-GPU nodes: the data-parallel group's members wander over the rails
    assert not group_span(("dp", "tp"), (16, 3), ("dp",), 8).same_rail


def _dp_step(device, num_nodes: int):
    """llama3-8b, data-parallel across every device (ZeRO-1), on `num_nodes` nodes of `device`."""
    model, train = resolve_model("llama3-8b"), TrainSpec(seq_len=4096, global_batch_size=8 * num_nodes)
    cluster = ClusterSpec(device=device, num_nodes=num_nodes, devices_per_node=8)
    plan = build_plan(model, train, cluster, Choice(tp=1, zero_stage=1))
    return estimate(model, train, cluster, plan)


def _dp_comm_s(est) -> float:
    return sum(v for k, v in est.time_breakdown_s.items() if k.startswith("comm/dp"))


def test_an_oversubscribed_spine_slows_the_data_parallel_all_reduce(tmp_path):
    plain = load_profile(A100)
    blocking = _profile(tmp_path, "spine_oversubscription = 2.0")
    even, over = _dp_step(plain, 64), _dp_step(blocking, 64)
    assert _dp_comm_s(over) > _dp_comm_s(even) > 0
    assert over.step_time_s > even.step_time_s
    # a group inside one scalable unit's rail never reaches the spine
    assert _dp_step(blocking, 32).step_time_s == _dp_step(plain, 32).step_time_s


def test_leaves_without_rail_optimisation_put_the_spine_in_a_groups_way(tmp_path):
    """The same switches (32 downlinks per leaf) wired two ways: by rail, a leaf reaches 32 nodes'
    GPU i; by node, 4 nodes' eight NICs. A 16-node data-parallel group stays on its rail's leaf
    in the first and crosses the 2:1 spine in the second."""
    by_rail = _profile(tmp_path, "nodes_per_leaf = 32\nspine_oversubscription = 2.0", name="rail.toml")
    by_node = _profile(tmp_path, "rail_optimized = false\nnodes_per_leaf = 4\nspine_oversubscription = 2.0",
                       name="node.toml")
    rail, node = _dp_step(by_rail, 16), _dp_step(by_node, 16)
    assert _dp_comm_s(node) > _dp_comm_s(rail)
    assert node.step_time_s > rail.step_time_s
    # members on different rails cross the spine whichever way the leaves are wired
    span = AxisSpan(size=16, members_per_node=1, num_nodes=16, same_rail=False)
    t = lambda dev, s: collective_time_s(Collective.ALL_REDUCE, 1e9, s, ClusterSpec(  # noqa: E731
        device=dev, num_nodes=16, devices_per_node=8))
    assert t(by_rail, span) == t(by_node, span) > t(by_rail, replace(span, same_rail=True))


def test_a_profile_with_a_fabric_stays_hashable_and_its_copies_follow_their_tiers(tmp_path):
    dev = _profile(tmp_path, "spine_oversubscription = 2.0")
    assert hash(dev) == hash(replace(dev)) and dev == replace(dev)
    faster = replace(dev, inter_node=replace(dev.inter_node, bandwidth_bytes_per_s=100e9))
    assert faster.tier_for(64).bandwidth_bytes_per_s == 50e9
    assert parse_cluster(f"64x8x{tmp_path / 'fabric.toml'}").device.fabric.spine_oversubscription == 2.0


def test_the_fabric_table_is_read_strictly(tmp_path):
    assert PROFILE_KEYS["fabric"] == {"rail_optimized", "nodes_per_leaf", "spine_oversubscription", "source"}
    with pytest.raises(UserError) as err:
        _profile(tmp_path, "spine_oversubscripton = 2.0")
    assert "\n" not in str(err.value) and "fabric.toml" in str(err.value)
    assert "spine_oversubscripton" in str(err.value) and "[fabric]" in str(err.value)
    path = tmp_path / "sourceless.toml"
    path.write_text(A100.read_text() + "\n[fabric]\nnodes_per_leaf = 16\n")
    with pytest.raises(UserError, match="sourceless.toml.*source"):
        load_profile(path)


@pytest.mark.parametrize("table,message", [
    ("spine_oversubscription = 0.5", "fabric.spine_oversubscription = 0.5 is out of range"),
    ("spine_oversubscription = nan", "fabric.spine_oversubscription = nan is out of range"),
    ("nodes_per_leaf = 0", "fabric.nodes_per_leaf = 0 is out of range"),
    ("nodes_per_leaf = 2.5", "nodes_per_leaf is a whole number"),
    ('rail_optimized = "yes"', "rail_optimized is true or false"),
    ('spine_oversubscription = "2:1"', "spine_oversubscription is a number"),
])
def test_a_bad_fabric_value_is_a_profile_problem(tmp_path, table, message):
    with pytest.raises(UserError) as err:
        _profile(tmp_path, table)
    assert message in str(err.value) and str(err.value).startswith(str(tmp_path / "fabric.toml"))
    assert "\n" not in str(err.value)
