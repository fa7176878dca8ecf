"""FSDP2 copies each all-gather's output into the parameters' own tensors on the compute stream
(`fsdp_copy_out`; torch's foreach_all_gather_copy_out): the gathered bytes read and written once
each, after every gather, exposed. FSDP1 and Megatron gather into the buffer the parameters view.
How often it gathers is the framework's: torchtitan's ZeRO-2 again for every micro-batch
(`reshards_after_backward`), our runtime's once a step."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.frameworks import FRAMEWORKS, RUNTIME
from costmodel.hardware import parse_cluster, run_by
from costmodel.kernels.optimizer import COPY_OUT_PASSES
from costmodel.params import rank_params
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

MODEL = resolve_model("llama2-13b")
TRAIN = TrainSpec(seq_len=4096, global_batch_size=256)


def _ledger(traits, zero: int, mbs: int):
    cluster = run_by(parse_cluster("8x8xA100"), traits)
    plan = build_plan(MODEL, TRAIN, cluster, Choice(zero_stage=zero, micro_batch_size=mbs))
    return estimate(MODEL, TRAIN, cluster, plan), cluster, plan


@pytest.mark.parametrize("traits", [RUNTIME, FRAMEWORKS["torchtitan"]], ids=lambda t: t.name)
def test_zero3_pays_two_copy_outs_of_the_rank_s_parameters_a_micro_batch(traits):
    """ZeRO-3 gathers a rank's parameters for each micro-batch's forward and again for its
    backward: 2 m copy-outs of all of them, at the profile's memory-bound rate, booked apart and
    added to what the same plan costs without the copy (its collectives unchanged)."""
    est, cluster, plan = _ledger(traits, 3, 1)
    without = _ledger(replace(traits, fsdp_copy_out=False), 3, 1)[0]
    dev = cluster.device
    params = rank_params(MODEL, plan, 0, traits).total
    gathers = 2 * plan.num_micro_batches
    expected = gathers * COPY_OUT_PASSES * 2 * params / (dev.memory_bandwidth_bytes_per_s * dev.efficiency.memory)
    assert plan.num_micro_batches == 4
    copy_s = est.time_breakdown_s["params/fsdp_copy_out"]
    assert copy_s == pytest.approx(expected, rel=1e-6)
    assert without.time_breakdown_s["params/fsdp_copy_out"] == 0.0
    assert est.time_breakdown_s["comm/dp_exposed"] == pytest.approx(without.time_breakdown_s["comm/dp_exposed"])
    assert est.step_time_s == pytest.approx(without.step_time_s + copy_s)
    assert est.closed_form_step_time_s == pytest.approx(without.closed_form_step_time_s + copy_s)


def test_fewer_micro_batches_copy_out_fewer_times():
    """The copy follows the gathers: a larger micro-batch (fewer of them) copies out less."""
    small = _ledger(RUNTIME, 3, 1)[0].time_breakdown_s["params/fsdp_copy_out"]
    large = _ledger(RUNTIME, 3, 4)[0].time_breakdown_s["params/fsdp_copy_out"]
    assert large == pytest.approx(small / 4, rel=1e-6)


@pytest.mark.parametrize("name", ["composer-fsdp", "fms-fsdp", "megatron-core", "deepspeed"])
def test_frameworks_that_gather_into_the_parameters_buffer_copy_nothing(name):
    assert not FRAMEWORKS[name].fsdp_copy_out


def test_torchtitan_s_zero2_gathers_again_for_each_micro_batch_our_runtime_once():
    """torchtitan leaves FSDP2 resharding after every backward that reduces (its train loop never
    calls set_reshard_after_backward), so without a pipeline its ZeRO-2 gathers the parameters for
    each micro-batch's forward, with a copy-out each time; our runtime keeps them gathered until the
    last micro-batch and gathers once a step."""
    titan, _, plan = _ledger(FRAMEWORKS["torchtitan"], 2, 1)
    ours = _ledger(RUNTIME, 2, 1)[0]
    assert plan.num_micro_batches == 4
    once = _ledger(replace(FRAMEWORKS["torchtitan"], reshards_after_backward=False), 2, 1)[0]
    copies = titan.time_breakdown_s["params/fsdp_copy_out"]
    assert copies == pytest.approx(4 * once.time_breakdown_s["params/fsdp_copy_out"], rel=1e-6)
    assert copies == pytest.approx(4 * ours.time_breakdown_s["params/fsdp_copy_out"], rel=1e-6)
    assert titan.step_time_s > once.step_time_s
