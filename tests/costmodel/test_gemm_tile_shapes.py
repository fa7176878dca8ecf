"""A GEMM's rate falls with its reduction length K (each output tile's fixed prologue and
epilogue, `gemm_tile_setup_k`, measured by benchmarks/gemm_shapes.py), and a linear layer's three
GEMMs are priced in their own shapes: the input gradient reduces over the output features, the
weight gradient over the tokens."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.hardware import parse_cluster
from costmodel.kernels.gemm import _projection_s, gemm_s, linear_shapes, tile_efficiency
from costmodel.specs import TrainSpec

TRAIN = TrainSpec(seq_len=4096, global_batch_size=256)
H100 = parse_cluster("1x8xH100").device


def test_short_k_runs_slower_per_flop_by_the_tile_setup():
    k0 = H100.gemm_tile_setup_k
    assert 100 <= k0 <= 400   # a few 64-deep main-loop steps (profiles/H100-SXM5-80GB.toml cites the measurement)
    # 4096 x 4096 outputs: 1024 tiles, 7.76 waves of 132 SMs either way; only K differs
    short, long = (gemm_s(4096, k, 4096, H100, TRAIN) / k for k in (1024, 16384))
    launch = H100.efficiency.kernel_overhead_s
    assert (short - launch / 1024) / (long - launch / 16384) == pytest.approx((1024 + k0) / 1024 * 16384 / (16384 + k0))
    assert tile_efficiency(4096, 1024, 4096, replace(H100, gemm_tile_setup_k=0)) == pytest.approx(1024 / 1056)


def test_a_linear_prices_its_gradients_in_their_own_shapes():
    assert linear_shapes(8192, 1024, 28672) == ((8192, 1024, 28672), (8192, 28672, 1024), (28672, 8192, 1024))
    fwd, dgrad, wgrad = _projection_s(8192, 1024, 28672, H100, TRAIN, fp8=False, fused_casts=False)
    # the forward reduces over 1024 features; both gradients over long ones, so they run faster
    assert fwd == pytest.approx(gemm_s(8192, 1024, 28672, H100, TRAIN))
    assert dgrad == pytest.approx(gemm_s(8192, 28672, 1024, H100, TRAIN)) and wgrad < fwd and dgrad < fwd


# OpenXLA's measured bf16 matmul table (matmul_interpolator_data.h, kDefaultMatmulPTable): batch 4
# of 4096 x 4096 outputs over k = 512, 1024, 2048, 4096, in TFLOP/s (profiles/B200.toml cites it)
XLA_K_SWEEP = {"B200": (1090.6, 1350.5, 1539.9, 1670.5), "H100": (620.4, 722.3, 759.5, 788.7)}


@pytest.mark.parametrize("device", ["B200", "H100"])
def test_the_tile_setup_reproduces_the_published_k_sweep(device):
    """Blackwell's tensor cores do twice the Hopper's work per SM and cycle while a tile's fill and
    store take as long: its short-K GEMMs fall further below the long-K rate, which the profile's
    setup length (360 against 150) must give within 3 % at every K of the sweep."""
    dev = parse_cluster(f"1x8x{device}").device
    measured = XLA_K_SWEEP[device]
    for k, rate in zip((512, 1024, 2048), measured):
        model = tile_efficiency(4096, k, 4096, dev, groups=4) / tile_efficiency(4096, 4096, 4096, dev, groups=4)
        assert model == pytest.approx(rate / measured[-1], rel=0.03), k


# the same table, k = 2048: one, two and four 4096 x 4096 outputs in one call, in TFLOP/s
XLA_BATCH_SWEEP = {"B200": (1277.8, 1344.4, 1539.9), "H100": (735.6, 759.2, 759.5)}


@pytest.mark.parametrize("device", ["B200", "H100"])
def test_the_output_tile_reproduces_the_published_batch_sweep(device):
    """A B200 SM computes 256 x 256 output tiles: one or two 4096 x 4096 outputs fill half of their
    last wave over 148 SMs, four nearly all of it. A Hopper's 128 x 128 tiles fill every batch
    alike. Within 6 % of the measured rate relative to the batch of four."""
    dev = parse_cluster(f"1x8x{device}").device
    measured = XLA_BATCH_SWEEP[device]
    for batch, rate in zip((1, 2), measured):
        model = tile_efficiency(4096, 2048, 4096, dev, groups=batch) / tile_efficiency(4096, 2048, 4096, dev, groups=4)
        assert model == pytest.approx(rate / measured[-1], rel=0.06), batch
