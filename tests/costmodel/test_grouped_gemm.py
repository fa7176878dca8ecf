"""A device's experts as one grouped GEMM (Megatron-Core's --moe-grouped-gemm: trait
grouped_expert_gemm): the experts' output tiles share the SMs' waves, so many small experts
leave one partial wave in all, not one each; a single group is the plain GEMM."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.frameworks import FRAMEWORKS
from costmodel.hardware import parse_cluster, run_by
from costmodel.kernels.gemm import gemm_s, grouped_gemm_s, tile_efficiency
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

TRAIN = TrainSpec(seq_len=4096, global_batch_size=256)
H100 = parse_cluster("1x8xH100").device


def test_one_group_is_the_plain_gemm_and_many_share_their_waves():
    assert grouped_gemm_s(1, 563, 4096, 1536, H100, TRAIN) == pytest.approx(gemm_s(563, 4096, 1536, H100, TRAIN))
    alone = 16 * gemm_s(563, 4096, 1536, H100, TRAIN)
    grouped = grouped_gemm_s(16, 563, 4096, 1536, H100, TRAIN)
    # 60 tiles an expert on 132 SMs: 0.45 of a wave each alone, 960 tiles grouped fill 8 waves to 0.91
    assert tile_efficiency(563, 4096, 1536, H100) == pytest.approx(60 / 132 * 4096 / (4096 + H100.gemm_tile_setup_k))
    # both compute-bound: flops at the waves' share of the GEMM rate over K = 4096 (each tile's
    # fixed prologue and epilogue: gemm_tile_setup_k), plus one launch a kernel
    rate = H100.peak_for("bf16") * H100.efficiency.gemm * 4096 / (4096 + H100.gemm_tile_setup_k)
    flops = 2 * 563 * 4096 * 1536
    launch = H100.efficiency.kernel_overhead_s
    assert alone == pytest.approx(16 * (flops / (rate * 60 / 132) + launch), rel=1e-6)
    assert grouped == pytest.approx(16 * flops / (rate * 960 / (8 * 132)) + launch, rel=1e-6)


def test_megatron_core_prices_qwen3s_experts_grouped_and_our_runtime_one_by_one():
    model = resolve_model("qwen3-235b-a22b")
    core = run_by(parse_cluster("32x8xH100"), FRAMEWORKS["megatron-core"])
    plan = build_plan(model, TRAIN, core, Choice(tp=4, pp=8, vpp=4, ep=8, zero_stage=1, sequence_parallel=True))
    grouped = estimate(model, TRAIN, core, plan).time_breakdown_s["compute/forward"]
    one_by_one = run_by(parse_cluster("32x8xH100"), replace(FRAMEWORKS["megatron-core"], grouped_expert_gemm=False))
    assert grouped < 0.8 * estimate(model, TRAIN, one_by_one, plan).time_breakdown_s["compute/forward"]
    assert not FRAMEWORKS["planner"].grouped_expert_gemm
