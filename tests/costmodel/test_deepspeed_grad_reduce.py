"""DeepSpeed reduces gradients behind the backward only where it can: its PipelineEngine runs
ReduceGrads after the last micro-batch's backward (`grads_reduced_after_pipeline`), its
`overlap_comm`, unset as Megatron-DeepSpeed's ZeRO-1 configurations leave it, is on for ZeRO-3
alone (`grad_overlap_zero3_only`), and bf16 with fp32 gradients at ZeRO-1 runs its
BF16_Optimizer, which all-reduces after the backward (`bf16_optimizer_all_reduce`). The reduction
those leave after the backward is exposed."""
from __future__ import annotations

from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.frameworks import FRAMEWORKS
from costmodel.hardware import parse_cluster, run_by
from costmodel.plan import Recompute
from costmodel.rank_time.dp_terms import dp_terms, grads_overlap_backward
from costmodel.registry import resolve_model
from costmodel.specs import DType, TrainSpec
from planner.space import Choice, build_plan

MODEL = resolve_model("llama-70b")
TRAIN = TrainSpec(seq_len=4096, global_batch_size=256)


def _plan(framework: str, pp: int, zero: int):
    cluster = run_by(parse_cluster("16x8xA100"), FRAMEWORKS[framework])
    return cluster, build_plan(MODEL, TRAIN, cluster, Choice(tp=8, pp=pp, zero_stage=zero, micro_batch_size=1,
                                                             recompute=Recompute.FULL))


@pytest.mark.parametrize("framework,pp,zero,grad,overlaps", [
    ("deepspeed", 1, 1, "bf16", True),             # its ZeRO optimizer: our export sets overlap_comm
    ("deepspeed", 1, 1, "fp32", False),            # BF16_Optimizer: all-reduced after the backward
    ("deepspeed", 2, 1, "bf16", False),            # the PipelineEngine's ReduceGrads after the flush
    ("megatron-deepspeed", 1, 1, "bf16", False),   # overlap_comm unset: off below ZeRO-3
    ("megatron-deepspeed", 1, 3, "fp32", True),
    ("megatron-deepspeed", 2, 0, "fp32", False),
    ("megatron-core", 2, 1, "fp32", True),
])
def test_where_deepspeed_hides_the_gradient_reduction(framework, pp, zero, grad, overlaps):
    train = replace(TRAIN, grad_dtype=DType(grad))
    cluster, plan = _plan(framework, pp, zero)
    traits = FRAMEWORKS[framework]
    assert grads_overlap_backward(plan, traits, train) is overlaps
    reductions = [t for t in dp_terms(MODEL, train, plan, cluster) if t.scale == 1.0
                  and any(kind.name in ("ALL_REDUCE", "REDUCE_SCATTER") for kind, _ in t.collectives)]
    assert reductions and all((t.window != "none") is overlaps for t in reductions)


def test_a_deepspeed_pipeline_leaves_its_reduction_exposed():
    train = replace(TRAIN, grad_dtype=DType.BF16)   # its ZeRO optimizer, not BF16_Optimizer
    cluster, plan = _plan("deepspeed", 2, 1)
    exposed = estimate(MODEL, train, cluster, plan).time_breakdown_s["comm/dp_exposed"]
    hidden = run_by(parse_cluster("16x8xA100"), replace(FRAMEWORKS["deepspeed"], grads_reduced_after_pipeline=False))
    assert exposed > estimate(MODEL, train, hidden, plan).time_breakdown_s["comm/dp_exposed"]
