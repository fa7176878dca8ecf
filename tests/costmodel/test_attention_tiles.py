"""A flash kernel's efficiency rises with sequence length (costmodel.kernels.flash_tile_efficiency),
and only a GPU's flash pricing uses it."""
import dataclasses
from types import SimpleNamespace

import pytest

from costmodel.hardware import parse_cluster
from costmodel.kernels import FLASH_TILE, FLASH_TILE_COST_TOKENS, flash_tile_efficiency
from costmodel.kernels.attention import _attention_core_s
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec

# FlashAttention-2 and -3 forward TFLOP/s on an H100 at head dim 128, batch x seq = 16k
# (pytorch/benchmark ff65cb67, D60117034): what FLASH_TILE_COST_TOKENS was fitted to.
FA2_TFLOPS = {512: 328.9, 1024: 389.7, 2048: 433.7, 4096: 458.4, 8192: 470.7, 16384: 476.8}
FA3_TFLOPS = {512: 430.3, 1024: 517.1, 2048: 565.5, 4096: 590.2, 8192: 614.2, 16384: 620.7}


@pytest.mark.parametrize("curve,within", [(FA2_TFLOPS, 0.01), (FA3_TFLOPS, 0.02)], ids=["fa2", "fa3"])
def test_the_tile_cost_reproduces_the_published_curve(curve, within):
    """Without a mask every query tile walks all s / FLASH_TILE key tiles plus its fixed cost:
    the measured throughput over its 16k value is s / (s + cost) over 16k's, within 1 % for
    FlashAttention-2 and 2 % for -3 (whose own best cost, 1.83 tiles, is 4 % lower)."""
    longest = max(curve)
    for s, tflops in curve.items():
        model = (s / (s + FLASH_TILE_COST_TOKENS)) / (longest / (longest + FLASH_TILE_COST_TOKENS))
        assert model == pytest.approx(tflops / curve[longest], rel=within), s


def test_a_causal_kernel_wastes_its_diagonal_and_tile_costs():
    assert flash_tile_efficiency(2048) == pytest.approx(16 / (16 + 1 + 2 * FLASH_TILE_COST_TOKENS / FLASH_TILE))
    assert flash_tile_efficiency(2048) < flash_tile_efficiency(4096) < flash_tile_efficiency(32768) < 1
    assert flash_tile_efficiency(32768) > 0.97


def test_longer_sequences_run_attention_faster_per_flop_on_a_gpu_only():
    """Per FLOP of attention, 32k tokens take less time than 2k on an A100 (the tile costs); a
    CPU's flash kernel is another algorithm: the same profile marked as a CPU prices FLOPs alone."""
    model = resolve_model("llama2-7b")
    plan = SimpleNamespace(tp=1, cp=1, ep=1, sequence_parallel=False, micro_batch_size=1, fp8_linears=False)
    gpu = parse_cluster("1x1xA100").device
    cpu = dataclasses.replace(gpu, kind="cpu")

    def forward_s_per_flop(dev, seq: int) -> float:
        forward_s, _ = _attention_core_s(model, TrainSpec(seq_len=seq, global_batch_size=1), plan, dev, False)
        return (forward_s - dev.efficiency.kernel_overhead_s) / seq ** 2

    ratio = forward_s_per_flop(gpu, 2048) / forward_s_per_flop(gpu, 32768)
    assert ratio == pytest.approx(flash_tile_efficiency(32768) / flash_tile_efficiency(2048), rel=1e-6)
    assert forward_s_per_flop(cpu, 2048) / forward_s_per_flop(cpu, 32768) == pytest.approx(1.0, rel=1e-6)
