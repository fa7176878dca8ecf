"""Expert tensor parallelism (Plan.etp, Megatron-Core's --expert-tensor-parallel-size): each routed
expert split over the etp innermost ranks of the expert grid etp x ep x edp that re-decomposes tp x
cp x dp, the routed rows all-gathered over those ranks before the experts and reduce-scattered
after; only where the framework has it (costmodel.frameworks `expert_tensor_parallel`)."""
import itertools
import json
from dataclasses import replace

import pytest

from costmodel.check import check_structure
from costmodel.estimate import estimate
from costmodel.frameworks import framework_traits
from costmodel.hardware import parse_cluster
from costmodel.kernels.gemm import _moe_gemms_s, expert_rows, gemm_s
from costmodel.params import expert_dp, expert_params, rank_params
from costmodel.placement import expert_layout
from costmodel.plan import Plan, PlanFile
from costmodel.rank_time import spans
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan, divisors
from tests.costmodel.test_ep_folding import _groups, _is_box

MIXTRAL = resolve_model("mixtral-8x7b")
TRAIN = TrainSpec(seq_len=4096, global_batch_size=64)
MEGATRON = framework_traits("megatron-core")


def _plan(ep: int, etp: int, traits=MEGATRON, tp: int = 4, pp: int = 2):
    cluster = replace(parse_cluster("2x8xH100"), framework=traits)
    return cluster, build_plan(MIXTRAL, TRAIN, cluster, Choice(tp=tp, pp=pp, ep=ep, etp=etp, zero_stage=1,
                                                               micro_batch_size=1))


def test_expert_groups_are_megatron_cores_own():
    """Every layout up to 32 ranks of Megatron's default order and every etp x ep dividing a
    stage's ranks: where Megatron-Core's expert TP and EP groups (parallel_state.RankGenerator's
    expert grid, its tp the expert TP size) are whole ranges of the dense grid's axes,
    expert_layout lays out the same expert-TP, EP and expert-DP groups; elsewhere it refuses."""
    pytest.importorskip("megatron.core", reason="megatron-core (test extra) is not installed")
    from megatron.core.parallel_state import RankGenerator
    order, checked, refused = ("pp", "dp", "cp", "tp"), 0, 0
    for tp, cp, dp, pp in itertools.product((1, 2, 4), (1, 2), (1, 2, 3, 4, 8), (1, 2)):
        degrees = (pp, dp, cp, tp)
        for etp in divisors(tp * cp * dp)[1:]:
            for ep in divisors(tp * cp * dp // etp):
                grid = RankGenerator(tp=etp, ep=ep, dp=tp * cp * dp // (etp * ep), pp=pp, cp=1, order="tp-cp-ep-dp-pp")
                boxes = all(_is_box(g, order, degrees) for g in grid.get_ranks("ep") + grid.get_ranks("tp"))
                layout = expert_layout(order, degrees, ep, True, etp)
                assert (layout is not None) == boxes, (tp, cp, dp, pp, etp, ep)
                if layout is None:
                    refused += 1
                    continue
                assert _groups(layout, layout.etp_axes) == sorted(grid.get_ranks("tp"))
                assert _groups(layout, layout.ep_axes) == sorted(grid.get_ranks("ep"))
                assert _groups(layout, layout.edp_axes) == sorted(grid.get_ranks("dp"))
                checked += 1
    assert checked > 250 and refused > 10


def test_experts_split_over_etp_and_their_gradient_group():
    """At etp 2 a rank holds half of each of its experts; the experts' states are sharded over
    world / (etp x ep x pp) ranks, and the ETP group is two TP ranks of a node."""
    cluster, one = _plan(ep=8, etp=1)
    _, two = _plan(ep=4, etp=2)
    assert expert_params(MIXTRAL, 2) * 2 == expert_params(MIXTRAL)
    held_one, held_two = rank_params(MIXTRAL, one, 0), rank_params(MIXTRAL, two, 0)
    assert held_two.experts == held_one.experts and held_two.layers == held_one.layers
    assert (expert_dp(one, MEGATRON), expert_dp(two, MEGATRON)) == (1, 1)
    _, wide = _plan(ep=2, etp=2)
    assert rank_params(MIXTRAL, wide, 0).experts == 2 * held_one.experts   # 4 experts, half of each
    assert expert_dp(wide, MEGATRON) == 16 // (2 * 2 * 2)
    sp = spans(two, cluster)
    assert (sp.etp.size, sp.etp.num_nodes, sp.ep.size, sp.edp.size) == (2, 1, 4, 1)
    assert not check_structure(MIXTRAL, TRAIN, cluster, two)


def test_expert_gemms_run_the_gathered_rows_at_a_share_of_the_width():
    """The experts' GEMMs at etp 2: twice the rows (gathered over the ETP ranks) at half the
    width; their FLOPs are etp 1's."""
    dev = parse_cluster("1x8xH100").device
    model = replace(MIXTRAL, shared_expert_ffn_hidden_size=0)
    tokens, h, f = 2048, model.hidden_size, model.moe_ffn_hidden_size
    local = model.num_experts // 4
    rows = round(2 * expert_rows(model, TRAIN, tokens, 4) / local)   # gathered over the 2 ETP ranks
    router = gemm_s(tokens, h, model.num_experts, dev, TRAIN)
    fwd, _, _ = _moe_gemms_s(model, TRAIN, dev, tokens, 4, etp=2)
    expected = router + local * (2 * gemm_s(rows, h, f // 2, dev, TRAIN) + gemm_s(rows, f // 2, h, dev, TRAIN))
    assert fwd == pytest.approx(expected)


def test_etp_prices_the_gathers_of_the_routed_rows():
    """etp x ep = 8 either way: the expert-TP plan adds an all-gather and a reduce-scatter of
    the routed rows over its ETP group each way, so its exposed expert communication is more."""
    cluster, one = _plan(ep=8, etp=1)
    _, two = _plan(ep=4, etp=2)
    a = estimate(MIXTRAL, TRAIN, cluster, one).time_breakdown_s
    b = estimate(MIXTRAL, TRAIN, cluster, two).time_breakdown_s
    assert b["comm/ep_exposed"] > a["comm/ep_exposed"] > 0
    assert b["compute/forward"] == pytest.approx(a["compute/forward"], rel=0.1)


def test_plan_json_carries_etp_and_an_older_one_loads_as_etp_1():
    _, plan = _plan(ep=4, etp=2)
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan
    assert plan.short().endswith("1f1b") and " etp2 " in plan.short()
    _, flat = _plan(ep=8, etp=1)
    data = flat.to_dict()
    assert "etp" not in data and Plan.from_dict(data).etp == 1


def _predict(capsys, framework: str, *flags: str) -> str:
    from planner.cli import main
    capsys.readouterr()
    assert main(["predict", "--model", "mixtral-8x7b", "--cluster", "2x8xH100", "--seq-len", "4096",
                 "--global-batch", "64", "--framework", framework, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    return err


@pytest.mark.parametrize("framework, flags, message", [
    ("megatron", ["--tp", "4", "--pp", "2", "--ep", "4", "--etp", "3"],
     "etp=3 does not divide the experts' width moe_ffn_hidden_size=14336"),
    ("megatron", ["--tp", "4", "--pp", "2", "--ep", "8", "--etp", "2"],
     "etp x ep = 2 x 8 is more than the tp x cp x dp = 8 ranks of a pipeline stage"),
    ("megatron", ["--tp", "4", "--pp", "2", "--ep", "4", "--etp", "2", "--mesh-order", "dp,pp,cp,tp"],
     "etp x ep = 2 x 4 does not fold over tp4 x pp2 x dp2"),
    ("planner", ["--tp", "4", "--pp", "2", "--ep", "2", "--etp", "2"],
     "etp=2: planner does not split experts over tensor-parallel ranks"),
    ("torchtitan", ["--tp", "4", "--pp", "2", "--ep", "2", "--etp", "2"],
     "etp=2: torchtitan does not split experts over tensor-parallel ranks"),
])
def test_bad_expert_tensor_parallelism_is_one_line_exit_2(capsys, framework, flags, message):
    assert message in _predict(capsys, framework, *flags)


def test_a_target_without_expert_tp_refuses_an_etp_plan_in_one_line(tmp_path, capsys):
    """A plan searched for Megatron-Core with expert TP: an export to torchtitan refuses it in one
    line (our runtime trains it: tests/runtime/test_moe_etp.py)."""
    from planner.cli import main
    plan = tmp_path / "plan.json"
    assert main(["predict", "--model", "mixtral-8x7b", "--cluster", "2x8xH100", "--tp", "4", "--pp", "2", "--ep", "4",
                 "--etp", "2", "--seq-len", "4096", "--global-batch", "64", "--framework", "megatron",
                 "--out", str(plan), "--json"]) == 0
    assert PlanFile.load(plan).plan.etp == 2
    capsys.readouterr()
    assert main(["export", str(plan), "--to", "torchtitan", "--out", str(tmp_path / "job.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "etp=2: torchtitan does not split experts" in err


def test_the_search_holds_etp_only_where_the_framework_has_it():
    """Megatron's space holds etp dividing tp (with the ep that tiles the rest); our runtime's
    and torchtitan's hold etp 1 only; --fix etp= pins it."""
    from planner.candidates import placement_groups
    from planner.search import SearchOptions
    from planner.specs import build_specs
    from planner.targets import options_for
    held = {}
    for framework in ("megatron", "planner", "torchtitan"):
        model, train, cluster = build_specs("mixtral-8x7b", "2x8xH100", seq_len=4096, global_batch=64,
                                            framework=framework)
        options = options_for(framework, model, train, cluster, SearchOptions(fixed={"tp": 4, "pp": 2, "cp": 1}))
        groups = list(placement_groups(model, train, cluster, options, lambda reason: None))
        held[framework] = {(g.base.ep, g.base.etp) for g in groups}
    assert {etp for _, etp in held["megatron"]} == {1, 2, 4}
    assert (4, 2) in held["megatron"] and (2, 4) in held["megatron"]
    assert {etp for _, etp in held["planner"] | held["torchtitan"]} == {1}
    model, train, cluster = build_specs("mixtral-8x7b", "2x8xH100", seq_len=4096, global_batch=64,
                                        framework="megatron")
    options = options_for("megatron", model, train, cluster, SearchOptions(fixed={"tp": 4, "pp": 2, "etp": 2}))
    assert {g.base.etp for g in placement_groups(model, train, cluster, options, lambda reason: None)} == {2}


def test_the_search_with_expert_tensor_parallelism_matches_brute_force():
    """The small mixture of test_search_exact under Megatron-Core, its memory tight: brute force
    over every plan Megatron runs, each under every etp x ep its layout takes (etp dividing tp),
    finds the search's best step time (the search's bounds hold with etp)."""
    from costmodel.check import check_structure as valid
    from planner import targets
    from planner.search import SearchOptions, search
    from tests.planner.test_search_exact import CASES, _better, _tight, brute_force_best
    model, cluster_name, batch, memory = CASES[2]
    train = TrainSpec(seq_len=64, global_batch_size=batch)
    cluster = targets.cluster_for("megatron", _tight(parse_cluster(cluster_name), memory))
    found = [None]

    def keep(plan):   # every expert grid of the plan's degrees, priced beside it
        if plan.ep == 1 and not targets.changes("megatron", model, train, cluster, plan):
            for etp in divisors(plan.tp):
                for ep in divisors(plan.tp * plan.cp * plan.dp // etp):
                    grid = replace(plan, ep=ep, etp=etp)
                    if not valid(model, train, cluster, grid):
                        found[0] = _better(model, train, cluster, grid, found[0])
        return False
    brute_force_best(model, train, cluster, keep=keep)
    result = search(model, train, cluster, targets.options_for("megatron", model, train, cluster,
                                                               SearchOptions(top_k=1, max_tp=4)))
    best = min(result.evaluated, key=lambda f: f.estimate.closed_form_step_time_s)
    assert result.stats.optimal and found[0] is not None
    assert best.estimate.closed_form_step_time_s == pytest.approx(found[0][0], rel=1e-6), \
        (best.plan.short(), found[0][1].short())
