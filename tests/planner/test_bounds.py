"""The search's first bound (planner.bounds) never exceeds what the cost model predicts for any
layer split and recompute count of the candidate: otherwise the branch and bound could skip the
optimum."""
import dataclasses
import random
from functools import partial

import pytest

from costmodel.estimate import estimate
from costmodel.hardware import parse_cluster
from costmodel.plan import Recompute
from costmodel.registry import resolve_model
from costmodel.schedules import Schedule
from costmodel.specs import TrainSpec
from planner.bounds import MemoryFit, lower_bound_s, lower_bound_with_memory_s, time_floor_s
from planner.search_options import STATE_OPTIONS, SearchOptions, States
from planner.search_state import SharedModels
from planner.shapes import rank_shapes
from planner.space import Choice, build_plan

TRAIN = TrainSpec(seq_len=4096, global_batch_size=64)


def _random_split(plan, rng):
    """Random layers per virtual stage (at least one each) and recompute counts per rank."""
    stages, total = plan.num_virtual_stages, sum(plan.layers_per_stage)
    cuts = sorted(rng.sample(range(1, total), stages - 1))
    layers = tuple(b - a for a, b in zip([0] + cuts, cuts + [total]))
    probe = dataclasses.replace(plan, layers_per_stage=layers)
    counts = tuple(0 if plan.recompute is Recompute.NONE else rng.randint(1, probe.layers_on_rank(r))
                   for r in range(plan.pp))
    return dataclasses.replace(probe, recompute_num_layers=counts)


@pytest.mark.parametrize("choice", [
    Choice(tp=2, pp=4, zero_stage=1, recompute=Recompute.FULL, schedule=Schedule.ZB_H1),
    Choice(tp=4, pp=4, vpp=2, zero_stage=3, recompute=Recompute.SELECTIVE, micro_batch_size=2),
    Choice(tp=2, pp=2, cp=2, zero_stage=2, schedule=Schedule.GPIPE),
    Choice(tp=8, pp=1, zero_stage=0, micro_batch_size=4),
])
def test_first_bound_is_below_every_split(choice):
    model, cluster = resolve_model("llama2-13b"), parse_cluster("4x8xH100")
    plan = build_plan(model, TRAIN, cluster, choice)
    bound = lower_bound_s(model, TRAIN, cluster, plan)
    # not vacuous: at least half of the even split with every layer recomputed (build_plan's)
    assert bound >= 0.5 * estimate(model, TRAIN, cluster, plan, simulate=False).step_time_s
    rng = random.Random(0)
    for _ in range(20):
        split = _random_split(plan, rng)
        assert bound <= estimate(model, TRAIN, cluster, split, simulate=False).step_time_s * (1 + 1e-12)


def _near_even_split(plan, rng):
    """Move a few layers between neighbouring stages of the even split; recompute most layers."""
    layers = list(plan.layers_per_stage)
    for _ in range(3):
        j = rng.randrange(len(layers) - 1)
        if layers[j] > 1:
            layers[j] -= 1
            layers[j + 1] += 1
    probe = dataclasses.replace(plan, layers_per_stage=tuple(layers))
    counts = tuple(rng.randint(max(1, probe.layers_on_rank(r) - 2), probe.layers_on_rank(r)) for r in range(plan.pp))
    return dataclasses.replace(probe, recompute_num_layers=counts)


@pytest.mark.parametrize("choice", [
    Choice(tp=2, pp=4, zero_stage=1, recompute=Recompute.FULL, schedule=Schedule.ZB_H1),
    Choice(tp=4, pp=4, vpp=2, zero_stage=3, recompute=Recompute.SELECTIVE, micro_batch_size=2),
    Choice(tp=2, pp=4, zero_stage=1, recompute=Recompute.FULL, schedule=Schedule.ONE_F_ONE_B),
])
def test_memory_aware_bound_is_below_every_split_that_fits(choice):
    model, cluster = resolve_model("llama2-13b"), parse_cluster("4x8xH100")
    plan = build_plan(model, TRAIN, cluster, choice)
    # a cap the even split with every layer recomputed meets with a little room
    full = max(estimate(model, TRAIN, cluster, plan, simulate=False).peak_memory_bytes)
    cap = full * 1.15
    tight = dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, memory_bytes=cap))
    shapes = rank_shapes(model, TRAIN, tight, plan)
    fit = MemoryFit([s.memory for s in shapes], plan, cap, model.num_layers)
    bound = lower_bound_with_memory_s(shapes, plan, fit, model.num_layers)
    assert fit.fits
    rng, fitting = random.Random(1), 0
    for _ in range(200):
        est = estimate(model, TRAIN, tight, _near_even_split(plan, rng), simulate=False)
        if est.fits:
            fitting += 1
            assert bound <= est.step_time_s * (1 + 1e-12)
    assert fitting >= 5


@pytest.mark.parametrize("choice,framework", [
    (Choice(tp=2, ep=4, zero_stage=1, micro_batch_size=2), "megatron-core"),   # EP folded over TP
    (Choice(tp=2, pp=2, ep=2, zero_stage=3, recompute=Recompute.FULL), "megatron-core"),
    (Choice(pp=2, zero_stage=3, micro_batch_size=2, offload_optimizer=True), "planner"),   # host copies
    (Choice(pp=2, zero_stage=1, offload_optimizer=True, fp8_linears=True), "planner"),
])
def test_the_bound_holds_for_folded_offloaded_and_float8_plans(choice, framework):
    """The levers added to the space keep the first bound valid: experts sharded over tp times
    more ranks when a framework folds EP over TP (priced over dp x cp only, the floor would sit
    above the estimate), the host's copies and step, float8 linears."""
    from costmodel.frameworks import framework_traits
    model = resolve_model("qwen1.5-moe-a2.7b" if choice.ep > 1 else "llama3-8b")
    cluster = dataclasses.replace(parse_cluster("1x8xH100"), framework=framework_traits(framework))
    train = dataclasses.replace(TRAIN, float8=choice.fp8_linears)
    plan = build_plan(model, train, cluster, choice)
    bound = lower_bound_s(model, train, cluster, plan)
    rng = random.Random(0)
    for _ in range(20):
        split = _random_split(plan, rng)
        assert bound <= estimate(model, train, cluster, split, simulate=False).step_time_s * (1 + 1e-12)


@pytest.mark.parametrize("choice", [
    Choice(tp=2, pp=4, zero_stage=1, recompute=Recompute.FULL, schedule=Schedule.ONE_F_ONE_B),
    Choice(tp=2, pp=4, vpp=2, zero_stage=1, schedule=Schedule.INTERLEAVED, micro_batch_size=2),
    Choice(tp=4, pp=2, zero_stage=3, schedule=Schedule.ZB_H1),
])
def test_the_search_s_first_bound_holds_on_a_mixed_cluster(choice):
    """The search's first bound on a mixed cluster: the fastest group's costs everywhere, and
    the slowest rank at least L / sum(1/c_r) over the groups' times per layer."""
    model, cluster = resolve_model("llama2-13b"), parse_cluster("2x8xA100+2x8xH100")
    plan = build_plan(model, TRAIN, cluster, choice)
    shared = SharedModels(model, TRAIN, cluster, SearchOptions())
    timed = shared.time_model(dataclasses.replace(choice, dp=plan.dp, vpp=1, schedule=Schedule.ONE_F_ONE_B))
    zero = timed.zero_floors_s[STATE_OPTIONS.index(States(choice.zero_stage, False))]
    floor = partial(time_floor_s, model, timed.rtm, plan.pp, plan.num_micro_batches, plan.schedule, plan.vpp,
                    plan.recompute)
    bound = floor(timed.slowest_floor_s) + zero
    assert bound > floor() + zero   # the groups' speeds raise it
    rng = random.Random(0)
    for _ in range(20):
        split = _random_split(plan, rng)
        est = estimate(model, TRAIN, cluster, split, simulate=False)
        assert bound <= est.closed_form_step_time_s * (1 + 1e-12)


@pytest.mark.parametrize("name", ["llama2-13b", "mixtral-8x7b", "deepseek-v2-lite"])
def test_a_rank_time_model_reads_pp_only_as_a_pipeline_and_never_dp(name):
    """planner.search_state.SharedModels shares one rank time model between choices that differ
    only in dp and in pp (beyond having a pipeline) under the same spans, and between pipeline
    spans up to its sends."""
    from costmodel.rank_time import rank_time_model, spans
    from costmodel.rank_time.layer_comm import pp_rank_sends_s
    model, cluster = resolve_model(name), parse_cluster("8x8xH100")
    train = TrainSpec(seq_len=4096, global_batch_size=256)
    for recompute in Recompute:
        choices = [Choice(tp=2, pp=pp, ep=2 if model.is_moe else 1, recompute=recompute, micro_batch_size=2)
                   for pp in (2, 4, 8)]
        plans = [build_plan(model, train, cluster, c) for c in choices]
        sp = spans(plans[0], cluster)
        models = [rank_time_model(model, train, plan, cluster, sp) for plan in plans]
        assert len({plan.dp for plan in plans}) == 3 and models[1] == models[0] == models[2]
        # the pipeline's span only for its sends (costmodel.rank_time.layer_comm.pp_rank_sends_s)
        across = dataclasses.replace(sp, pp=spans(dataclasses.replace(plans[2], mesh_axis_order=("tp", "cp", "dp", "pp")),
                                                  cluster).pp)
        assert across.pp != sp.pp and rank_time_model(model, train, plans[0], cluster, across) == (
            models[0].with_pp_sends(pp_rank_sends_s(model, train, plans[0], cluster, across.pp)))


@pytest.mark.parametrize("model_name, cluster_name, framework", [
    ("llama2-13b", "4x8xH100", "planner"), ("mixtral-8x7b", "2x8xH100", "planner"),
    ("deepseek-v2-lite", "4x8xA100", "planner"), ("llama2-13b", "4x8xH100", "megatron"),
    ("mixtral-8x7b", "2x8xH100", "megatron")])   # EP folded over TP, beyond dp
def test_a_group_s_floors_are_below_each_of_its_candidates_bounds(model_name, cluster_name, framework):
    """The branch and bound takes a Group by floors that price none of its mesh orders
    (SharedModels.group_floors_s); each candidate's own bound (its order's rank time model and
    ZeRO floor, planner.search_order) is at or above the floor of its variant and placement."""
    from planner.candidates import placement_groups
    from planner.search_options import states_for_group
    from planner.specs import build_specs
    from planner.targets import options_for
    model, train, cluster = build_specs(model_name, cluster_name, framework=framework)
    options = options_for(framework, model, train, cluster, SearchOptions())
    shared = SharedModels(model, train, cluster, options)
    checked = 0
    for group in list(placement_groups(model, train, cluster, options, lambda reason: None))[::7]:
        pipeline, after = shared.group_floors_s(group)
        base, m = group.base, train.global_batch_size // group.base.dp // group.base.micro_batch_size
        for order in group.orders:
            timed = shared.time_model(dataclasses.replace(base, mesh_axis_order=order))
            for v, (vpp, schedule) in enumerate(group.variants):
                pipe = time_floor_s(model, timed.rtm, base.pp, m, schedule, vpp, base.recompute, timed.slowest_floor_s)
                for z, (o, ok) in enumerate(zip(STATE_OPTIONS, shared.zero_allowed)):
                    if ok and states_for_group(o, base.dp * base.cp > 1):
                        assert pipeline[v] + after[z] <= pipe + timed.zero_floors_s[z]
                        checked += 1
    assert checked > 100


@pytest.mark.parametrize("framework", ["planner", "megatron-core", "torchtitan"])
@pytest.mark.parametrize("zero", [0, 1, 3])
def test_the_states_floor_is_below_every_rank_s_memory_with_a_shared_expert(framework, zero):
    """planner.bounds.states_floor (which prunes a choice before its activations are priced) and
    the optimizer floor read the shared expert as the framework holds it: split over TP under
    Megatron-Core and torchtitan (costmodel.frameworks shared_expert_tp), whole under our runtime."""
    from costmodel.frameworks import framework_traits
    from costmodel.memory import stage_memory_shapes
    from costmodel.params import rank_params
    from costmodel.rank_time import after_pipeline_s, spans
    from planner.bounds import optimizer_floor_s, states_floor
    traits = framework_traits(framework)
    model = resolve_model("deepseek-v2-lite")
    cluster = dataclasses.replace(parse_cluster("2x8xH100"), framework=traits)
    plan = build_plan(model, TRAIN, cluster, Choice(tp=4, pp=2, ep=2, zero_stage=zero, recompute=Recompute.FULL))
    floor = states_floor(model, TRAIN, plan, 0.0, traits)
    for shape in stage_memory_shapes(model, TRAIN, plan, 0.0, traits):
        assert floor.per_layer <= shape.per_layer + shape.per_recomputed
    sp = spans(plan, cluster)
    steps = [sum(after_pipeline_s(model, TRAIN, plan, cluster, sp, rank_params(model, plan, r, traits),
                                  plan.layers_on_rank(r))) for r in range(plan.pp)]
    assert optimizer_floor_s(model, TRAIN, cluster, plan.tp, plan.pp, plan.dp * plan.cp, zero, plan.ep) \
        <= max(steps) * (1 + 1e-12)


@pytest.mark.parametrize("model_name, cluster_name, framework", [
    ("llama2-13b", "4x8xH100", "planner"), ("deepseek-v2-lite", "4x8xA100", "megatron"),
    ("mixtral-8x7b", "2x8xH100", "megatron"), ("llama2-13b", "2x8xA100+2x8xH100", "planner")])
def test_a_family_s_floor_is_below_each_of_its_groups_floors(model_name, cluster_name, framework):
    """Groups alike but for recompute mode and activation offload enter the queue as one family
    under the floor of their relaxation (planner.search_order); the search opens a family only
    when its floor is reached, so that floor must be at or below each of its groups' own, for
    the families it never opens too."""
    import time

    from planner.candidates import placement_groups
    from planner.search_order import _FAMILY, _GROUP, Queue
    from planner.search_result import SearchStats
    from planner.specs import build_specs
    from planner.targets import options_for
    model, train, cluster = build_specs(model_name, cluster_name, framework=framework)
    options = options_for(framework, model, train, cluster, SearchOptions())
    shared = SharedModels(model, train, cluster, options)
    queue = Queue(shared, placement_groups(model, train, cluster, options, lambda reason: None), SearchStats(),
                  time.perf_counter() + 600)
    families = [(floor, members) for floor, kind, _, members in queue.heap if kind == _FAMILY]
    modes = set()
    for floor, members in families:
        for member in members:
            own, kind, _, (group, *_) = queue._group(*member)
            assert kind == _GROUP and own >= floor
            modes.add((group.base.recompute, group.base.offload_activations))
    assert len(families) > 20 and {mode for mode, _ in modes} == set(Recompute)
    assert (Recompute.NONE, True) in modes or framework == "megatron"   # offloaded activations: our runtime's


@pytest.mark.parametrize("name,cluster_name,choice,gbs", [
    # Megatron-Core's expert all-to-all overlap, whose share hidden grows with the micro-batches
    ("deepseek-v2-lite", "4x8xH100", dict(tp=1, pp=1, ep=16, micro_batch_size=1), 256),
    ("deepseek-v2-lite", "4x8xH100", dict(tp=1, pp=1, ep=32, micro_batch_size=1), 256),
    # its interleaved schedule's gradient sends, hidden past the flush's share
    ("llama2-13b", "4x8xH100", dict(tp=2, pp=4, vpp=5, micro_batch_size=1, sequence_parallel=True), 256),
])
def test_the_searchs_shared_models_bound_megatron_cores_overlaps_from_below(name, cluster_name, choice, gbs):
    """The search shares one rank time model between plans of different micro-batch counts
    (planner.search_state.SharedModels); what Megatron-Core hides (expert all-to-alls, pipeline
    gradient sends) depends on that count, so a bound read from the shared model takes the least
    it hides and a plan's rows take its own: neither may exceed the plan's price."""
    from costmodel.frameworks import FRAMEWORKS, with_ep_overlap
    from costmodel.hardware import run_by
    from planner.shapes import pipeline_rows
    model, train = resolve_model(name), TrainSpec(seq_len=4096, global_batch_size=gbs)
    traits = FRAMEWORKS["megatron-core"]
    cluster = run_by(parse_cluster(cluster_name), with_ep_overlap(traits) if model.is_moe else traits)
    for z in (0, 1):
        c = Choice(zero_stage=z, **choice)
        plan = build_plan(model, train, cluster, c)
        shared = SharedModels(model, train, cluster, SearchOptions())
        base = dataclasses.replace(c, dp=plan.dp, vpp=1, schedule=None, zero_stage=0)
        timed = shared.time_model(base)
        zero = timed.zero_floors_s[STATE_OPTIONS.index(States(z, False))]
        priced = estimate(model, train, cluster, plan, simulate=False).closed_form_step_time_s
        floor = time_floor_s(model, shared.floor_rtm(timed.rtm, base.ep), plan.pp, plan.num_micro_batches,
                             plan.schedule, plan.vpp, plan.recompute) + zero
        assert floor <= priced * (1 + 1e-12)
        assert lower_bound_s(model, train, cluster, plan) <= priced * (1 + 1e-12)
        # the plan's own rows are its price's: the shared model read as the plan is priced
        ts, _ = pipeline_rows(shared.plan_rtm(timed.rtm, plan), plan)
        exact, _ = pipeline_rows(_rank_time_model_of(model, train, cluster, plan), plan)
        assert ts == exact


def _rank_time_model_of(model, train, cluster, plan):
    from costmodel.rank_time import rank_time_model, spans
    return rank_time_model(model, train, plan, cluster, spans(plan, cluster))


@pytest.mark.parametrize("tp,pp,ep,zero,fp8", [(2, 16, 32, 0, True), (2, 16, 32, 1, True), (2, 8, 64, 1, True),
                                                (2, 8, 64, 0, False)])
def test_the_states_floors_are_below_every_rank_wherever_a_split_puts_the_dense_layers(tp, pp, ep, zero, fp8):
    """DeepSeek-V3's dense first layers weigh less a device than its expert layers here (a whole
    dense MLP over TP against 256/EP experts): each rank's floor, as the search builds them (less
    what the dense layers it may hold may weigh less), lies below its memory under every spread
    of them, at every layer count (pricing every layer as an expert layer puts it above a rank
    holding dense layers in three of these layouts)."""
    from costmodel.frameworks import framework_traits
    from costmodel.memory import stage_memory_shapes
    from planner.bounds import states_floor
    from planner.dense_spreads import dense_spreads, reachable
    traits = framework_traits("megatron-core")
    model, train = resolve_model("deepseek-v3"), TrainSpec(seq_len=4096, global_batch_size=1024)
    cluster = dataclasses.replace(parse_cluster("128x8xH100"), framework=traits)
    plan = build_plan(model, train, cluster, Choice(tp=tp, pp=pp, ep=ep, fp8_linears=fp8, zero_stage=zero,
                                                    recompute=Recompute.FULL))
    floors = [states_floor(model, train, plan, 0.0, traits, d) for d in reachable(model, plan)]
    assert floors[-1].base == 0.0   # no dense layer reaches the last rank: its floor gives nothing back
    for spread in dense_spreads(model, plan):
        shapes = stage_memory_shapes(model, train, plan, 0.0, traits, dense=spread.per_rank(pp))
        for floor, shape, (lo, _) in zip(floors, shapes, spread.layer_bounds(pp, plan.vpp, model.num_layers)):
            for layers in (lo, lo + 1, 8, 16):
                below = floor.base + floor.per_layer * layers
                assert below <= min(shape.at(layers, 0), shape.at(layers, layers)) + 1.0, (spread, layers)


def test_a_float8_choice_s_states_floor_is_not_a_16_bit_one_s():
    """Megatron-Core's float8 linears hold Transformer Engine's cached float8 weights beside the
    16-bit ones at ZeRO-0, so the states floor of a float8 choice is above the same degrees'
    16-bit one: asked first, it must not stand for the other (a 16-bit choice that fits would
    be priced nowhere)."""
    from costmodel.frameworks import framework_traits
    from costmodel.groups import rank_caps_bytes
    from planner.bounds import states_floor
    model = resolve_model("llama3-70b")
    train = TrainSpec(seq_len=4096, global_batch_size=64)
    cluster = dataclasses.replace(parse_cluster("5x2xH200"), framework=framework_traits("megatron-core"))
    shared = SharedModels(model, train, cluster, SearchOptions())
    reserved = cluster.device.efficiency.reserved_memory_bytes
    fits = {}
    for fp8 in (True, False):   # float8 first, as the search may ask
        choice = Choice(tp=2, pp=5, dp=1, zero_stage=0, fp8_linears=fp8)
        plan = build_plan(model, train, cluster, choice)
        fit = shared._states_fit(choice, 0, plan, rank_caps_bytes(plan, cluster))
        assert fit.memory[0].per_layer == pytest.approx(states_floor(model, train, plan, reserved,
                                                                     cluster.framework).per_layer)
        fits[fp8] = fit.fits
    assert fits == {True: False, False: True}
