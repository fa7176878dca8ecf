"""Mixed clusters (costmodel.groups): parsed and written back alike, every pipeline stage on one
device group, each rank priced by its group's profile (a cluster of two alike groups prices a
plan exactly as the uniform cluster does), and each rank's memory against its own device."""
from __future__ import annotations

import dataclasses

import pytest

from costmodel.check import check_structure
from costmodel.estimate import estimate
from costmodel.groups import placement_lines, rank_groups, replica_groups, replica_samples, stages_on
from costmodel.hardware import DeviceGroup, cluster_from_dict, mixed_cluster, parse_cluster
from costmodel.plan import Recompute
from costmodel.registry import resolve_model
from costmodel.schedules import Schedule
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

MODEL = resolve_model("llama-70b")
TRAIN = TrainSpec(seq_len=4096, global_batch_size=1024)


def test_a_mixed_cluster_parses_and_round_trips():
    cluster = parse_cluster("4x8xA100+4x8xH100", group_link_bytes_per_s=12.5e9)
    assert cluster.is_mixed and cluster.world_size == 64 and cluster.num_nodes == 8
    assert [g.device.name for g in cluster.groups] == ["A100-SXM4-80GB", "H100-SXM5-80GB"]
    assert cluster.name == "4x8xA100-SXM4-80GB+4x8xH100-SXM5-80GB"
    assert cluster.group_link.bandwidth_bytes_per_s == 12.5e9
    again = cluster_from_dict(cluster.to_dict())
    assert again.groups == cluster.groups and again.group_link == cluster.group_link
    # a uniform cluster writes no group fields
    assert "groups" not in parse_cluster("8x8xA100").to_dict()


@pytest.mark.parametrize("text,message", [
    ("4x8xA100+4x8xB999", "group '4x8xB999': unknown device 'B999'"),
    ("4x8xA100+0x8xH100", "node and device counts must be positive (group '0x8xH100')"),
    ("4x8xA100+4x4xH100", "every group needs the same devices per node"),
    ("1x8xA100+1x8xH100+1x8xA100+1x8xH100+1x8xA100", "at most 4 groups"),
])
def test_bad_mixed_clusters_say_which_group(text, message):
    with pytest.raises(ValueError, match=None) as err:
        parse_cluster(text)
    assert message in str(err.value)


def test_a_link_between_groups_needs_two_groups():
    with pytest.raises(ValueError, match="needs a mixed cluster"):
        parse_cluster("8x8xA100", group_link_bytes_per_s=25e9)


def _plan(cluster, **fields):
    choice = dict(tp=2, pp=8, zero_stage=1, sequence_parallel=True, schedule=Schedule.ONE_F_ONE_B)
    choice.update(fields)
    return build_plan(MODEL, TRAIN, cluster, Choice(**choice))


def test_two_alike_groups_price_a_plan_as_the_uniform_cluster():
    uniform = parse_cluster("8x8xA100")
    a100 = uniform.device
    mixed = mixed_cluster([DeviceGroup(device=a100, num_nodes=4), DeviceGroup(device=a100, num_nodes=4)], 8,
                          a100.inter_node.bandwidth_bytes_per_s)
    plan = _plan(uniform)
    one, two = estimate(MODEL, TRAIN, uniform, plan), estimate(MODEL, TRAIN, mixed, plan)
    assert two.step_time_s == pytest.approx(one.step_time_s, rel=1e-12)
    assert two.peak_memory_bytes == pytest.approx(one.peak_memory_bytes, rel=1e-12)
    assert two.rank_groups == [0, 0, 0, 0, 1, 1, 1, 1]


def test_each_rank_is_priced_by_its_group():
    cluster = parse_cluster("4x8xA100+4x8xH100")
    plan = _plan(cluster)
    est = estimate(MODEL, TRAIN, cluster, plan)
    times = est.rank_time_per_micro_batch_s
    # even split: the A100 stages (first four) are the slow ones and set the step
    assert min(times[:4]) > max(times[4:])
    assert est.rank_groups == [0, 0, 0, 0, 1, 1, 1, 1]
    caps = est.memory_capacity_per_rank_bytes
    assert caps[0] == parse_cluster("8x8xA100").memory_budget_bytes
    assert caps[7] == parse_cluster("8x8xH100").memory_budget_bytes
    assert stages_on(plan, cluster) == "A100:0-3 H100:4-7"
    flipped = dataclasses.replace(plan, group_order=(1, 0))
    assert stages_on(flipped, cluster) == "H100:0-3 A100:4-7"
    assert estimate(MODEL, TRAIN, cluster, flipped).rank_groups == [1, 1, 1, 1, 0, 0, 0, 0]
    lines = placement_lines(plan, cluster, TRAIN.global_batch_size)
    assert lines[0].startswith("stages 0-3 on 4x8xA100-SXM4-80GB: 40 layers")


def test_a_stage_across_two_groups_is_refused():
    cluster = parse_cluster("4x8xA100+4x8xH100")
    # dp outermost puts each pipeline across the groups
    plan = _plan(cluster, mesh_axis_order=("dp", "pp", "cp", "tp"))
    assert None in rank_groups(plan, cluster)
    assert any("a pipeline stage spans two device groups" in p for p in check_structure(MODEL, TRAIN, cluster, plan))
    # without a pipeline each replica must lie in one group: one replica of tp8 x cp8 spans both
    plan = _plan(cluster, pp=1, tp=8, cp=8, zero_stage=3)
    assert replica_groups(plan, cluster) == (None,)
    assert any("a data-parallel replica spans two device groups" in p
               for p in check_structure(MODEL, TRAIN, cluster, plan))
    bad = dataclasses.replace(_plan(cluster), group_order=(0, 0))
    assert any("is not an order of the cluster's 2 groups" in p for p in check_structure(MODEL, TRAIN, cluster, bad))
    uniform = parse_cluster("8x8xA100")
    stray = dataclasses.replace(_plan(uniform), group_order=(1, 0))
    assert any("needs a mixed cluster" in p for p in check_structure(MODEL, TRAIN, uniform, stray))


def test_a_slow_link_between_groups_slows_only_what_crosses_it():
    fast, slow = parse_cluster("4x8xA100+4x8xH100"), parse_cluster("4x8xA100+4x8xH100", group_link_bytes_per_s=1e9)
    plan = _plan(fast)
    a, b = estimate(MODEL, TRAIN, fast, plan), estimate(MODEL, TRAIN, slow, plan)
    assert b.step_time_s > a.step_time_s
    assert b.time_breakdown_s["comm/pp_exposed"] > a.time_breakdown_s["comm/pp_exposed"]
    # the collectives inside a group are the group's own
    for key in ("comm/tp_exposed", "comm/dp_exposed"):
        assert b.time_breakdown_s[key] == pytest.approx(a.time_breakdown_s[key])


def test_replicas_on_two_alike_groups_price_as_the_uniform_cluster():
    """Without a pipeline each group's replicas are priced on their own view: two alike groups
    with equal shares give the uniform cluster's estimate."""
    uniform = parse_cluster("8x8xA100")
    a100 = uniform.device
    mixed = mixed_cluster([DeviceGroup(device=a100, num_nodes=4), DeviceGroup(device=a100, num_nodes=4)], 8,
                          a100.inter_node.bandwidth_bytes_per_s)
    plan = _plan(uniform, pp=1, tp=8, zero_stage=3, micro_batch_size=2)
    one = estimate(MODEL, TRAIN, uniform, plan)
    two = estimate(MODEL, TRAIN, mixed, dataclasses.replace(plan, micro_batch_sizes=(2, 2)))
    assert two.step_time_s == pytest.approx(one.step_time_s, rel=1e-12)
    assert two.peak_memory_bytes == pytest.approx(one.peak_memory_bytes, rel=1e-12)
    assert [s["replicas"] for s in two.group_shares] == [4, 4]


def test_uneven_shares_move_work_to_the_faster_group():
    cluster = parse_cluster("4x8xA100+4x8xH100")
    base = _plan(cluster, pp=1, tp=8, zero_stage=3, recompute=Recompute.FULL, micro_batch_size=4)
    even = estimate(MODEL, TRAIN, cluster, base)
    times = {s["group"]: s["step_time_s"] for s in even.group_shares}
    assert times[0] > times[1]   # the A100s set the step
    # a quarter of the batch on the A100s: 4 replicas x 2 + 4 x 6, x 32 micro-batches = 1024
    uneven = dataclasses.replace(base, micro_batch_size=6, micro_batch_sizes=(2, 6), num_micro_batches=32)
    assert not check_structure(MODEL, TRAIN, cluster, uneven)
    assert replica_samples(uneven, cluster) == [64] * 4 + [192] * 4
    est = estimate(MODEL, TRAIN, cluster, uneven)
    assert est.step_time_s < even.step_time_s
    assert est.step_time_s == max(s["step_time_s"] for s in est.group_shares)
    assert "A100:mbs2 H100:mbs6" == stages_on(uneven, cluster)
    short = dataclasses.replace(uneven, num_micro_batches=16)
    assert any("do not add up to the global batch 1024" in p for p in check_structure(MODEL, TRAIN, cluster, short))
