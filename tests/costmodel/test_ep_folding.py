"""Megatron-Core's MoE parallel folding (costmodel.frameworks `ep_folds_over_tp`), as `validate`
prices Megatron-Core's Mixtral 8x22B mapping on 128 H100 (tp2 pp8 dp8 ep8): its EP groups are
two TP ranks and four data-parallel ones, inside a node, and each expert's states are sharded
over the two ranks holding it; carved from data parallelism (DeepSpeed's layout), EP crosses
nodes and each rank's expert states are whole. Our runtime folds as Megatron-Core does."""
import itertools
from dataclasses import replace

import pytest

from costmodel.check import check_structure
from costmodel.check_degrees import ep_problems
from costmodel.estimate import estimate
from costmodel.frameworks import RUNTIME, framework_traits
from costmodel.hardware import parse_cluster
from costmodel.params import expert_dp, folds_ep
from costmodel.placement import expert_layout
from costmodel.rank_time import spans
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan, divisors

MODEL = resolve_model("mixtral-8x22b")
CARVED = framework_traits("deepspeed")   # EP carved from data parallelism
TRAIN = TrainSpec(seq_len=4096, global_batch_size=256)


def _priced(traits):
    cluster = replace(parse_cluster("16x8xH100"), framework=traits)
    plan = build_plan(MODEL, TRAIN, cluster, Choice(tp=2, pp=8, ep=8, zero_stage=1, micro_batch_size=1))
    return cluster, plan, estimate(MODEL, TRAIN, cluster, plan)


def test_megatron_folds_expert_parallelism_over_tensor_parallelism():
    megatron = framework_traits("megatron-core")
    cluster, plan, folded = _priced(megatron)
    assert folds_ep(plan, megatron) and folds_ep(plan, RUNTIME) and not folds_ep(plan, CARVED)
    assert (expert_dp(plan, megatron), expert_dp(plan, RUNTIME), expert_dp(plan, CARVED)) == (2, 2, 1)
    sp = spans(plan, cluster)
    assert (sp.ep.size, sp.ep.num_nodes, sp.edp.size) == (8, 1, 2)
    _, _, carved = _priced(CARVED)
    # half the experts' optimizer states, and an all-to-all on NVLink rather than InfiniBand
    assert folded.max_peak_memory_bytes < carved.max_peak_memory_bytes - 5 * 2**30
    assert folded.time_breakdown_s["comm/ep_exposed"] < carved.time_breakdown_s["comm/ep_exposed"] / 2
    assert folded.fits   # the published run ran, so its plan must be predicted to fit


def _groups(layout, axes):
    """Every group of ranks that differ only along `axes` of the layout (ranks row-major over
    layout.order, as placement lays them out)."""
    ranges = [range(d) for d in layout.degrees]
    by_key = {}
    for rank, coords in enumerate(itertools.product(*ranges)):
        key = tuple(c for a, c in zip(layout.order, coords) if a not in axes)
        by_key.setdefault(key, set()).add(rank)
    return sorted(sorted(g) for g in by_key.values())


# (tp, cp, dp, pp, ep): EP over TP, over TP and part of DP, over TP x CP x DP whole, over CP
# before DP, inside part of TP (ep < tp), and tp 1 (folding is then carving)
LAYOUTS = [(2, 1, 4, 2, 2), (2, 1, 4, 2, 8), (2, 2, 2, 1, 8), (1, 2, 4, 1, 4), (4, 1, 2, 2, 2), (1, 1, 8, 2, 4),
           (2, 1, 16, 1, 32)]


@pytest.mark.parametrize("tp, cp, dp, pp, ep", LAYOUTS)
@pytest.mark.parametrize("megatron_order, order", [("tp-cp-ep-dp-pp", ("pp", "dp", "cp", "tp")),
                                                   ("tp-cp-ep-pp-dp", ("dp", "pp", "cp", "tp"))])
def test_folded_groups_are_megatron_cores_own(tp, cp, dp, pp, ep, megatron_order, order):
    """The EP and expert-DP groups placement.expert_layout folds are the ones Megatron-Core's
    parallel_state.RankGenerator builds with expert TP 1 (its expert grid tp-ep-dp-pp over the
    dense tp-cp-dp-pp ranks), and a layout it refuses (with pp not last, an expert DP other than
    dp) is one the fold refuses."""
    pytest.importorskip("megatron.core", reason="megatron-core (test extra) is not installed")
    from megatron.core.parallel_state import RankGenerator
    world = tp * cp * dp * pp
    degrees = tuple({"pp": pp, "dp": dp, "cp": cp, "tp": tp}[a] for a in order)
    layout = expert_layout(order, degrees, ep, True)
    edp = world // (ep * pp)
    if not megatron_order.endswith("pp") and pp > 1 and edp != dp:   # parallel_state's own assertion
        assert layout is None
        return
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=megatron_order)
    experts = RankGenerator(tp=1, ep=ep, dp=edp, pp=pp, cp=1, order=megatron_order)
    assert _groups(replace(layout, order=order, degrees=degrees), ("tp",)) == sorted(dense.get_ranks("tp"))
    assert _groups(layout, layout.ep_axes) == sorted(experts.get_ranks("ep"))
    assert _groups(layout, layout.edp_axes) == sorted(experts.get_ranks("dp"))


def _is_box(ranks, order, degrees) -> bool:
    """Whether a set of ranks is whole coordinate ranges of the mesh's axes: a product of one
    set of coordinates per axis, as a group over mesh axes (or their cut parts) is."""
    coords = set()
    for rank in ranks:
        c = []
        for d in reversed(degrees):
            c.append(rank % d)
            rank //= d
        coords.add(tuple(reversed(c)))
    axes = [sorted({c[i] for c in coords}) for i in range(len(order))]
    return coords == set(itertools.product(*axes))


def test_the_fold_takes_every_megatron_layout_a_mesh_group_can_be():
    """Every layout up to 32 ranks of Megatron's default order: where Megatron-Core's EP groups
    (etp 1) are whole ranges of the dense grid's axes, expert_layout lays the same groups out;
    where they straddle an axis unevenly (tp 4 with ep 6: a TP group and half another), it
    refuses (check_plan says so in one line), as a mesh group cannot be cut that way."""
    pytest.importorskip("megatron.core", reason="megatron-core (test extra) is not installed")
    from megatron.core.parallel_state import RankGenerator
    order, checked, refused = ("pp", "dp", "cp", "tp"), 0, 0
    for tp, cp, dp, pp in itertools.product((1, 2, 4), (1, 2), (1, 2, 3, 4, 8), (1, 2)):
        degrees = (pp, dp, cp, tp)
        for ep in divisors(tp * cp * dp)[1:]:
            experts = RankGenerator(tp=1, ep=ep, dp=tp * cp * dp // ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
            boxes = all(_is_box(g, order, degrees) for g in experts.get_ranks("ep"))
            layout = expert_layout(order, degrees, ep, True)
            assert (layout is not None) == boxes, (tp, cp, dp, pp, ep)
            if layout is None:
                refused += 1
                continue
            assert _groups(layout, layout.ep_axes) == sorted(experts.get_ranks("ep"))
            assert _groups(layout, layout.edp_axes) == sorted(experts.get_ranks("dp"))
            checked += 1
    assert checked > 150 and refused > 5


def _qwen3_plan(framework, **degrees):
    cluster = replace(parse_cluster("32x8xH100"), framework=framework_traits(framework))
    train = TrainSpec(seq_len=4096, global_batch_size=2048)
    choice = Choice(**{"tp": 2, "pp": 8, "ep": 32, "zero_stage": 1, "micro_batch_size": 1, "vpp": 4,
                       "sequence_parallel": True, **degrees})
    return cluster, train, build_plan(QWEN3, train, cluster, choice)


QWEN3 = resolve_model("qwen3-235b-a22b")


def test_megatron_runs_ep_beyond_dp_over_the_tp_ranks():
    """The model zoo's Qwen3-235B on 256 H100 at TP2 PP8 EP32 (dp 16): each EP group is 32 ranks,
    both TP ranks of 16 data-parallel ones, over 4 nodes; each expert on one rank only, so its
    states are whole on it and nothing is summed over TP."""
    cluster, train, plan = _qwen3_plan("megatron-core")
    assert plan.dp == 16 and folds_ep(plan, cluster.framework)
    assert not check_structure(QWEN3, train, cluster, plan)
    sp = spans(plan, cluster)
    assert (sp.ep.size, sp.ep.num_nodes, sp.ep.members_per_node, sp.edp.size) == (32, 4, 8, 1)
    assert expert_dp(plan, cluster.framework) == 1
    ledger = estimate(QWEN3, train, cluster, plan).time_breakdown_s
    # only the per-head Q/K norms are summed over TP (the experts' would take seconds)
    assert ledger["comm/ep_exposed"] > 0 and ledger["comm/tp_replica_sync"] < 1e-3


def test_a_fold_inside_the_tp_ranks_and_over_cp():
    """EP 2 under TP 4 takes two TP ranks, and the other two hold the same experts (their
    gradient group is tp/ep x cp x dp); with CP, Megatron's EP group takes the CP ranks before
    the data-parallel ones."""
    megatron = framework_traits("megatron-core")
    cluster = replace(parse_cluster("2x8xH100"), framework=megatron)
    plan = build_plan(MODEL, TRAIN, cluster, Choice(tp=4, pp=2, ep=2, zero_stage=1, micro_batch_size=1,
                                                     sequence_parallel=True))
    assert folds_ep(plan, megatron) and expert_dp(plan, megatron) == 2 * plan.dp
    sp = spans(plan, cluster)
    assert (sp.ep.size, sp.edp.size) == (2, 2 * plan.dp)
    plan = build_plan(MODEL, TrainSpec(seq_len=4096, global_batch_size=32), cluster,
                      Choice(tp=2, cp=2, pp=1, ep=8, zero_stage=1, micro_batch_size=1, sequence_parallel=True))
    sp = spans(plan, cluster)
    assert plan.dp == 4 and (sp.ep.size, sp.ep.num_nodes, sp.edp.size, sp.edp.num_nodes) == (8, 1, 2, 2)
    assert expert_dp(plan, megatron) == 2 and expert_dp(plan, CARVED) == plan.edp * plan.cp


@pytest.mark.parametrize("framework, flags, message", [
    ("deepspeed", ["--tp", "2", "--pp", "8", "--ep", "32"],
     "ep=32 does not divide dp=16: deepspeed carves the expert-parallel group from the data-parallel one"),
    ("megatron", ["--tp", "2", "--pp", "16", "--ep", "32"], "ep=32 is more than the tp x cp x dp = 16 ranks"),
    ("megatron", ["--tp", "2", "--pp", "8", "--ep", "32", "--mesh-order", "dp,pp,cp,tp"],
     "ep=32 does not fold over tp2 x pp8 x dp16 (megatron-core takes the ep innermost ranks"),
])
def test_an_expert_layout_the_framework_cannot_lay_out_is_one_line_exit_2(capsys, framework, flags, message):
    from planner.cli import main
    assert main(["predict", "--model", "qwen3-235b-a22b", "--cluster", "32x8xH100", "--seq-len", "4096",
                 "--global-batch", "2048", "--sp", "--framework", framework, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_search_holds_ep_beyond_dp_only_where_the_framework_folds():
    """`planner search --model qwen3-235b-a22b --cluster 32x8xH100 --framework megatron` holds
    EP up to a pipeline stage's tp x cp x dp ranks, as our runtime's does; DeepSpeed's, up to dp."""
    from planner.candidates import placement_groups
    from planner.search import SearchOptions
    from planner.specs import build_specs
    from planner.targets import options_for
    beyond = {}
    for framework in ("megatron", "planner", "deepspeed"):
        model, train, cluster = build_specs("qwen3-235b-a22b", "32x8xH100", framework=framework)
        options = options_for(framework, model, train, cluster, SearchOptions(fixed={"tp": 2, "pp": 8, "cp": 1}))
        groups = list(placement_groups(model, train, cluster, options, lambda reason: None))
        beyond[framework] = {g.base.ep for g in groups if g.base.ep > g.base.dp}
        assert all(not ep_problems(model, g.base.ep, dp=g.base.dp, tp=g.base.tp, cp=g.base.cp, pp=g.base.pp,
                                   order=order, traits=cluster.framework) for g in groups for order in g.orders)
    assert beyond == {"megatron": {32}, "planner": {32}, "deepspeed": set()}

