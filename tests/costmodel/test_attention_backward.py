"""An attention kernel's backward runs at its own rate (DeviceEfficiency.attention_backward_ratio of the
forward's), published per chip; on Blackwell the profiles' published forward and backward rates are the
vendor benchmark's."""
import dataclasses
from types import SimpleNamespace

import pytest

from costmodel.hardware import parse_cluster
from costmodel.kernels.attention import CAUSAL_FRACTION, FLASH_BACKWARD_FACTOR, _attention_core_s
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec

PLAN = SimpleNamespace(tp=1, cp=1, ep=1, sequence_parallel=False, micro_batch_size=1, fp8_linears=False)

# NVIDIA/cudnn-frontend benchmark/sdpa_benchmark_training/artifacts/sdpa_bf16_benchmark_results_NVIDIA_B200.csv
# (cuDNN 9.13, flash-attn 2.7.4): causal, batch 1, 128 query heads, 8 KV heads, head dim 128, as Llama 3.1 405B's
# layer; TFLOP/s (forward, backward), the backward counted as 2.5 forwards
B200_CUDNN = {16384: (1332.4, 1074.8), 32768: (1419.0, 1108.7), 65536: (1382.3, 1073.1)}
B200_FLASH2 = {16384: (425.1, 336.6), 32768: (435.8, 345.6), 65536: (441.3, 349.0)}


def _rates(dev, seq: int, vendor: bool) -> tuple[float, float]:
    """(forward, backward) TFLOP/s the model prices one 405B layer's attention core at."""
    if vendor:
        eff = dev.efficiency
        dev = dataclasses.replace(dev, efficiency=dataclasses.replace(
            eff, attention=eff.attention * eff.vendor_attention_speedup))
    model = resolve_model("llama3-405b")
    forward_s, backward_s = _attention_core_s(model, TrainSpec(seq_len=seq, global_batch_size=1), PLAN, dev, False)
    flops = 4.0 * model.num_heads * seq * seq * model.attention_head_dim * CAUSAL_FRACTION
    return flops / forward_s / 1e12, flops * FLASH_BACKWARD_FACTOR / backward_s / 1e12


@pytest.mark.parametrize("vendor,published", [(True, B200_CUDNN), (False, B200_FLASH2)], ids=["cudnn", "flash2"])
def test_the_b200_prices_the_published_forward_and_backward(vendor, published):
    """Both kernels' forward and backward rates on a B200 at 16k-64k within 6 % of the benchmark, one
    published backward ratio (0.79) serving both. One rate for both passes, a forward figure's (0.555 of
    peak), would price cuDNN's forward 10-14 % slow and its backward 10-15 % fast."""
    dev = parse_cluster("1x8xB200").device
    for seq, (forward, backward) in published.items():
        model_forward, model_backward = _rates(dev, seq, vendor)
        assert model_forward == pytest.approx(forward, rel=0.06), seq
        assert model_backward == pytest.approx(backward, rel=0.06), seq
        assert model_forward / model_backward == pytest.approx(1 / dev.efficiency.attention_backward_ratio, rel=0.01)


@pytest.mark.parametrize("name", ["A100", "H100", "B200", "GB200", "GB300"])
def test_every_gpu_runs_the_backward_slower_per_flop(name):
    """Every GPU profile states a published backward ratio below 1 (the backward's dS and dQ work), and
    the attention core prices its backward at it."""
    dev = parse_cluster(f"1x4x{name}").device
    ratio = dev.efficiency.attention_backward_ratio
    assert 0.6 < ratio < 1
    forward, backward = _rates(dev, 32768, False)
    assert backward / forward == pytest.approx(ratio, rel=0.01)
