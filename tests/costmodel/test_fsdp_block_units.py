"""FSDP frameworks wrap each transformer block as a unit at every stage that shards
(`fsdp_block_units`): under ZeRO-2 (FSDP1's SHARD_GRAD_OP, FSDP2 without resharding after the
forward) each block still gathers its weights and reduce-scatters its gradients on its own, so a
step pays a ring's latency per block and collective, which grows with the ranks (NCCL's ring:
nRanks - 1 steps); ZeRO-0 is DDP's bucketed all-reduce."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.comm import Collective, collective_time_s
from costmodel.estimate import estimate
from costmodel.frameworks import FRAMEWORKS
from costmodel.hardware import parse_cluster, run_by
from costmodel.placement import AxisSpan
from costmodel.rank_time.dp_terms import copies_out, dp_terms
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

MODEL = resolve_model("llama2-7b")
TRAIN = TrainSpec(seq_len=2048, global_batch_size=4096)


def _plan(framework: str, nodes: int, zero: int):
    cluster = run_by(parse_cluster(f"{nodes}x8xH100"), FRAMEWORKS[framework])
    return cluster, build_plan(MODEL, TRAIN, cluster, Choice(zero_stage=zero, micro_batch_size=1))


@pytest.mark.parametrize("framework", ["composer-fsdp", "fms-fsdp", "torchtitan"])
def test_fsdp_frameworks_synchronise_zero2_a_block_at_a_time(framework):
    assert FRAMEWORKS[framework].fsdp_block_units
    cluster, plan = _plan(framework, 16, 2)
    # FSDP2's copy-outs (torchtitan's) are device work beside the gathers, in no collective
    assert {t.pieces_per_layer for t in dp_terms(MODEL, TRAIN, plan, cluster) if not copies_out(t)} == {1}
    cluster, plan = _plan(framework, 16, 0)
    assert {t.pieces_per_layer for t in dp_terms(MODEL, TRAIN, plan, cluster)} == {0}


def test_a_zero2_step_pays_each_blocks_ring_latency_and_more_with_more_ranks():
    """An FSDP ZeRO-2 step is slower than with one bucketed gather and reduction a step (each
    block's collectives pay the ring's latency, partly hidden behind compute), by more than one
    ring's latency at 64 nodes and by more there than at 16, as the ring's steps grow."""
    gaps = []
    for nodes in (16, 64):
        cluster, plan = _plan("composer-fsdp", nodes, 2)
        bucketed = run_by(cluster, replace(FRAMEWORKS["composer-fsdp"], fsdp_block_units=False))
        per_block = estimate(MODEL, TRAIN, cluster, plan).step_time_s
        gaps.append(per_block - estimate(MODEL, TRAIN, bucketed, plan).step_time_s)
    span = AxisSpan(size=512, members_per_node=8, num_nodes=64)
    one_ring_s = collective_time_s(Collective.ALL_GATHER, 1.0, span, cluster)   # latency alone
    assert 0 < gaps[0] < gaps[1]
    assert gaps[1] > one_ring_s
