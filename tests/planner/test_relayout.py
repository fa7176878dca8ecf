"""The best interleaved plans laid out again by simulation where the closed form misses the
pipeline's phase lock (planner.relayout)."""
from __future__ import annotations

import time
from dataclasses import replace

from costmodel.estimate import estimate
from costmodel.plan import Recompute
from planner.api import predict, search
from planner.relayout import PHASE_LOCK_GAP, phase_locked, relaid
from planner.search_options import SearchOptions
from planner.search_result import Found
from planner.space import Choice, build_plan
from planner.specs import build_specs

# Megatron-Bridge's DeepSeek-V3 on 1,024 H100s (the calibration row mb2509_deepseek_h100_fp8_g1024)
V3_TRAIN = {"seq_len": 4096, "global_batch": 8192, "dtype": "fp8", "recompute_modules": ("mla_up_proj", "mlp"),
            "ep_overlap": True, "grad_dtype": "bf16"}
V3_DEGREES = {"tp": 2, "pp": 8, "vpp": 4, "ep": 64, "cp": 1, "micro_batch_size": 1, "zero_stage": 1,
              "recompute": "selective", "fp8_linears": True, "etp": 1}
# Megatron-Core's own layout of it, Et|(tt|)*30mL: the MTP module and the loss alone on the last stage
V3_LAYOUT = (1,) + (2,) * 30 + (0,)


def test_deepseek_v3_is_laid_out_again_past_megatron_s_own_layout():
    """With Bridge's degrees the search's split leaves one layer beside the head, the MTP module
    and the losses on the last stage: the closed form prices rank totals and misses that the
    stage holds the interleaved pipeline back (21.9 s closed form, 26.7 s simulated). Laid out
    again by simulation the plan's last stage holds no layer, as Megatron-Core's own layout's,
    and the plan is at least as fast as that layout; it is named outside the closed-form proof."""
    answer = search("deepseek-v3", "128x8xH100", framework="megatron", fix=V3_DEGREES, top=1, **V3_TRAIN)
    first, proven = answer.result.plans[0], answer.result.proven_fastest
    assert first.plan.layers_per_stage[-1] == 0 and sum(first.plan.layers_per_stage) == 61
    assert first.estimate.fits and answer.result.fastest.plan == first.plan
    assert proven is not None and proven.plan != first.plan
    assert first.estimate.step_time_s < 0.95 * proven.estimate.step_time_s
    published = predict("deepseek-v3", "128x8xH100", _with_layers(first.plan, V3_LAYOUT), framework="megatron",
                        **V3_TRAIN)
    assert published.estimate.fits and first.estimate.step_time_s <= published.estimate.step_time_s


def test_an_even_interleaved_plan_is_not_phase_locked_and_a_relaid_plan_is_faster_and_fits():
    """Llama 2 70B at PP4 VP5 (no heavy stage: the closed form and the simulation agree) is left
    as it is; a plan whose last stage is made heavy by its split is laid out again into one that
    fits, is faster by simulation, keeps every layer and recomputes every layer of each rank that
    recomputed all of them, with no stage empty under our runtime (which runs none)."""
    model, train, cluster = build_specs("llama-70b", "8x8xH100", seq_len=4096, global_batch=256)
    plan = build_plan(model, train, cluster, Choice(tp=8, pp=4, vpp=5, recompute=Recompute.FULL))
    even = Found(plan=plan, estimate=estimate(model, train, cluster, plan))
    closed = estimate(model, train, cluster, plan, simulate=False).step_time_s
    assert not phase_locked(even, closed)
    # the last rank's stages hold 1, 4, 4, 4 and 7 layers (the others 4 each): the same rank
    # totals, simulated slower than they say
    stages = list(plan.layers_per_stage)
    stages[-1], stages[plan.pp - 1] = stages[-1] + 3, stages[plan.pp - 1] - 3
    heavy_plan = _with_layers(plan, tuple(stages))
    heavy = Found(plan=heavy_plan, estimate=estimate(model, train, cluster, heavy_plan))
    closed = estimate(model, train, cluster, heavy_plan, simulate=False).step_time_s
    assert heavy.estimate.step_time_s > closed * (1 + PHASE_LOCK_GAP) and phase_locked(heavy, closed)
    found = relaid(model, train, cluster, SearchOptions(), heavy, time.perf_counter() + 60)
    assert found is not None and found.estimate.fits
    assert found.estimate.step_time_s < heavy.estimate.step_time_s
    assert sum(found.plan.layers_per_stage) == model.num_layers and min(found.plan.layers_per_stage) >= 1
    assert found.plan.recompute_num_layers == tuple(found.plan.layers_on_rank(r) for r in range(found.plan.pp))


def _with_layers(plan, layers_per_stage):
    moved = replace(plan, layers_per_stage=layers_per_stage)
    return replace(moved, recompute_num_layers=tuple(moved.layers_on_rank(r) for r in range(moved.pp)))


def test_a_framework_that_splits_evenly_keeps_its_even_layout():
    """The descent keeps to what the framework runs: Llama 3 70B at PP4 split evenly, whose last
    rank is the slowest (the head of a 128k vocabulary costs more than a layer), gains by a layer
    moved off it where the split is free (our runtime), and keeps its layout under DeepSpeed's
    even split."""
    from planner.targets import options_for
    for framework, moves in (("planner", True), ("deepspeed", False)):
        model, train, cluster = build_specs("llama3-70b", "8x8xH100", seq_len=4096, global_batch=256,
                                            framework=framework)
        options = options_for(framework, model, train, cluster, SearchOptions())
        plan = build_plan(model, train, cluster, Choice(tp=8, pp=4, vpp=1, recompute=Recompute.FULL))
        found = Found(plan=plan, estimate=estimate(model, train, cluster, plan))
        relaid_plan = relaid(model, train, cluster, options, found, time.perf_counter() + 60)
        assert (relaid_plan is not None) == moves, framework
        if moves:
            assert relaid_plan.estimate.step_time_s < found.estimate.step_time_s
