"""Hybrid sharding (Plan.dp_replicate, HSDP): ZeRO shards over the shard group of dp / r inner
data-parallel ranks and keeps r replicas; a reduce-scatter inside the group is followed by an
all-reduce of the shard over the replicas. Without it (r = 1) every price is the one before."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.check import check_structure
from costmodel.comm import Collective, collective_time_s
from costmodel.estimate import estimate
from costmodel.frameworks import FRAMEWORKS
from costmodel.hardware import parse_cluster, run_by
from costmodel.memory import state_bytes_for
from costmodel.params import rank_params
from costmodel.plan import Plan
from costmodel.rank_time import DpTerm, dp_groups, dp_term_comm_s, spans
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

MODEL = resolve_model("llama3-8b")
TRAIN = TrainSpec(seq_len=4096, global_batch_size=256)
CLUSTER = run_by(parse_cluster("16x8xH100"), FRAMEWORKS["torchtitan"])   # dp 128 at tp 1


def _plan(r: int, zero: int = 3) -> Plan:
    return build_plan(MODEL, TRAIN, CLUSTER, Choice(zero_stage=zero, micro_batch_size=2, dp_replicate=r))


def test_one_replica_is_the_plan_without_hybrid_sharding():
    plan = _plan(1)
    sp = spans(plan, CLUSTER)
    assert sp.shard == sp.dp and sp.replicas.size == 1 and plan.zero_ranks == plan.dp
    assert "dp_replicate" not in plan.to_dict()
    assert Plan.from_dict(plan.to_dict()) == plan


def test_shard_group_is_a_node_and_the_replicas_one_rank_per_node():
    plan = _plan(16)   # 16 replicas of 8-rank shard groups
    sp = spans(plan, CLUSTER)
    assert (sp.shard.size, sp.shard.num_nodes) == (8, 1)
    assert (sp.replicas.size, sp.replicas.num_nodes, sp.replicas.members_per_node) == (16, 16, 1)
    assert plan.to_dict()["dp_replicate"] == 16 and Plan.from_dict(plan.to_dict()) == plan
    assert plan.short().split()[4] == "hsdp16x8"


def test_states_are_sharded_over_the_shard_group_only():
    full, hybrid = _plan(1), _plan(4)
    n = 1e9
    weights, grads, states = state_bytes_for(TRAIN, full, n)
    weights4, grads4, states4 = state_bytes_for(TRAIN, hybrid, n)
    assert (weights4, grads4, states4) == pytest.approx((4 * weights, 4 * grads, 4 * states))


def test_a_reduce_scatter_adds_the_replicas_all_reduce_of_its_shard():
    plan = _plan(16)
    sp = spans(plan, CLUSTER)
    (params, unit, span), = dp_groups(MODEL, plan, sp, _held(plan), CLUSTER.framework)
    n = 1e8
    term = DpTerm(multiplier=1, collectives=((Collective.REDUCE_SCATTER, 4.0),), window="none")
    got = dp_term_comm_s(term, n, CLUSTER, span, unit) * CLUSTER.device.efficiency.dp_comm
    want = (collective_time_s(Collective.REDUCE_SCATTER, 4 * n, sp.shard, CLUSTER)
            + collective_time_s(Collective.ALL_REDUCE, 4 * n / 8, sp.replicas, CLUSTER))
    assert got == pytest.approx(want)
    gather = DpTerm(multiplier=1, collectives=((Collective.ALL_GATHER, 2.0),), window="none")
    assert dp_term_comm_s(gather, n, CLUSTER, span, unit) * CLUSTER.device.efficiency.dp_comm == \
        pytest.approx(collective_time_s(Collective.ALL_GATHER, 2 * n, sp.shard, CLUSTER))


def _held(plan: Plan):
    return rank_params(MODEL, plan, 0, CLUSTER.framework)


def test_hybrid_sharding_trades_memory_for_network_traffic():
    """ZeRO-3 gathers inside a node instead of over 16 nodes: less exposed DP time, more states."""
    full, hybrid = estimate(MODEL, TRAIN, CLUSTER, _plan(1)), estimate(MODEL, TRAIN, CLUSTER, _plan(16))
    assert hybrid.time_breakdown_s["comm/dp_exposed"] < full.time_breakdown_s["comm/dp_exposed"]
    assert max(hybrid.peak_memory_bytes) > max(full.peak_memory_bytes)


@pytest.mark.parametrize("change, framework, why", [
    (dict(dp_replicate=2), "megatron-lm", "megatron-lm does not shard over part of the data-parallel ranks"),
    (dict(dp_replicate=2), "megatron-core", "megatron-core shards over part of the data-parallel ranks at ZeRO-1 only"),
    (dict(dp_replicate=3), "torchtitan", "must divide dp=128"),
    (dict(dp_replicate=128), "torchtitan", "leave a shard group of at least 2 ranks"),
    (dict(dp_replicate=2, zero_stage=0), "torchtitan", "needs ZeRO >= 1"),
])
def test_a_plan_hybrid_sharding_cannot_run_is_named(change, framework, why):
    cluster = run_by(parse_cluster("16x8xH100"), FRAMEWORKS[framework])
    plan = replace(_plan(1), **change)
    problems = [p for p in check_structure(MODEL, TRAIN, cluster, plan) if "hybrid sharding" in p]
    assert len(problems) == 1 and why in problems[0], problems


def test_experts_are_not_hybrid_sharded():
    model = resolve_model("mixtral-8x7b")
    plan = replace(build_plan(model, TRAIN, CLUSTER, Choice(zero_stage=1, micro_batch_size=2)), dp_replicate=2)
    assert any("experts' hybrid sharding is not modelled" in p for p in check_structure(model, TRAIN, CLUSTER, plan))
