"""A CPU profile's measured SDPA curves price the runtime's attention core: forward and backward
each at its own measured rate, with dropout at the dropout curves' (torch's math path), context
parallelism as its two chunk calls; without curves (datasheets, GPUs) nothing changes."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.cluster import ClusterSpec, load_profile, sdpa_key
from costmodel.compute import SDPA_MATH_KERNELS, cp_chunk_scores, layer_kernel_times, sdpa_work
from costmodel.registry import gpt_spec, llama_spec
from costmodel.specs import DType, TrainSpec
from planner.space import Choice, build_plan

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"
TRAIN = TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=DType.FP32)
GPT = gpt_spec("t-gpt", layers=2, hidden=320, heads=4, vocab=5000, max_pos=512, ffn=1280, source="test")
LLAMA = llama_spec("t-llama", layers=2, hidden=384, heads=6, kv_heads=2, ffn=1024, vocab=6000, max_pos=512,
                   source="test")
# score-dims/s, flat (one point): forward, backward; with dropout slower, as measured
RATES = {(False, False): 2e10, (False, True): 7e9, (True, False): 5e9, (True, True): 7.5e9}


def _device(scale_backward: float = 1.0, curves: bool = True):
    dev = load_profile(PROFILE)
    if not curves:
        return dev
    return replace(dev, sdpa_curves=tuple(
        (sdpa_key("fp32", drop, back), ((1e7, rate * (scale_backward if back else 1.0)),))
        for (drop, back), rate in RATES.items()))


def _times(model, dev, cpu: bool = True, tp: int = 1, cp: int = 1):
    cluster = ClusterSpec(device=dev, num_nodes=1, devices_per_node=tp * cp)
    plan = build_plan(model, TRAIN, cluster, Choice(tp=tp, cp=cp, micro_batch_size=2))
    return layer_kernel_times(model, TRAIN, plan, dev, False, False, cpu)


@pytest.mark.parametrize("model", [LLAMA, GPT], ids=["flash", "dropout"])
def test_the_attention_core_is_priced_at_the_measured_rates(model):
    dev = _device()
    overhead = dev.efficiency.kernel_overhead_s * (SDPA_MATH_KERNELS if model.dropout else 1)
    work = sdpa_work(2, model.num_heads, 256 * 256, model.head_dim)
    t = _times(model, dev)
    assert t.attention_forward_s == pytest.approx(work / RATES[model.dropout, False] + overhead)
    # the backward reads its own curve: twice the rate takes the difference off the layer's backward
    faster = _times(model, _device(scale_backward=2.0))
    half_backward = work / RATES[model.dropout, True] / 2
    assert t.backward_input_s - faster.backward_input_s == pytest.approx(half_backward)
    assert faster.forward_s == t.forward_s


def test_context_parallel_prices_its_two_chunk_calls():
    dev = _device()
    t = _times(LLAMA, dev, cp=2)
    per_call = sdpa_work(2, LLAMA.num_heads, cp_chunk_scores(256, 2), LLAMA.head_dim) / 2
    assert t.attention_forward_s == pytest.approx(2 * (per_call / RATES[False, False]
                                                       + dev.efficiency.kernel_overhead_s))


@pytest.mark.parametrize("model", [LLAMA, GPT], ids=["flash", "dropout"])
def test_without_curves_or_off_the_cpu_kernels_nothing_changes(model):
    bare = _device(curves=False)
    assert _times(model, _device(), cpu=False) == _times(model, bare, cpu=False)
    assert _times(model, _device()) != _times(model, bare)
