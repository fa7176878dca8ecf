"""A CPU profile's measured SDPA curves price the runtime's attention core: forward and backward
each at its own curve, at the rate of each call's size, the dtype's own curves, with dropout the
dropout curves (torch's math path), context parallelism as its two chunk calls; without curves
(datasheets, GPUs) nothing changes."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.cluster import ClusterSpec, load_profile, profile_problems, sdpa_key
from costmodel.compute import cp_chunk_scores, layer_kernel_times
from costmodel.registry import gpt_spec, llama_spec
from costmodel.specs import DType, TrainSpec
from planner.space import Choice, build_plan

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"
GPT = gpt_spec("t-gpt", layers=2, hidden=320, heads=4, vocab=5000, max_pos=512, ffn=1280, source="test")
LLAMA = llama_spec("t-llama", layers=2, hidden=384, heads=6, kv_heads=2, ffn=1024, vocab=6000, max_pos=512,
                   source="test")
# score-dims/s at a small and a large call: (dropout, backward) -> rates; bf16's other numbers
RATES = {(False, False): (1e10, 2e10), (False, True): (4e9, 7e9), (True, False): (3e9, 5e9), (True, True): (5e9, 8e9)}
BF16_SCALE = 0.5
SMALL, LARGE = 1e6, 1e9


def _device(scale_backward: float = 1.0, curves: bool = True):
    dev = load_profile(PROFILE)
    # no per-kernel cost, so the times are the curves' alone
    dev = replace(dev, efficiency=replace(dev.efficiency, kernel_overhead_s=0.0), dtype_efficiency=())
    if not curves:
        return dev
    return replace(dev, sdpa_curves=tuple(
        (sdpa_key(dtype, drop, back), ((SMALL, small * s * (scale_backward if back else 1.0)),
                                      (LARGE, large * s * (scale_backward if back else 1.0))))
        for (drop, back), (small, large) in RATES.items() for dtype, s in (("fp32", 1.0), ("bf16", BF16_SCALE))))


def _times(model, dev, cpu: bool = True, tp: int = 1, cp: int = 1, mbs: int = 2, dtype: DType = DType.FP32):
    train = TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=dtype)
    cluster = ClusterSpec(device=dev, num_nodes=1, devices_per_node=tp * cp)
    plan = build_plan(model, train, cluster, Choice(tp=tp, cp=cp, micro_batch_size=mbs))
    return layer_kernel_times(model, train, plan, dev, False, False, cpu)


def _rate(curve: tuple[float, float], work: float) -> float:
    """Log-linear between (SMALL, small) and (LARGE, large), as costmodel.compute.interpolate."""
    w = (math.log(work) - math.log(SMALL)) / (math.log(LARGE) - math.log(SMALL))
    return curve[0] + w * (curve[1] - curve[0])


@pytest.mark.parametrize("model", [LLAMA, GPT], ids=["flash", "dropout"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", [DType.FP32, DType.BF16])
def test_each_pass_is_priced_at_its_curve_at_the_call_s_size(model, tp, dtype):
    scale = 1.0 if dtype is DType.FP32 else BF16_SCALE
    heads = model.num_heads // tp
    work = 2 * heads * 256 * 256 * model.head_dim          # micro-batch x local heads x pairs x head dim
    t = _times(model, _device(), tp=tp, dtype=dtype)
    forward = work / (scale * _rate(RATES[model.dropout, False], work))
    assert t.attention_forward_s == pytest.approx(forward)
    # the backward reads its own curve: twice its rate takes half of it off the layer's backward
    faster = _times(model, _device(scale_backward=2.0), tp=tp, dtype=dtype)
    backward = work / (scale * _rate(RATES[model.dropout, True], work))
    assert t.backward_input_s - faster.backward_input_s == pytest.approx(backward / 2)
    assert faster.forward_s == t.forward_s


def test_context_parallel_prices_its_two_chunk_calls_each_at_its_own_size():
    t = _times(LLAMA, _device(), cp=2)
    per_call = 2 * LLAMA.num_heads * cp_chunk_scores(256, 2) * LLAMA.head_dim / 2
    assert t.attention_forward_s == pytest.approx(2 * per_call / _rate(RATES[False, False], per_call))


def test_a_call_below_the_smallest_measured_one_takes_that_one_s_time():
    """Extrapolated at the smallest point's rate a tiny call was nearly free, where its fixed cost
    dominates (debug-tiny's backward: 1.7 ms a call, priced 0.15 ms)."""
    work = 2 * LLAMA.num_heads * 256 * 256 * LLAMA.head_dim   # one call: 5e7 score-dims
    smallest = 4 * work
    dev = _device()
    above = replace(dev, sdpa_curves=tuple((k, ((smallest, 1e10), (1e3 * smallest, 2e10))) for k, _ in dev.sdpa_curves))
    assert _times(LLAMA, above).attention_forward_s == pytest.approx(smallest / 1e10)   # not work / 1e10
    # at or above the smallest point, the rate as before
    at = replace(dev, sdpa_curves=tuple((k, ((work, 1e10), (1e3 * work, 2e10))) for k, _ in dev.sdpa_curves))
    assert _times(LLAMA, at).attention_forward_s == pytest.approx(work / 1e10)


@pytest.mark.parametrize("model", [LLAMA, GPT], ids=["flash", "dropout"])
def test_without_curves_or_off_the_cpu_kernels_nothing_changes(model):
    bare = _device(curves=False)
    assert _times(model, _device(), cpu=False) == _times(model, bare, cpu=False)
    assert _times(model, _device()) != _times(model, bare)


def test_a_forward_curve_without_its_backward_is_a_profile_problem():
    dev = _device()
    lone = replace(dev, sdpa_curves=tuple((k, c) for k, c in dev.sdpa_curves if k != sdpa_key("bf16", True, True)))
    assert profile_problems(dev) == []
    assert profile_problems(lone) == [f"measured.{sdpa_key('bf16', True, False)} is not one of a non-empty "
                                      "forward and backward pair of SDPA curves"]
