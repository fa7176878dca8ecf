"""benchmarks/two_speed.py: the slow group's profile is the fast one at a share of the speed
(the run itself needs root's cgroups and is a benchmark)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from benchmark_loader import load_benchmark

from costmodel.cluster import DeviceGroup, load_profile, mixed_cluster
from costmodel.compute import gemm_s, memory_bound_s, optimizer_step_s
from costmodel.specs import DType, TrainSpec

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"


def test_the_slow_group_runs_at_its_share():
    fast = replace(load_profile(PROFILE), optimizer_s_per_param=3e-9)
    slow = load_benchmark("two_speed").slowed(fast, 0.5)
    train = TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=DType.FP32, grad_dtype=DType.FP32)
    assert gemm_s(512, 512, 512, slow, train) == pytest.approx(2 * gemm_s(512, 512, 512, fast, train))
    assert memory_bound_s(1e8, slow, 4) == pytest.approx(2 * memory_bound_s(1e8, fast, 4))
    assert optimizer_step_s(1e6, train, slow) == pytest.approx(2 * optimizer_step_s(1e6, train, fast))
    assert slow.intra_node == fast.intra_node   # the ranks share the machine's own link
    # the groups stay apart by name in the plan, its tables and its launch lines
    both = mixed_cluster([DeviceGroup(device=fast, num_nodes=1), DeviceGroup(device=slow, num_nodes=1)], 1)
    assert both.name == f"1x1x{fast.name}+1x1x{fast.name}-at-0.5"
