"""Eager attention's products on a GPU are strided-batched GEMMs over the heads; the scores reduce
over the head dim alone, so a shorter head runs slower per FLOP (costmodel.kernels.attention
_batched_products_s, gemm.tile_efficiency)."""
import dataclasses
from types import SimpleNamespace

import pytest

from costmodel.hardware import parse_cluster
from costmodel.kernels.attention import _attention_core_s, _batched_products_s
from costmodel.kernels.gemm import grouped_gemm_s
from costmodel.registry import resolve_model
from costmodel.specs import AttentionKernel, TrainSpec

EAGER = TrainSpec(seq_len=2048, global_batch_size=1, attention_kernel=AttentionKernel.EAGER)


@pytest.mark.parametrize("cluster", ["1x1xA100", "1x1xH100"])
def test_a_shorter_head_is_slower_per_flop(cluster):
    """64 heads of 128 and 128 heads of 64 multiply as many FLOPs; the 64-wide reduction pays
    the tile's fixed cost twice as often."""
    dev = parse_cluster(cluster).device
    wide_f, wide_b = _batched_products_s(64, 2048, 2048, 128, dev, EAGER)
    narrow_f, narrow_b = _batched_products_s(128, 2048, 2048, 64, dev, EAGER)
    assert narrow_f > 1.3 * wide_f and narrow_b > 1.3 * wide_b


def test_the_backward_is_the_forward_s_two_shapes_and_two_transposed_ones():
    dev = parse_cluster("1x1xA100").device
    forward, backward = _batched_products_s(32, 2048, 2048, 128, dev, EAGER)
    transposed = grouped_gemm_s(32, 2048, 2048, 128, dev, EAGER)   # Pᵀ·dO and dSᵀ·Q
    assert backward == pytest.approx(forward + 2 * transposed)


def test_a_cpu_prices_the_products_at_its_flat_gemm_rate(monkeypatch):
    """On a CPU (no SM waves, no tiles) the products stay FLOPs at the profile's GEMM rate; a GPU
    prices them as batched GEMMs."""
    from costmodel.kernels import attention
    model = resolve_model("llama2-7b")
    plan = SimpleNamespace(tp=1, cp=1, ep=1, sequence_parallel=False, micro_batch_size=1, fp8_linears=False)
    gpu = parse_cluster("1x1xA100").device
    cpu = dataclasses.replace(gpu, kind="cpu")
    calls = []
    monkeypatch.setattr(attention, "_batched_products_s", lambda *a: calls.append(a) or (0.0, 0.0))
    _attention_core_s(model, EAGER, plan, cpu, False)
    assert calls == []
    _attention_core_s(model, EAGER, plan, gpu, False)
    assert [c[:4] for c in calls] == [(model.num_heads, 2048, 2048, model.head_dim)]
