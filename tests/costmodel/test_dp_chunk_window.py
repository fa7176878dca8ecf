"""Megatron-Core synchronises each model chunk's gradients (and gathers its weights) on its own
(`dp_sync_per_chunk`): interleaved, a chunk's reduce-scatter starts when its last micro-batch's
backward ends and runs behind the other chunks' backward of the schedule's last round. The DP
window then spans (1 + min(m, pp)·(vpp - 1)) / vpp micro-batches' passes instead of one; with
one chunk a rank, or under a framework that syncs the stage whole, it stays one."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.frameworks import FRAMEWORKS
from costmodel.hardware import parse_cluster, run_by
from costmodel.rank_time.dp_terms import chunk_window_micro_batches, dp_terms
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
