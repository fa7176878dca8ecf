"""Megatron-Core synchronises each model chunk's gradients (and gathers its weights) on its own
(`dp_sync_per_chunk`): interleaved, a chunk's reduce-scatter starts when its last micro-batch's
backward ends and runs behind the other chunks' backward of the schedule's last round. The DP
window then spans (1 + min(m, pp)·(vpp - 1)) / vpp micro-batches' passes instead of one; with
one chunk a rank, or under a framework that syncs the stage whole, it stays one."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.comm import Collective, cross_node_ring_latency_s
from costmodel.estimate import estimate
from costmodel.frameworks import FRAMEWORKS
from costmodel.hardware import parse_cluster, run_by
from costmodel.params import rank_params
from costmodel.rank_time.dp_terms import (
    chunk_collectives,
    chunk_window_micro_batches,
    dp_groups,
    dp_term_comm_s,
    dp_terms,
)
from costmodel.rank_time.spans import spans
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

MODEL = resolve_model("llama-70b")
TRAIN = TrainSpec(seq_len=4096, global_batch_size=512)
CORE = FRAMEWORKS["megatron-core"]


def _plan(cluster, vpp: int):
    return build_plan(MODEL, TRAIN, cluster, Choice(tp=8, pp=4, vpp=vpp, zero_stage=1, micro_batch_size=1,
                                                     sequence_parallel=True))


@pytest.mark.parametrize("m,pp,vpp,expected", [(16, 4, 5, (1 + 4 * 4) / 5), (2, 4, 5, (1 + 2 * 4) / 5),
                                               (16, 4, 1, 1.0)])
def test_the_window_spans_the_last_round_of_the_other_chunks(m, pp, vpp, expected):
    cluster = run_by(parse_cluster("16x8xH100"), CORE)
    plan = replace(_plan(cluster, 5), num_micro_batches=m, pp=pp, vpp=vpp)
    assert chunk_window_micro_batches(plan, CORE) == pytest.approx(expected)
    assert chunk_window_micro_batches(plan, replace(CORE, dp_sync_per_chunk=False)) == 1.0


def test_interleaving_hides_more_of_the_zero1_collectives_under_megatron_core_only():
    cluster = run_by(parse_cluster("16x8xH100"), CORE)
    plan = _plan(cluster, 5)
    spread = chunk_window_micro_batches(plan, CORE)
    assert spread > 1
    assert {t.window_micro_batches for t in dp_terms(MODEL, TRAIN, plan, cluster) if t.window != "none"} == {spread}
    exposed = estimate(MODEL, TRAIN, cluster, plan).time_breakdown_s["comm/dp_exposed"]
    whole = run_by(parse_cluster("16x8xH100"), replace(CORE, dp_sync_per_chunk=False))
    assert exposed < estimate(MODEL, TRAIN, whole, plan).time_breakdown_s["comm/dp_exposed"]


def test_each_chunk_is_a_collective_that_pays_the_ring_latency():
    """Each model chunk's buffer is one reduce-scatter and one gather (Megatron-Core buckets no
    later pipeline rank's buffers, nor an interleaved rank's later chunks): vpp of each kind, the
    same bytes as one over the stage, vpp - 1 more latencies of the ring."""
    cluster = run_by(parse_cluster("64x8xH100"), CORE)
    plan = _plan(cluster, 5)
    assert chunk_collectives(plan) == 5 and chunk_collectives(replace(plan, pp=1, vpp=1)) == 1
    (n, unit, span), = dp_groups(MODEL, plan, spans(plan, cluster), rank_params(MODEL, plan, 1, CORE), CORE)
    group, device = span.group, cluster.device
    checked = set()
    for term in dp_terms(MODEL, TRAIN, plan, cluster):
        kind, _ = term.collectives[0]
        if term.window == "none" or kind not in (Collective.REDUCE_SCATTER, Collective.ALL_GATHER):
            continue
        assert term.units == 5
        latency = cross_node_ring_latency_s(kind, group.size, group.num_nodes, device.intra_node,
                                            device.tier_for(group.num_nodes, group.same_rail))
        extra = (dp_term_comm_s(term, n, cluster, span, unit)
                 - dp_term_comm_s(replace(term, units=1), n, cluster, span, unit))
        assert extra == pytest.approx(4 * latency, rel=1e-6)
        checked.add(kind)
    assert checked == {Collective.REDUCE_SCATTER, Collective.ALL_GATHER}
