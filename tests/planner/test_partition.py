"""The solver's view of the cost model (affine per-rank shapes) equals the cost model itself."""
import dataclasses
import itertools
import math
import random

import pytest
from ortools.sat.python import cp_model

from costmodel.estimate import estimate
from costmodel.hardware import parse_cluster
from costmodel.memory import AffineBytes, stage_memory_at
from costmodel.params import rank_params
from costmodel.plan import Recompute
from costmodel.rank_time import (
    after_pipeline_s,
    dp_exposed_s,
    grad_accumulation_s,
    one_replica_fsdp_s,
    rank_times,
    spans,
)
from costmodel.registry import resolve_model
from costmodel.schedules import Schedule
from costmodel.specs import TrainSpec
from planner import partition
from planner.bounds import MemoryFit, min_max_time_s
from planner.dense_spreads import DenseChoice, first_stage_spread
from planner.partition import solve_split
from planner.shapes import Coefficients, rank_shapes
from planner.space import Choice, build_plan

TRAIN = TrainSpec(seq_len=4096, global_batch_size=64)


@pytest.mark.parametrize("model_name,choice", [
    ("llama2-13b", Choice(tp=8, pp=4, zero_stage=1, recompute=Recompute.FULL)),
    ("llama2-13b", Choice(tp=4, pp=4, vpp=2, zero_stage=3, recompute=Recompute.SELECTIVE, micro_batch_size=2)),
    ("llama2-13b", Choice(tp=2, pp=8, cp=2, zero_stage=2, recompute=Recompute.FULL, schedule=Schedule.ZB_H1)),
    ("llama2-13b", Choice(tp=8, pp=2, zero_stage=0)),
    # a mixture under TP: its gradient all-reduce over TP joins the optimizer's per-rank term
    ("mixtral-8x7b", Choice(tp=2, pp=4, ep=4, zero_stage=1, recompute=Recompute.FULL)),
])
def test_rank_shapes_match_the_cost_model(model_name, choice):
    model, cluster = resolve_model(model_name), parse_cluster("4x8xH100")
    base = build_plan(model, TRAIN, cluster, choice)
    shapes = rank_shapes(model, TRAIN, cluster, base)
    reserved = cluster.device.efficiency.reserved_memory_bytes
    sp = spans(base, cluster)
    for rank, shape in enumerate(shapes):
        for layers, recomputed in itertools.product((1, 3, 10), (0, 1, 3)):
            if recomputed > layers or (base.recompute is Recompute.NONE and recomputed):
                continue
            counts = [base.layers_on_rank(r) for r in range(base.pp)]
            counts[rank] = layers
            plan = _with_rank_layers(base, counts, rank, recomputed)
            mem = stage_memory_at(model, TRAIN, plan, rank, layers, recomputed, reserved).total_bytes
            m = shape.memory
            base_b, per_layer, per_rc, jump = m.base, m.per_layer, m.per_recomputed, m.jump
            assert base_b + per_layer * layers + per_rc * recomputed + jump * (recomputed > 0) == pytest.approx(mem)
            times = rank_times(model, TRAIN, plan, cluster, sp, rank)
            assert shape.t[0] + shape.t[1] * layers + shape.t[2] * recomputed == pytest.approx(times.total_s)
            dp = sum(mult * max(c0 + c1 * layers - (w0 + w1 * layers + w2 * recomputed), bucket)
                     for mult, (c0, c1), (w0, w1, w2), bucket in shape.dp)
            assert dp == pytest.approx(dp_exposed_s(model, TRAIN, plan, cluster, sp, rank, times), abs=1e-12)
            held = rank_params(model, plan, rank)
            after = after_pipeline_s(model, TRAIN, plan, cluster, sp, held, layers)
            accumulate = grad_accumulation_s(model, TRAIN, plan, cluster, held, layers)
            fsdp = one_replica_fsdp_s(model, TRAIN, plan, cluster, held, layers)   # choice 0 has one replica
            assert shape.opt.intercept + shape.opt.slope * layers == pytest.approx(sum(after) + accumulate + fsdp)
            assert after[2] > 0 if model.is_moe else after[2] == 0   # (optimizer, host work, TP replica sync)


def _with_rank_layers(plan, counts, rank, recomputed):
    """A plan whose ranks hold `counts` layers (split evenly over their virtual stages)."""
    per_stage = [0] * plan.num_virtual_stages
    for r, n in enumerate(counts):
        for chunk in range(plan.vpp):
            per_stage[chunk * plan.pp + r] = n // plan.vpp + (chunk < n % plan.vpp)
    rc = [0] * plan.pp
    rc[rank] = recomputed
    return dataclasses.replace(plan, layers_per_stage=tuple(per_stage), recompute_num_layers=tuple(rc))


@pytest.mark.parametrize("seed", range(6))
def test_min_max_time_is_the_exact_min_max_over_splits(seed):
    """The slowest rank's least possible time (the bound the search prunes with and CP-SAT
    starts from) equals brute force over every split and every per-rank recompute count."""
    rng = random.Random(seed)
    pp, total, cap = 3, 7, 100.0
    recompute = seed % 2 == 0
    plan = build_plan(resolve_model("debug-tiny"), TrainSpec(seq_len=64, global_batch_size=4),
                      parse_cluster("1x3xA100"), Choice(pp=pp, recompute=Recompute.FULL if recompute else Recompute.NONE))
    memory = [AffineBytes(base=rng.uniform(0, 40), per_layer=rng.uniform(5, 25), per_recomputed=-rng.uniform(2, 15),
                          jump=rng.uniform(0, 10)) for _ in range(pp)]
    ts = [(rng.uniform(0, 2), 1.0, rng.uniform(0.2, 0.5)) for _ in range(pp)]
    ts = [Coefficients(t0, ts[0][1], ts[0][2]) for t0, _, _ in ts]  # per-layer costs are the same on every rank
    fit = MemoryFit(memory, plan, cap, total)
    best = math.inf
    for split in itertools.product(range(1, total + 1), repeat=pp):
        if sum(split) != total:
            continue
        slowest = 0.0
        for (t0, t1, t2), mem, layers in zip(ts, memory, split):
            options = [t0 + t1 * layers + t2 * n for n in (range(layers + 1) if recompute else [0])
                       if mem.at(layers, n) <= cap]
            slowest = max(slowest, min(options, default=math.inf))
        best = min(best, slowest)
    if not fit.fits:
        assert math.isinf(best)
        return
    assert min_max_time_s(ts, plan, fit, total) == pytest.approx(best)


def test_split_solver_falls_back_to_presolve_with_the_same_answer(monkeypatch):
    """Every attempt but the last stops at a deterministic budget; when only the last, with
    CP-SAT's defaults, has time, it must reach an optimum as good: the same layers, as many
    recomputed, the same closed-form step (ranks alike may swap which of them recomputes)."""
    model, cluster = resolve_model("llama2-13b"), parse_cluster("4x8xH100")
    plan = build_plan(model, TRAIN, cluster, Choice(tp=2, pp=4, zero_stage=1, recompute=Recompute.FULL,
                                                    schedule=Schedule.ZB_H1))
    tight = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=40 * 2**30))
    first = solve_split(model, TRAIN, tight, plan)
    monkeypatch.setattr(partition, "ATTEMPTS", [(params, 1e-9 if budget else None)
                                                for params, budget in partition.ATTEMPTS])
    second = solve_split(model, TRAIN, tight, plan)
    assert first is not None and first.optimal and second.optimal
    assert first.layers == second.layers and sum(first.recomputed) == sum(second.recomputed)
    one, two = (estimate(model, TRAIN, tight, partition.apply_split(plan, split), simulate=False)
                for split in (first, second))
    assert one.fits and two.fits
    assert one.step_time_s == pytest.approx(two.step_time_s, rel=1e-9)
    assert any(first.recomputed)  # the cap binds



def test_the_block_methods_shared_count_is_solved_per_count_alike():
    """Megatron's block method recomputes min(k, L_r) layers on every rank, k shared. Solved with
    k a variable, or once per k (what deep pipelines fall back to: CP-SAT proves the min of two
    variables slowly), the optimum is the same and obeys the rule."""
    from costmodel.estimate import estimate
    from planner.partition import SplitRules, _solve_per_block_count, apply_split
    model, cluster = resolve_model("llama2-13b"), parse_cluster("4x8xH100")
    plan = build_plan(model, TRAIN, cluster, Choice(tp=2, pp=8, zero_stage=1, recompute=Recompute.FULL,
                                                    micro_batch_size=2))
    tight = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=24 * 2**30))
    rules = SplitRules(split="free", recompute_counts="block")
    ranks = rank_shapes(model, TRAIN, tight, plan)
    fit = MemoryFit([r.memory for r in ranks], plan, partition.rank_caps_bytes(plan, tight), model.num_layers)
    shared = solve_split(model, TRAIN, tight, plan, rules=rules)
    per_count = _solve_per_block_count(model, plan, ranks, fit, math.inf, rules, math.inf,
                                       DenseChoice((first_stage_spread(model),)))
    for split in (shared, per_count):
        assert split is not None and split.optimal
        k = max(split.recomputed)
        assert split.recomputed == tuple(min(k, layers) for layers in split.layers)
    assert 0 < sum(per_count.recomputed) < model.num_layers   # the cap binds, not every layer
    steps = [estimate(model, TRAIN, tight, apply_split(plan, s)).closed_form_step_time_s for s in (shared, per_count)]
    assert steps[0] == pytest.approx(steps[1], rel=1e-9)
    assert sum(shared.recomputed) == sum(per_count.recomputed)
    # the counts skipped (no split fits under them, or every larger one is the all-recomputed
    # split) lose nothing: every count from 1 to the layer count solved alone finds no better
    from planner.split_model import SplitModel
    best = math.inf
    for k in range(1, model.num_layers + 1):
        alone = SplitModel(model, plan, ranks, fit, math.inf, rules, block_k=k)
        solver, status = alone.solve(math.inf, partition.ATTEMPTS)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            layers, recomputed = alone.solution(solver)
            split = partition.Split(layers=layers, recomputed=recomputed, optimal=True)
            best = min(best, estimate(model, TRAIN, tight, apply_split(plan, split)).closed_form_step_time_s)
    assert best == pytest.approx(steps[1], rel=1e-9)


def test_short_chunks_first_keeps_the_last_rank_within_the_closed_form():
    """The closed form prices a rank's activations as its in-flight chunks times its mean chunk.
    The last rank's short chunk last (under the LM head, apply_split) is the faster layout, but the
    simulation then finds more than that on it (the first chunk is the one most often in flight);
    laid out shortest first it finds no more, so a split the search found to fit still fits
    (repricing._simulated falls back to it)."""
    from costmodel.estimate import estimate
    from planner.partition import Split, apply_split, short_chunks_first
    model, cluster = resolve_model("llama3-8b"), parse_cluster("1x8xH100")
    plan = build_plan(model, TRAIN, cluster, Choice(tp=2, pp=4, vpp=2, zero_stage=1, recompute=Recompute.NONE))
    long_first = apply_split(plan, Split(layers=(7, 7, 7, 11), recomputed=(0,) * 4, optimal=True))
    short_first = short_chunks_first(long_first)
    assert (long_first.layers_per_stage[3], long_first.layers_per_stage[7]) == (6, 5)
    assert (short_first.layers_per_stage[3], short_first.layers_per_stage[7]) == (5, 6)
    assert short_first.layers_per_stage[:3] == long_first.layers_per_stage[:3]
    closed = estimate(model, TRAIN, cluster, long_first, simulate=False).peak_memory_bytes[3]
    assert estimate(model, TRAIN, cluster, short_first, simulate=False).peak_memory_bytes[3] == pytest.approx(closed)
    assert estimate(model, TRAIN, cluster, long_first).peak_memory_bytes[3] > closed
    assert estimate(model, TRAIN, cluster, short_first).peak_memory_bytes[3] <= closed


def test_the_search_keeps_a_split_whose_short_last_chunk_overflows():
    """On a device whose budget lies between the two layouts' simulated peaks, the re-pricing
    keeps the plan laid out shortest first instead of dropping it."""
    from costmodel.estimate import estimate
    from planner.partition import Split, apply_split, short_chunks_first
    from planner.repricing import _simulated
    from planner.search_options import SearchOptions
    from planner.search_result import Found
    from planner.search_state import SharedModels
    model, cluster = resolve_model("llama3-8b"), parse_cluster("1x8xH100")
    plan = build_plan(model, TRAIN, cluster, Choice(tp=2, pp=4, vpp=2, zero_stage=1, recompute=Recompute.NONE))
    long_first = apply_split(plan, Split(layers=(7, 7, 7, 11), recomputed=(0,) * 4, optimal=True))
    peaks = [max(estimate(model, TRAIN, cluster, p).peak_memory_bytes) for p in (long_first, short_chunks_first(long_first))]
    assert peaks[1] < peaks[0]
    device = dataclasses.replace(cluster.device, reported_memory_bytes=int(sum(peaks) / 2), memory_bytes=int(sum(peaks) / 2),
                                 efficiency=dataclasses.replace(cluster.device.efficiency, allocator_fragmentation=0.0))
    tight = dataclasses.replace(cluster, device=device, memory_headroom=0.0)
    shared = SharedModels(model, TRAIN, tight, SearchOptions())
    kept = _simulated(shared, Found(plan=long_first, estimate=estimate(model, TRAIN, tight, long_first, simulate=False)))
    assert kept.plan == short_chunks_first(long_first) and kept.estimate.fits


@pytest.mark.parametrize("vpp,layers", [(2, (7, 7, 7, 11)), (3, (16, 4, 6, 6)), (3, (10, 7, 7, 8)), (4, (10, 8, 7, 7))])
def test_with_short_chunks_first_the_closed_form_bounds_every_rank(vpp, layers):
    """Uneven chunks on every rank (a review's cases, where with three or four chunks the middle
    ones took the extra layers and the simulation found up to 0.7 GiB more than the closed form):
    laid out shortest first, no rank's simulated peak exceeds the closed form's."""
    from costmodel.estimate import estimate
    from planner.partition import Split, apply_split, short_chunks_first
    model, cluster = resolve_model("llama3-8b"), parse_cluster("1x8xH100")
    plan = build_plan(model, TRAIN, cluster, Choice(tp=2, pp=4, vpp=vpp, zero_stage=1, recompute=Recompute.NONE))
    laid = short_chunks_first(apply_split(plan, Split(layers=layers, recomputed=(0,) * 4, optimal=True)))
    closed = estimate(model, TRAIN, cluster, laid, simulate=False).peak_memory_bytes
    simulated = estimate(model, TRAIN, cluster, laid).peak_memory_bytes
    assert all(s <= c + 2**20 for s, c in zip(simulated, closed))


@pytest.mark.parametrize("mode,vpp", [(Recompute.NONE, 1), (Recompute.FULL, 1), (Recompute.NONE, 2)])
def test_least_overflow_split_is_the_min_max_over_every_split(mode, vpp):
    """How close a choice that fits under no split comes: no split of the layers (at least vpp
    a rank, every layer of the mode recomputed) overflows its worst rank less (every split by
    the ranks' memory shapes, which test_rank_shapes_match_the_cost_model ties to the model),
    and the plan so split is priced at that overflow."""
    from costmodel.estimate import estimate
    from costmodel.groups import rank_caps_bytes
    from costmodel.memory import stage_memory_shapes
    from planner.partition import apply_split, least_overflow_split
    model, cluster = resolve_model("llama2-13b"), parse_cluster("1x8xA100-40GB")
    train = TrainSpec(seq_len=4096, global_batch_size=32)
    plan = build_plan(model, train, cluster, Choice(tp=2, pp=4, vpp=vpp, zero_stage=0, recompute=mode,
                                                    micro_batch_size=4))
    caps = rank_caps_bytes(plan, cluster)
    memory = stage_memory_shapes(model, train, plan, cluster.device.efficiency.reserved_memory_bytes)
    recompute = mode is not Recompute.NONE

    def worst(layers):
        return max(m.at(n, n if recompute else 0) - cap for m, n, cap in zip(memory, layers, caps))
    found, headroom = least_overflow_split(model, train, cluster, plan)
    assert sum(found.layers) == model.num_layers and min(found.layers) >= vpp
    best = min(worst(layers) for layers in itertools.product(range(vpp, model.num_layers + 1), repeat=plan.pp)
               if sum(layers) == model.num_layers)
    assert 0 < worst(found.layers) == pytest.approx(best)   # a case that fits nowhere, at its least
    est = estimate(model, train, cluster, apply_split(plan, found), simulate=False)
    assert max(p - c for p, c in zip(est.peak_memory_bytes, caps)) == pytest.approx(best)
    assert est.min_headroom_fraction == pytest.approx(headroom)


def test_least_overflow_split_spreads_the_dense_first_layers_as_the_search_may():
    """With DeepSeek's dense first layers, the closest split is the least over every split the
    search may take, wherever apply_split then puts the dense layers (never on the last rank),
    and closer than any with all of them on the first stage."""
    from costmodel.estimate import estimate
    from costmodel.groups import rank_caps_bytes
    from costmodel.memory import reserved_bytes, stage_memory_shapes
    from costmodel.params import dense_layers_on_rank
    from planner.partition import Split, apply_split, least_overflow_split
    model = dataclasses.replace(resolve_model("deepseek-v2-lite"), first_k_dense=3, num_layers=12)
    cluster, train = parse_cluster("1x8xA100-40GB"), TrainSpec(seq_len=4096, global_batch_size=64)
    plan = build_plan(model, train, cluster, Choice(tp=1, pp=4, vpp=2, ep=2, zero_stage=0, recompute=Recompute.NONE,
                                                    micro_batch_size=2))
    caps = rank_caps_bytes(plan, cluster)
    reserved = reserved_bytes(model, train, plan, cluster.device, cluster.framework, cluster.devices_per_node)
    worst_by_placement: dict[tuple[int, ...], list[float]] = {}
    for layers in itertools.product(range(plan.vpp, model.num_layers + 1), repeat=plan.pp):
        if sum(layers) != model.num_layers:
            continue
        laid = apply_split(plan, Split(layers=layers, recomputed=(0,) * plan.pp, optimal=True))
        placed = tuple(dense_layers_on_rank(model, laid, r) for r in range(plan.pp))
        if placed[-1]:
            continue
        memory = stage_memory_shapes(model, train, plan, reserved, cluster.framework, dense=placed)
        worst_by_placement.setdefault(placed, []).append(max(m.at(n, 0) - c for m, n, c in zip(memory, layers, caps)))
    assert len(worst_by_placement) == 4   # every composition of the three dense layers over the first ranks
    best = min(min(w) for w in worst_by_placement.values())
    found, headroom = least_overflow_split(model, train, cluster, plan)
    est = estimate(model, train, cluster, apply_split(plan, found), simulate=False)
    assert 0 < max(p - c for p, c in zip(est.peak_memory_bytes, caps)) == pytest.approx(best)
    assert best < min(worst_by_placement[(3, 0, 0, 0)])
    assert est.min_headroom_fraction == pytest.approx(headroom)


def test_the_closest_split_keeps_a_layer_a_virtual_stage_and_is_none_where_no_spread_splits():
    """Llama 3 8B at PP8 VP3 (its first rank the tightest): no rank of the closest split holds
    fewer layers than virtual stages, and the plan so split is one our runtime runs. DeepSeek-V3
    at PP7 VP9 under Megatron (which offers it: its end stages may be empty): every spread of
    the three dense first layers asks for more than 61 layers (whole dense chunks of 9), so
    there is no closest split, and none is made up."""
    from costmodel.check import check_structure
    from planner.partition import apply_split, least_overflow_split
    from planner.specs import build_specs
    model, train, cluster = build_specs("llama3-8b", "1x8xA100-40GB", seq_len=32768, global_batch=64)
    plan = build_plan(model, train, cluster, Choice(tp=1, pp=8, vpp=3, recompute=Recompute.FULL))
    found, _ = least_overflow_split(model, train, cluster, plan)
    assert min(found.layers) >= plan.vpp and sum(found.layers) == model.num_layers
    assert not check_structure(model, train, cluster, apply_split(plan, found))
    model, train, cluster = build_specs("deepseek-v3", "7x8xA100-40GB", seq_len=4096, global_batch=56,
                                        framework="megatron")
    plan = build_plan(model, train, cluster, Choice(tp=1, pp=7, vpp=9, ep=8, recompute=Recompute.FULL))
    assert least_overflow_split(model, train, cluster, plan) is None


def test_nothing_fits_names_the_closest_split_where_the_framework_splits_freely():
    """A choice that fits under no split is told with the split that overflows least, not the
    even one, where the framework runs any split (ours); under an even-split framework, even."""
    from costmodel.inputs import UserError as Refusal
    from planner.api import search
    fix = {"tp": 1, "pp": 4, "cp": 1, "micro_batch_size": 4, "vpp": 1, "zero_stage": 1}   # tp 1: DeepSpeed's AutoTP does not run beside its pipeline
    messages = {}
    for framework in ("planner", "deepspeed"):
        with pytest.raises(Refusal) as refused:
            search("llama2-13b", "1x8xA100-40GB", framework=framework, fix=fix, no_recompute=True,
                   seq_len=4096, global_batch=32)
        messages[framework] = str(refused.value)
    over = {f: float(m.split(" GiB over")[0].rsplit(", ", 1)[1]) for f, m in messages.items()}
    assert over["planner"] < over["deepspeed"], messages
