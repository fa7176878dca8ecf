"""The spreads of DeepSeek's dense first layers the search solves (planner.dense_spreads): each is
the layout apply_split makes of the splits its constraints admit, its ranks' shapes are the cost
model's for those splits, and the bounds the search prunes with lie below every spread."""
import dataclasses
import random

import pytest
from ortools.sat.python import cp_model

from costmodel.hardware import parse_cluster
from costmodel.memory import reserved_bytes, stage_memory_at, stage_memory_shapes
from costmodel.params import dense_layers_by_stage, rank_params
from costmodel.plan import Recompute
from costmodel.rank_time import (
    after_pipeline_s,
    dp_exposed_s,
    grad_accumulation_s,
    one_replica_fsdp_s,
    rank_time_model,
    rank_times,
    spans,
)
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.dense_spreads import (
    DenseSpread,
    dense_spreads,
    least_memory_shapes_by_zero,
    least_pipeline_rows,
    reachable,
)
from planner.partition import Split, apply_split
from planner.shapes import pipeline_rows, rank_shapes
from planner.space import Choice, build_plan

TRAIN = TrainSpec(seq_len=4096, global_batch_size=512)
V3 = resolve_model("deepseek-v3")
CLUSTER = parse_cluster("128x8xH100")


def _plan(pp=8, vpp=4):
    return build_plan(V3, TRAIN, CLUSTER, Choice(tp=2, pp=pp, vpp=vpp, ep=64, zero_stage=1,
                                                 recompute=Recompute.SELECTIVE))


def _splits(plan, spread, count, seed=0):
    """`count` random splits of the model's layers (at least vpp a rank) that `spread` admits."""
    rng, out = random.Random(seed), []
    while len(out) < count:
        layers = [plan.vpp] * plan.pp
        for _ in range(V3.num_layers - sum(layers)):
            layers[rng.randrange(plan.pp)] += 1
        if spread.admits(tuple(layers), plan.vpp):
            out.append(tuple(layers))
    return out


def test_the_spreads_are_every_way_to_put_three_dense_layers_on_the_first_stages():
    assert [s.per_stage for s in dense_spreads(V3, _plan())] == [(3,), (1, 2), (2, 1), (1, 1, 1)]
    assert [s.per_stage for s in dense_spreads(V3, _plan(pp=2, vpp=1))] == [(3,)]   # never on the last rank
    assert [s.per_stage for s in dense_spreads(resolve_model("llama3-8b"), _plan())] == [(0,)]
    assert reachable(V3, _plan()) == (3, 2, 1, 0, 0, 0, 0, 0)


@pytest.mark.parametrize("pp,vpp", [(8, 4), (4, 1), (4, 2), (16, 1), (2, 1)])
def test_a_spread_admits_exactly_the_splits_apply_split_lays_out_so(pp, vpp):
    """For random splits: admits == apply_split's layout starts with the spread == the CP-SAT
    constraints are satisfiable with the layers fixed; a split is admitted by one spread, or by
    none where the dense layers reach the last rank (drawn: the first ranks short enough that
    every spread, and that, occur)."""
    plan = _plan(pp, vpp)
    rng = random.Random(pp * 10 + vpp)
    seen = set()
    for _ in range(300):
        head = [vpp * rng.randint(1, 3) + rng.randrange(vpp) for _ in range(min(3, pp - 1))]
        tail = [vpp] * (pp - len(head))
        for _ in range(V3.num_layers - sum(head) - sum(tail)):
            tail[rng.randrange(len(tail))] += 1
        layers = head + tail
        laid = dense_layers_by_stage(V3, apply_split(plan, Split(layers=tuple(layers), recomputed=(0,) * pp,
                                                                 optimal=True)))
        admitted = []
        for spread in dense_spreads(V3, plan):
            cm = cp_model.CpModel()
            L = [cm.NewIntVar(n, n, f"L{r}") for r, n in enumerate(layers)]
            spread.constrain(cm, L, vpp, V3.num_layers)
            feasible = cp_model.CpSolver().Solve(cm) == cp_model.OPTIMAL
            admits = spread.admits(tuple(layers), vpp)
            assert feasible == admits == (laid[:len(spread.per_stage)] == spread.per_stage), (layers, spread)
            admitted += [spread] * admits
        assert len(admitted) == (1 if laid[pp - 1] == 0 else 0), (layers, laid)
        seen.add(admitted[0].per_stage if admitted else None)
    assert seen == {s.per_stage for s in dense_spreads(V3, plan)} | ({None} if pp < 4 else set()), seen


@pytest.mark.parametrize("spread", [DenseSpread((1, 2)), DenseSpread((2, 1)), DenseSpread((1, 1, 1))])
def test_a_spread_s_rank_shapes_are_the_cost_model_s(spread):
    plan = _plan()
    sp = spans(plan, CLUSTER)
    reserved = reserved_bytes(V3, TRAIN, plan, CLUSTER.device, CLUSTER.framework, CLUSTER.devices_per_node)
    shapes = rank_shapes(V3, TRAIN, CLUSTER, plan, dense=spread.per_rank(plan.pp))
    for layers in _splits(plan, spread, 3):
        concrete = apply_split(plan, Split(layers=layers, recomputed=layers, optimal=True))
        for rank, shape in enumerate(shapes):
            L = layers[rank]
            mem = stage_memory_at(V3, TRAIN, concrete, rank, L, L, reserved).total_bytes
            assert shape.memory.at(L, L) == pytest.approx(mem)
            times = rank_times(V3, TRAIN, concrete, CLUSTER, sp, rank)
            assert shape.t.base + shape.t.per_layer * L + shape.t.per_recomputed * L == pytest.approx(times.total_s)
            held = rank_params(V3, concrete, rank)
            after = (sum(after_pipeline_s(V3, TRAIN, concrete, CLUSTER, sp, held, L))
                     + grad_accumulation_s(V3, TRAIN, concrete, CLUSTER, held, L)
                     + one_replica_fsdp_s(V3, TRAIN, concrete, CLUSTER, held, L))
            assert shape.opt.intercept + shape.opt.slope * L == pytest.approx(after)
            dp = sum(mult * max(c0 + c1 * L - (w0 + w1 * L + w2 * L), bucket)
                     for mult, (c0, c1), (w0, w1, w2), bucket in shape.dp)
            assert dp == pytest.approx(dp_exposed_s(V3, TRAIN, concrete, CLUSTER, sp, rank, times), abs=1e-12)


def test_the_bounds_lie_below_every_spread():
    """The memory shapes a candidate is first checked with and the pipeline rows its floor reads:
    each rank's least over the spreads, exactly the lowest of the spreads' own."""
    plan = _plan()
    reserved = reserved_bytes(V3, TRAIN, plan, CLUSTER.device, CLUSTER.framework, CLUSTER.devices_per_node)
    least = least_memory_shapes_by_zero(V3, TRAIN, [plan], reserved, CLUSTER.framework)[0]
    rtm = rank_time_model(V3, TRAIN, plan, CLUSTER, spans(plan, CLUSTER))
    ts, fs = least_pipeline_rows(V3, rtm, plan)
    spreads = [s.per_rank(plan.pp) for s in dense_spreads(V3, plan)]
    exact = [stage_memory_shapes(V3, TRAIN, plan, reserved, CLUSTER.framework, held) for held in spreads]
    rows = [pipeline_rows(rtm, plan, held) for held in spreads]
    moved = 0
    for r in range(plan.pp):
        assert all(least[r].per_layer == e[r].per_layer and ts[r][1:] == t[r][1:] and fs[r][1:] == f[r][1:]
                   for e, (t, f) in zip(exact, rows))
        assert least[r].base == min(e[r].base for e in exact)
        assert ts[r].base == min(t[r].base for t, _ in rows) and fs[r].base == min(f[r].base for _, f in rows)
        moved += len({e[r].base for e in exact}) > 1
    assert moved == 3   # the dense layers move the first three ranks' memory


@pytest.mark.parametrize("dense,framework,zero,mbs,pp,vpp", [
    (3, None, 1, 1, 8, 4), (3, None, 1, 2, 8, 2), (3, None, 1, 1, 16, 1),
    # two dense layers under ZeRO-3: a rank's optimizer step read where it holds them (a review's case)
    (2, "torchtitan", 3, 1, 4, 1),
])
def test_one_model_over_every_spread_finds_the_best_of_the_spreads_solved_alone(dense, framework, zero, mbs, pp, vpp):
    """The search solves a candidate's spreads in one CP-SAT model (the shapes with no dense
    layer and what each adds): its optimum is the least of each spread's own, under the closed
    form the search ranks by."""
    from costmodel.estimate import estimate
    from costmodel.frameworks import FRAMEWORKS
    from costmodel.groups import rank_caps_bytes
    from costmodel.hardware.clusters import run_by
    from planner.bounds import MemoryFit, min_max_time_s
    from planner.dense_spreads import DenseChoice, DenseDelta
    from planner.partition import solve_split
    model = dataclasses.replace(V3, first_k_dense=dense)
    cluster = run_by(CLUSTER, FRAMEWORKS[framework]) if framework else CLUSTER
    plan = build_plan(model, TRAIN, cluster, Choice(tp=2, pp=pp, vpp=vpp, ep=64, zero_stage=zero,
                                                    recompute=Recompute.FULL, micro_batch_size=mbs))
    total, caps = model.num_layers, rank_caps_bytes(plan, cluster)
    reserved = reserved_bytes(model, TRAIN, plan, cluster.device, cluster.framework, cluster.devices_per_node)

    def closed_form_s(split):
        return estimate(model, TRAIN, cluster, apply_split(plan, split), simulate=False).step_time_s

    alone, slowest = [], []
    for spread in dense_spreads(model, plan):
        held = spread.per_rank(plan.pp)
        memory = stage_memory_shapes(model, TRAIN, plan, reserved, cluster.framework, held)
        fit = MemoryFit(memory, plan, caps, total, spread.layer_bounds(plan.pp, plan.vpp, total))
        shapes = rank_shapes(model, TRAIN, cluster, plan, memory=memory, dense=held)
        split = solve_split(model, TRAIN, cluster, plan, ranks=shapes, fit=fit, dense=DenseChoice((spread,)))
        if split is not None:
            alone.append(closed_form_s(split))
            slowest.append(min_max_time_s([r.t for r in shapes], plan, fit, total))
    assert len(alone) >= 2, alone   # the spreads compete
    least = least_memory_shapes_by_zero(model, TRAIN, [plan], reserved, cluster.framework)[0]
    none, most = (0,) * plan.pp, reachable(model, plan)
    without, full = (rank_shapes(model, TRAIN, cluster, plan, dense=held,
                                 memory=stage_memory_shapes(model, TRAIN, plan, reserved, cluster.framework, held))
                     for held in (none, most))
    deltas = tuple(DenseDelta.between(a, b, n) if n else None for a, b, n in zip(without, full, most))
    choice = DenseChoice(tuple(dense_spreads(model, plan)), deltas, min(slowest))
    joint = solve_split(model, TRAIN, cluster, plan, ranks=without, fit=MemoryFit(least, plan, caps, total),
                        dense=choice)
    assert joint is not None and joint.optimal
    assert any(s.admits(joint.layers, plan.vpp) for s in choice.spreads)
    assert closed_form_s(joint) == pytest.approx(min(alone), rel=1e-6)
