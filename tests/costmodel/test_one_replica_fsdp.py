"""FSDP2's reduce and gathers where our runtime wraps a plan of one data-parallel replica
(costmodel.rank_time.one_replica_fsdp_s): on a one-rank group there is no collective to price, but
FSDP still copies and casts every parameter's gradient and weight through its buffers."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from costmodel.estimate import estimate
from costmodel.frameworks import FRAMEWORKS
from costmodel.hardware import ClusterSpec, load_profile
from costmodel.kernels import FSDP_SYNC_BYTES, fsdp_sync_s
from costmodel.memory import runtime_wraps_in_fsdp
from costmodel.params import rank_params
from costmodel.rank_time import one_replica_fsdp_s
from costmodel.registry import llama_spec
from costmodel.specs import DType, TrainSpec
from planner.space import Choice, build_plan

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"
MODEL = llama_spec("t-llama", layers=4, hidden=384, heads=6, kv_heads=2, ffn=1024, vocab=6000, max_pos=512,
                   source="test")
REDUCE_S, GATHER_S = 9e-10, 5e-10   # seconds per parameter, bf16 compute
RATES = (("reduce.bf16", REDUCE_S), ("gather.bf16", GATHER_S), ("reduce.fp32", 2 * REDUCE_S),
         ("gather.fp32", 2 * GATHER_S))


def _priced(dtype: DType = DType.BF16, framework: str = "planner", measured: bool = True, devices: int = 1,
            **choice) -> tuple[list[float], object, object]:
    train = TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=dtype)
    dev = load_profile(PROFILE)
    dev = replace(dev, fsdp_sync_s_per_param=RATES if measured else ())
    cluster = ClusterSpec(device=dev, num_nodes=1, devices_per_node=devices, framework=FRAMEWORKS[framework])
    plan = build_plan(MODEL, train, cluster, Choice(**choice))
    return ([one_replica_fsdp_s(MODEL, train, plan, cluster, rank_params(MODEL, plan, r), plan.layers_on_rank(r))
             for r in range(plan.pp)], plan, cluster)


def test_a_bf16_replica_reduces_and_gathers_once_a_step_below_zero_2():
    (priced,), plan, _ = _priced(zero_stage=1, micro_batch_size=2)
    assert plan.num_micro_batches == 4
    assert priced == pytest.approx(rank_params(MODEL, plan, 0).total * (REDUCE_S + GATHER_S))


def test_zero_2_reduces_every_micro_batch_and_zero_3_gathers_for_each_pass():
    n = rank_params(MODEL, _priced(zero_stage=2, micro_batch_size=2)[1], 0).total
    assert _priced(zero_stage=2, micro_batch_size=2)[0][0] == pytest.approx(n * (4 * REDUCE_S + GATHER_S))
    assert _priced(zero_stage=3, micro_batch_size=2)[0][0] == pytest.approx(n * (4 * REDUCE_S + 8 * GATHER_S))


def test_a_pipeline_reduces_once_and_its_backwards_leave_the_weights_whole():
    priced, plan, _ = _priced(zero_stage=3, micro_batch_size=1, pp=2, devices=2)
    assert plan.num_micro_batches == 8
    for r in range(2):   # each forward still reshards after itself: 8 forwards and one backward gather
        assert priced[r] == pytest.approx(rank_params(MODEL, plan, r).total * (REDUCE_S + 9 * GATHER_S))


def test_a_pipelines_reduce_is_its_stages_dp_sync_as_the_runtime_times_it():
    """runtime.pipeline times torch pipelining's once-a-step reduce apart from the stage's passes."""
    _, plan, cluster = _priced(zero_stage=3, micro_batch_size=1, pp=2, devices=2)
    train = TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=DType.BF16)
    est = estimate(MODEL, train, cluster, plan)
    reduce = [rank_params(MODEL, plan, r).total * REDUCE_S for r in range(2)]
    assert est.rank_fsdp_reduce_s == pytest.approx(reduce)
    without = estimate(MODEL, train, replace(cluster, framework=replace(cluster.framework, one_replica_fsdp=False)), plan)
    gathers = [rank_params(MODEL, plan, r).total * 9 * GATHER_S for r in range(2)]
    assert [a - b for a, b in zip(est.rank_work_s, without.rank_work_s)] == pytest.approx(gathers)
    _, flat, one_rank = _priced(zero_stage=1)   # without a pipeline the reduce runs inside the backward
    assert estimate(MODEL, train, one_rank, flat).rank_fsdp_reduce_s == [0.0]


def test_only_where_the_runtime_wraps_a_one_replica_plan():
    assert _priced(DType.FP32)[0] == [0.0]                          # plain: nothing for FSDP to do
    assert _priced(DType.FP32, tp=2, devices=2)[0][0] > 0            # TP's DTensors: wrapped
    assert _priced(dp=2, devices=2)[0] == [0.0]                     # collectives, priced as such
    assert _priced(zero_stage=1, offload_optimizer=True)[0] == [0.0]  # the host copies' price
    assert _priced(framework="megatron-core")[0] == [0.0]           # not that framework's trait
    _, plan, _ = _priced()
    assert runtime_wraps_in_fsdp(plan, TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=DType.BF16))
    assert not runtime_wraps_in_fsdp(plan, TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=DType.FP32))


def test_without_a_measurement_the_copies_are_priced_as_their_traffic():
    (priced,), plan, cluster = _priced(measured=False, zero_stage=1)
    n, dev = rank_params(MODEL, plan, 0).total, cluster.device.for_dtype(DType.BF16)
    # the reduce's copies in and out; the gather's cast and one copy (no all-gather on one rank)
    assert [FSDP_SYNC_BYTES[k](w) for k in ("reduce", "gather") for w in (2, 4)] == [16, 16, 10, 8]
    traffic = fsdp_sync_s("reduce", n, DType.BF16, 0, dev) + fsdp_sync_s("gather", n, DType.BF16, 0, dev)
    assert priced == pytest.approx(traffic, rel=0.05)   # the tensors' launches apart
    assert priced > n * 26 / dev.memory_bandwidth_bytes_per_s * 0.99


def test_the_estimate_books_it_and_counts_it_in_the_ranks_work():
    (priced,), plan, cluster = _priced(zero_stage=1)
    train = TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=DType.BF16)
    est = estimate(MODEL, train, cluster, plan)
    assert est.time_breakdown_s["grads/fsdp_one_rank"] == pytest.approx(priced)
    without = estimate(MODEL, train, replace(cluster, framework=replace(cluster.framework, one_replica_fsdp=False)), plan)
    assert est.step_time_s - without.step_time_s == pytest.approx(priced)
    assert est.rank_work_s[0] - without.rank_work_s[0] == pytest.approx(priced)


def test_fsdp2_reduces_on_a_one_rank_group_only_when_sync_is_on(group):
    """What the once-a-step price assumes of torch 2.13's FSDP2 as runtime.parallel applies it:
    with sync off the sharded gradient stays unset (the unsharded fp32 accumulator holds the
    micro-batches), with it on the reduce writes an fp32 sharded gradient."""
    layer = torch.nn.Linear(8, 8)
    fully_shard(layer, reshard_after_forward=False,
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    x = torch.randn(4, 8)
    layer.set_requires_gradient_sync(False)
    layer(x).float().sum().backward()
    assert layer.weight.grad is None
    layer.set_requires_gradient_sync(True)
    layer(x).float().sum().backward()
    assert layer.weight.grad is not None and layer.weight.grad.dtype == torch.float32
