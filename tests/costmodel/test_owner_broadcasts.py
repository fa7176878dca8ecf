"""InternEvo's hybrid ZeRO-1 (costmodel.frameworks `owner_broadcasts`): the gradients all-reduced
whole over every data-parallel rank during the last backward, and the updated weights made whole
by one broadcast per ZeRO rank after the step (costmodel.comm: owner_broadcasts_s), over all the
data-parallel ranks or over part of them (`zero1 = 8`: Plan.dp_replicate)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.check_degrees import hsdp_problems
from costmodel.comm import Collective, collective_time_s, owner_broadcasts_s
from costmodel.estimate import estimate
from costmodel.frameworks import FRAMEWORKS
from costmodel.hardware import parse_cluster, run_by
from costmodel.params import rank_params
from costmodel.placement import AxisSpan
from costmodel.plan import Recompute
from costmodel.rank_time.dp_terms import dp_groups, dp_term_comm_s, dp_terms
from costmodel.rank_time.spans import spans
from costmodel.registry import resolve_model
from costmodel.specs import DType, TrainSpec
from planner.space import Choice, build_plan

CLUSTER = parse_cluster("128x8xA100")
MODEL = resolve_model("llama-7b")
TRAIN = TrainSpec(seq_len=2048, global_batch_size=8192, grad_dtype=DType.BF16)


def _pass_latency_s(span: AxisSpan) -> float:
    """One ring pass through the span's ranks: NCCL's base latency once, a step a rank (the
    network's between nodes)."""
    intra = CLUSTER.device.intra_node
    if span.num_nodes == 1:
        return intra.base_latency_s + (span.size - 1) * intra.latency_s
    inter = CLUSTER.device.tier_for(span.num_nodes, span.same_rail)
    hops = (span.size - span.num_nodes) * intra.latency_s + (span.num_nodes - 1) * inter.latency_s
    return max(intra.base_latency_s, inter.base_latency_s) + hops


@pytest.mark.parametrize("span", [AxisSpan(size=8, members_per_node=8, num_nodes=1),
                                  AxisSpan(size=256, members_per_node=8, num_nodes=32),
                                  AxisSpan(size=1024, members_per_node=8, num_nodes=128)])
def test_n_broadcasts_move_an_all_gathers_bytes_and_pay_a_pass_each(span):
    num_bytes = 14e9
    transfer = (collective_time_s(Collective.ALL_GATHER, 2 * num_bytes, span, CLUSTER)
                - collective_time_s(Collective.ALL_GATHER, num_bytes, span, CLUSTER))
    broadcasts = owner_broadcasts_s(num_bytes, span, CLUSTER)
    assert broadcasts == pytest.approx(transfer + span.size * _pass_latency_s(span))
    assert collective_time_s(Collective.OWNER_BROADCASTS, num_bytes, span, CLUSTER) == broadcasts


def test_the_broadcasts_latency_grows_with_the_square_of_the_ranks():
    """An all-gather's latency grows with the ranks; n broadcasts pay n of them."""
    def extra_s(n):
        span = AxisSpan(size=n, members_per_node=8, num_nodes=n // 8)
        return (owner_broadcasts_s(1e9, span, CLUSTER)
                - collective_time_s(Collective.ALL_GATHER, 1e9, span, CLUSTER))
    assert extra_s(1024) / extra_s(256) > 12


def _plan(dp_replicate: int = 1, zero: int = 1):
    cluster = run_by(CLUSTER, FRAMEWORKS["internevo"])
    choice = Choice(tp=1, pp=1, zero_stage=zero, micro_batch_size=2, recompute=Recompute.NONE,
                    dp_replicate=dp_replicate)
    return cluster, build_plan(MODEL, TRAIN, cluster, choice)


def test_zero1_all_reduces_the_gradients_and_broadcasts_the_weights_after_the_step():
    cluster, plan = _plan()
    terms = [t for t in dp_terms(MODEL, TRAIN, plan, cluster) if t.scale == 1.0]
    assert [(t.collectives, t.window) for t in terms] == [
        (((Collective.ALL_REDUCE, 2),), "backward"), (((Collective.OWNER_BROADCASTS, 2),), "none")]


def test_zero1_within_a_node_keeps_the_all_reduce_over_every_rank_and_the_broadcasts_in_the_node():
    """zero1 = 8 (dp_replicate = dp / 8): the same all-reduce, the broadcasts over NVLink."""
    cluster, whole = _plan()
    _, in_node = _plan(dp_replicate=128)
    exposed = {name: estimate(MODEL, TRAIN, cluster, plan).time_breakdown_s["comm/dp_exposed"]
               for name, plan in (("all", whole), ("node", in_node))}
    assert exposed["node"] < exposed["all"] / 10
    # the gradients' all-reduce spans all 1,024 ranks in both (128 nodes), not the 8 of a shard group
    sp = spans(in_node, cluster)
    assert sp.shard.num_nodes == 1 and sp.dp.num_nodes == 128
    held = rank_params(MODEL, in_node, 0, cluster.framework)
    (n, unit, span), = dp_groups(MODEL, in_node, sp, held, cluster.framework)
    reduce = next(t for t in dp_terms(MODEL, TRAIN, in_node, cluster) if t.collectives[0][0] is Collective.ALL_REDUCE)
    assert dp_term_comm_s(reduce, n, cluster, span, unit) == pytest.approx(
        collective_time_s(Collective.ALL_REDUCE, 2 * n, sp.dp, cluster) / cluster.device.efficiency.dp_comm)
    # a Megatron-style partial optimizer reduce-scatters in the group, all-reduces the shard: cheaper still
    megatron = run_by(CLUSTER, replace(FRAMEWORKS["internevo"], owner_broadcasts=False))
    assert estimate(MODEL, TRAIN, megatron, in_node).time_breakdown_s["comm/dp_exposed"] < exposed["node"]


def test_internevo_shards_over_part_of_the_ranks_at_zero1_only():
    traits = FRAMEWORKS["internevo"]
    assert hsdp_problems(MODEL, 1024, 128, 1, traits) == []
    assert "at ZeRO-1 only" in hsdp_problems(MODEL, 1024, 128, 2, traits)[0]


def test_broadcasts_with_one_rank_a_node_stay_on_the_ring():
    """NCCL broadcasts along its ring; PAT gathers only: with one rank a node the broadcasts are
    the ring's transfer and n passes at any size, affine in the bytes (placement dominance
    compares them as such)."""
    span = AxisSpan(size=64, members_per_node=1, num_nodes=64)
    one, two, big = (owner_broadcasts_s(b, span, CLUSTER) for b in (1.0, 2.0, 1e9))
    assert big == pytest.approx(one + (1e9 - 1.0) * (two - one), rel=1e-6)
    assert one == pytest.approx(64 * _pass_latency_s(span), rel=1e-6)
