"""A GPU's kernels run while the host issues the next ones (costmodel.kernels._host_or_device),
and our runtime's eager layer is priced op by op on a GPU too (`eager_layer`)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.hardware import parse_cluster
from costmodel.kernels import eager_elementwise_traffic, layer_kernel_times
from costmodel.registry import resolve_model
from costmodel.specs import DType, TrainSpec
from planner.measure.calibrate import with_params
from planner.space import Choice, build_plan

MODEL = resolve_model("llama3-8b")
TRAIN = TrainSpec(seq_len=4096, global_batch_size=8, compute_dtype=DType.BF16)
CLUSTER = parse_cluster("1x8xH100")


def _with_overhead(dev, seconds: float):
    return with_params(dev, {"kernel_overhead_s": seconds})   # on every dtype's efficiency


@pytest.mark.parametrize("overhead_s", [1e-7, 2e-6, 5e-4])
def test_a_gpu_layer_takes_the_longer_of_host_and_device(overhead_s):
    plan = build_plan(MODEL, TRAIN, CLUSTER, Choice(tp=8, micro_batch_size=1))
    dev = _with_overhead(CLUSTER.device, overhead_s)
    # the host's part: what a CPU (same cores: the sum) adds to its own device work
    as_cpu = replace(dev, kind="cpu")
    summed = layer_kernel_times(MODEL, TRAIN, plan, as_cpu, False)
    host = {name: getattr(summed, name) - getattr(layer_kernel_times(MODEL, TRAIN, plan, _with_overhead(as_cpu, 0.0),
                                                                     False), name)
            for name in ("forward_s", "backward_input_s", "backward_weight_s")}
    device = layer_kernel_times(MODEL, TRAIN, plan, _with_overhead(dev, 0.0), False)
    both = layer_kernel_times(MODEL, TRAIN, plan, dev, False)
    for name, h in host.items():
        d = getattr(device, name)
        assert getattr(both, name) == pytest.approx(max(d, h))
        assert d <= getattr(both, name) < d + h


def test_the_host_decides_once_it_is_slower():
    plan = build_plan(MODEL, TRAIN, CLUSTER, Choice(tp=8, micro_batch_size=1))
    slow, slower = (layer_kernel_times(MODEL, TRAIN, plan, _with_overhead(CLUSTER.device, s), False).forward_s
                    for s in (1e-3, 2e-3))
    assert slower == pytest.approx(2 * slow)   # kernels x the per-kernel cost, nothing of the device's


def test_our_eager_layer_moves_more_bytes_than_fused_kernels_on_a_gpu():
    plan = build_plan(MODEL, TRAIN, CLUSTER, Choice(tp=1, micro_batch_size=1))
    fused = layer_kernel_times(MODEL, TRAIN, plan, CLUSTER.device, False)
    eager = layer_kernel_times(MODEL, TRAIN, plan, CLUSTER.device, False, False, False, True)
    assert eager.forward_s > fused.forward_s and eager.backward_input_s > fused.backward_input_s
    assert eager.backward_weight_s == fused.backward_weight_s   # the GEMMs are the same
    # CUDA's RMSNorm is one fused kernel: fewer bytes and kernels than the CPU's fp32 composite
    tokens = TRAIN.seq_len
    gpu = eager_elementwise_traffic(MODEL, TRAIN, plan, tokens, 2, cpu=False)
    cpu = eager_elementwise_traffic(MODEL, TRAIN, plan, tokens, 2, cpu=True)
    assert gpu[0] < cpu[0] and gpu[1] < cpu[1] and gpu[2] < cpu[2] and gpu[3] < cpu[3]


def test_a_framework_that_writes_rms_norm_op_by_op_pays_for_each_op():
    """fms-fsdp's LayerNormParameterized and torchtitan's 2024 RMSNorm class run RMSNorm as torch
    ops in fp32 (frameworks `eager_rms_norm_composite`): an eager layer moves the bytes torch's
    composite counts, more than the fused CUDA kernel our runtime calls; compiled, it is fused."""
    from costmodel.frameworks import RUNTIME, composite_rms_norm, framework_traits
    plan = build_plan(MODEL, TRAIN, CLUSTER, Choice(tp=1, micro_batch_size=1))
    fused = eager_elementwise_traffic(MODEL, TRAIN, plan, 4096, 2, cpu=False)
    composite = eager_elementwise_traffic(MODEL, TRAIN, plan, 4096, 2, cpu=False, composite_norm=True)
    # two norms a layer: 40 bytes an element forward (fp32 ops, casts) against the fused 4, 108 against 10 backward
    elements = 2 * 4096 * MODEL.hidden_size
    assert composite[0] - fused[0] == pytest.approx(elements * (40 - 4))
    assert composite[2] - fused[2] == pytest.approx(elements * (108 - 10))
    dev = _with_overhead(CLUSTER.device, 0.0)
    eager = layer_kernel_times(MODEL, TRAIN, plan, dev, False, False, False, True)
    ops = layer_kernel_times(MODEL, TRAIN, plan, dev, False, False, False, True,   # cp_ring .. eager
                             False, False, False, False, False, True)           # .. composite_norm
    assert ops.forward_s > eager.forward_s and ops.backward_input_s > eager.backward_input_s
    assert composite_rms_norm(framework_traits("fms-fsdp"))                    # eager, always
    assert not composite_rms_norm(framework_traits("torchtitan"))              # compiled unless a run says eager
    for name in ("fms-fsdp", "torchtitan"):
        traits = framework_traits(name)
        assert composite_rms_norm(replace(traits, eager_layer=True, compiled_layer=False))
        assert not composite_rms_norm(replace(traits, eager_layer=True, compiled_layer=True))
    assert RUNTIME.eager_layer and not composite_rms_norm(RUNTIME)              # torch's fused rms_norm
