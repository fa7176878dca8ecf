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
