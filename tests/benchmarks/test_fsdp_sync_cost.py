"""benchmarks/fsdp_sync_cost.py: FSDP2 wrapped as the runtime wraps a one-replica plan, and every
part of a round timed."""
from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from tests.benchmarks.benchmark_loader import load_benchmark

bench = load_benchmark("fsdp_sync_cost")


def test_small_layers_are_one_unit_with_the_root_in_the_compute_dtype(group):
    """As the runtime wraps a stage whose layers are far below a bucket (runtime.parallel.fsdp_units)."""
    model = bench.build(16, 2, 32, torch.bfloat16)
    assert [isinstance(m, FSDPModule) for m in (model, model[0], model[1], model[2])] == [True, False, False, False]
    assert model(torch.randn(4, 16)).dtype == torch.bfloat16


def test_every_part_of_a_round_is_timed(group):
    params, med = bench.measure(16, 2, 32, "bf16", bench.WARM_ROUNDS + 1)
    assert params == sum(p.numel() for p in bench.build(16, 2, 32, torch.bfloat16).parameters())
    assert params == 2 * (14 * 16**2 + 9 * 16) + 16 * 32 + 32   # two layers' four linears, the head
    assert set(med) == {"first forward", "later forward", "unsynced backward", "synced backward"}
    assert all(s > 0 for s in med.values())
