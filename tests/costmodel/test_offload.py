"""Offloaded states (Plan.offload_optimizer, FSDP2's CPUOffloadPolicy): what stays on the device,
what the host holds, the copies each step makes as the runtime makes them, and who may offload."""
from dataclasses import replace

import pytest

from costmodel.check import check_plan
from costmodel.estimate import estimate
from costmodel.hardware import parse_cluster
from costmodel.params import rank_params
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

MODEL = resolve_model("llama3-8b")
TRAIN = TrainSpec(seq_len=4096, global_batch_size=16)


def _plan(cluster, **choice):
    return build_plan(MODEL, TRAIN, cluster, Choice(**choice))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_states_leave_the_device_for_the_host(zero):
    cluster = parse_cluster("1x8xH100")
    kept, moved = (estimate(MODEL, TRAIN, cluster, _plan(cluster, zero_stage=zero, offload_optimizer=off))
                   for off in (False, True))
    on_device, offloaded = kept.memory_breakdown_bytes[0], moved.memory_breakdown_bytes[0]
    assert offloaded["optimizer"] == 0 and on_device["optimizer"] > 0
    # the gathered 16-bit weights stay (all step below ZeRO-3); ZeRO-1 accumulates whole gradients
    # on the device before its one reduce-scatter, ZeRO-2/3 send each reduced shard out
    n = rank_params(MODEL, _plan(cluster, zero_stage=zero), 0).total
    assert offloaded["params"] == (2 * n if zero < 3 else 0)
    assert offloaded["grads"] == (4 * n if zero == 1 else 0)
    # the host keeps the fp32 shard, both moments and the fp32 gradient shard: 16 bytes each
    assert moved.host_memory_bytes[0] == pytest.approx(16 * n / 8)
    assert kept.host_memory_bytes[0] == 0
    assert moved.max_peak_memory_bytes < kept.max_peak_memory_bytes


def test_every_copy_the_runtime_makes_is_priced():
    """With nothing to hide behind (overlap 0), a lone ZeRO-3 rank's exposed traffic is FSDP2's
    (torch 2.13): per micro-batch the shard copied in for forward and again for backward, the
    reduced gradient shard copied out, and from the second micro-batch on that shard added to the
    host's (12 bytes per parameter through the host's DRAM); then the step on the host."""
    base = parse_cluster("1x1xH100")
    device = replace(base.device, efficiency=replace(base.device.efficiency, overlap=0.0, comm_contention=0.0))
    cluster = replace(base, device=device)
    plan = _plan(cluster, zero_stage=3, micro_batch_size=4, offload_optimizer=True)
    est = estimate(MODEL, TRAIN, cluster, plan)
    m, n, link = plan.num_micro_batches, rank_params(MODEL, plan, 0).total, device.host.link_effective_bytes_per_s
    assert m == 4
    host = device.host
    dram = host.memory_bandwidth_bytes_per_s * host.memory_efficiency
    assert est.time_breakdown_s["comm/dp_exposed"] == pytest.approx(3 * m * 4 * n / link + (m - 1) * 12 * n / dram,
                                                                     rel=1e-9)
    step = n * 28 / (host.memory_bandwidth_bytes_per_s * host.memory_efficiency)   # fused AdamW, fp32
    assert est.time_breakdown_s["optimizer/step"] == pytest.approx(step, rel=1e-9)


def test_accumulating_offloaded_gradients_is_paid_where_fsdp2_blocks():
    """ZeRO-2 with micro-batches adds each copied-out shard to the host's, blocking; ZeRO-1 (one
    reduction per step) and a single micro-batch never do (the review's 70B case on 8 H100s:
    the model had preferred two micro-batches of two by 0.1 s)."""
    cluster = parse_cluster("1x8xH100")
    train = TrainSpec(seq_len=4096, global_batch_size=32)
    model = resolve_model("llama-70b")

    def exposed(**choice):
        plan = build_plan(model, train, cluster, Choice(offload_optimizer=True, **choice))
        return estimate(model, train, cluster, plan).time_breakdown_s["comm/dp_exposed"]
    n = rank_params(model, build_plan(model, train, cluster, Choice(zero_stage=3)), 0).total / 8
    host = cluster.device.host
    add = 12 * n / (host.memory_bandwidth_bytes_per_s * host.memory_efficiency / 8)
    assert exposed(zero_stage=3, micro_batch_size=2) - exposed(zero_stage=3, micro_batch_size=4) > add
    assert exposed(zero_stage=1, micro_batch_size=2) < add


def test_who_may_offload():
    gpu, cpu = parse_cluster("1x8xA100"), parse_cluster("1x2xxeon-amx")
    assert not check_plan(MODEL, TRAIN, gpu, _plan(gpu, zero_stage=1, offload_optimizer=True), memory=False)
    problems = check_plan(MODEL, TRAIN, gpu, _plan(gpu, zero_stage=0, offload_optimizer=True), memory=False)
    assert problems == ["offload_optimizer needs zero_stage >= 1 (the sharded optimizer states are what moves "
                        "to the host)"]
    problems = check_plan(MODEL, TRAIN, cpu, _plan(cpu, zero_stage=3, offload_optimizer=True), memory=False)
    assert problems == ["offload_optimizer: device xeon-amx cannot offload (its ranks already run on the host)"]


def test_a_host_too_small_is_refused():
    cluster = parse_cluster("1x8xA100")
    small = replace(cluster, device=replace(cluster.device, host=replace(cluster.device.host, memory_bytes=2**30)))
    plan = _plan(small, zero_stage=3, offload_optimizer=True)
    assert not estimate(MODEL, TRAIN, small, plan).fits
    assert any(p.startswith("offloaded states of pipeline stage 0 need 15.0 GiB of host memory per device") for p in
               check_plan(MODEL, TRAIN, small, plan))


def test_offloaded_activations_move_the_layers_saved_tensors_and_cost_two_copies():
    """Plan.offload_activations: the layers' saved activations (every in-flight micro-batch's) on
    the host, one layer's back on the device for its backward; per layer and micro-batch one copy
    out and one back, on the compute stream (exposed)."""
    from costmodel.memory import layer_activation_bytes
    from costmodel.plan import Recompute
    cluster = parse_cluster("1x8xH100")
    base, moved = (_plan(cluster, zero_stage=3, offload_activations=off) for off in (False, True))
    kept, gone = estimate(MODEL, TRAIN, cluster, base), estimate(MODEL, TRAIN, cluster, moved)
    per_layer = layer_activation_bytes(MODEL, TRAIN, moved, Recompute.NONE)
    layers, m = MODEL.num_layers, moved.num_micro_batches
    saved = kept.memory_breakdown_bytes[0]["activations"] - gone.memory_breakdown_bytes[0]["activations"]
    assert saved == pytest.approx((layers - 1) * per_layer, rel=0.02)   # one layer comes back for its backward
    assert gone.host_memory_bytes[0] == pytest.approx(layers * per_layer)   # 1F1B on one stage: one micro-batch
    copies = gone.time_breakdown_s["comm/activation_offload"]
    assert copies == pytest.approx(2 * m * layers * per_layer / cluster.device.host.link_effective_bytes_per_s)
    assert gone.step_time_s == pytest.approx(kept.step_time_s + copies, rel=1e-9)


def test_offloaded_activations_are_an_alternative_to_recomputation():
    from costmodel.plan import Recompute
    from costmodel.schedules import Schedule
    cluster = parse_cluster("1x8xH100")
    plan = _plan(cluster, pp=2, recompute=Recompute.FULL, offload_activations=True)
    assert check_plan(MODEL, TRAIN, cluster, plan, memory=False) == [
        "offload_activations with recomputation: they are alternatives (torch's checkpoint keeps the recomputed "
        "region's inputs on the device)"]
    plan = _plan(cluster, pp=2, tp=2, schedule=Schedule.ZB_H1, offload_activations=True)
    problems = check_plan(MODEL, TRAIN, cluster, plan, memory=False)
    assert [p.split(":")[0] for p in problems] == ["offload_activations with schedule zb-h1",
                                                  "offload_activations with tp > 1"]
    cpu = parse_cluster("1x2xxeon-amx")
    assert check_plan(MODEL, TRAIN, cpu, _plan(cpu, offload_activations=True), memory=False) == [
        "offload_activations: device xeon-amx cannot offload (its ranks already run on the host)"]
