"""Megatron-Core's interleaved schedule with overlap_p2p_comm waits for its activation sends and
for the warm-up's and flush's, and runs the steady state's gradient sends beside its compute
(costmodel.frameworks `steady_sends_overlap`): a step pays its activation sends whole, and of its
gradient sends the share the first rank's flush holds, 2(p-1) + (v-1)·p of its m·v chunks, whole
and the rest at the device's comm_contention, as a DP or TP collective hidden behind compute."""
from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.frameworks import FRAMEWORKS
from costmodel.hardware import parse_cluster, run_by
from costmodel.rank_time.layer_comm import send_cost_share
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

MODEL = resolve_model("llama2-13b")
CORE = FRAMEWORKS["megatron-core"]


def test_the_share_is_the_flush_of_the_first_rank_and_the_rest_contended():
    # p 8, v 12: 2·7 + 11·8 = 102 of the first rank's 128·12 chunks are its flush
    waited = 102 / (128 * 12)
    assert send_cost_share(8, 12, 128, 0.0) == pytest.approx(waited)
    assert send_cost_share(8, 12, 128, 0.3) == pytest.approx(waited + (1 - waited) * 0.3)
    assert send_cost_share(8, 12, 8, 0.3) == 1.0      # 96 chunks: all warm-up and flush
    assert send_cost_share(8, 12, 128, 1.0) == 1.0    # a framework that waits for every send
    assert send_cost_share(8, 1, 128, 0.3) == 1.0     # 1F1B: Megatron turns the overlap off


# dp 4: 4 and 64 micro-batches of 5 chunks, 2·3 + 4·4 = 22 of them the first rank's flush
@pytest.mark.parametrize("gbs,waited", [(16, 1.0), (256, 22 / 320)])
def test_an_interleaved_step_pays_its_activation_sends_and_that_share_of_its_gradient_sends(gbs, waited):
    train = TrainSpec(seq_len=4096, global_batch_size=gbs)
    cluster = parse_cluster("4x8xH100")
    plan = build_plan(MODEL, train, run_by(cluster, CORE),
                      Choice(tp=2, pp=4, vpp=5, micro_batch_size=1, sequence_parallel=True, zero_stage=1))
    contention = cluster.device.efficiency.comm_contention
    share = send_cost_share(plan.pp, plan.vpp, plan.num_micro_batches, contention)
    assert share == pytest.approx(waited + (1 - waited) * contention)
    paid = {}
    for name, traits in (("overlap", CORE), ("every send", replace(CORE, steady_sends_overlap=False))):
        for simulate in (True, False):
            est = estimate(MODEL, train, run_by(cluster, traits), plan, simulate=simulate)
            assert est.critical_rank == plan.pp - 1   # the last rank, the LM head's
            paid[name, simulate] = est.time_breakdown_s["comm/pp_exposed"]
    # the last rank sends v - 1 activations a micro-batch (its last chunk's output goes nowhere) and
    # v gradients, all of one size: the activations paid whole, the gradients at the share
    v = plan.vpp
    for simulate in (True, False):
        assert paid["every send", simulate] > 0
        assert paid["overlap", simulate] == pytest.approx(
            ((v - 1) + v * share) / (2 * v - 1) * paid["every send", simulate], rel=1e-9)
