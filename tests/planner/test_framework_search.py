"""`--framework`: the search holds only the plans the framework runs as they are (its export's
verdict, planner.targets), exactly, and prices them as it runs them; published layouts that the
included runtime cannot fit fit under the framework that ran them; bad input is one line."""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.hardware import parse_cluster
from costmodel.plan import PlanFile
from costmodel.specs import TrainSpec
from planner import targets
from planner.cli import main
from planner.search import SearchOptions, search
from tests.planner.test_search_exact import CASES, _tight, brute_force_best

FRAMEWORKS = ["megatron", "torchtitan", "deepspeed"]


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_search_under_a_framework_matches_brute_force(name):
    """Brute force over every plan the framework runs (every degree, schedule, split and
    per-rank recompute count, kept when its export would change nothing) finds the search's
    best step time: narrowing the space (schedules, orders, split rules in CP-SAT, SP without
    its dominance where the framework has none) loses no plan."""
    model, cluster_name, batch, memory = CASES[0]
    train = TrainSpec(seq_len=64, global_batch_size=batch)
    cluster = targets.cluster_for(name, _tight(parse_cluster(cluster_name), memory))
    def keep(plan):
        return not targets.changes(name, model, train, cluster, plan)
    expected = brute_force_best(model, train, cluster, keep=keep)
    if expected is None:   # the search offloads states only where nothing fits on the device
        expected = brute_force_best(model, train, cluster, keep=keep,
                                    states=[(zero, offload) for zero in range(4) for offload in (False, True)])
    result = search(model, train, cluster,
                    targets.options_for(name, model, train, cluster, SearchOptions(top_k=1, max_tp=4)))
    assert result.stats.optimal and expected is not None
    best = min(result.evaluated, key=lambda f: f.estimate.closed_form_step_time_s)
    assert best.estimate.closed_form_step_time_s == pytest.approx(expected[0], rel=1e-6), \
        (best.plan.short(), expected[1].short())
    assert all(not targets.changes(name, model, train, cluster, f.plan) for f in result.evaluated)


def test_the_framework_is_said_and_kept_in_the_plan_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["search", "--model", "llama3-8b", "--cluster", "2x8xH100", "--seq-len", "4096", "--global-batch",
                 "64", "--framework", "megatron", "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["search"]["framework"] == "megatron"
    pf = PlanFile.load(out)
    assert pf.cluster.framework.name == "megatron-core" and json.loads(out.read_text())["cluster"]["framework"]
    assert main(["predict", "--plan", str(out), "--json"]) == 0
    predicted = json.loads(capsys.readouterr().out)
    assert predicted["framework"] == "megatron"
    assert predicted["estimate"]["step_time_s"] == pytest.approx(doc["plans"][0]["estimate"]["step_time_s"])
    assert main(["predict", "--plan", str(out)]) == 0
    assert "priced as megatron-core runs plans" in capsys.readouterr().out


# NeMo's Llama 2 70B layout (TP4 + SP, PP4, VPP5, DP4, the distributed optimizer, 4,096 tokens,
# micro-batch 1, no recomputation) and Megatron-Core's Mixtral 8x7B mapping (EP8 over DP16, PP4,
# VPP8) on 64 H100-80GB: both ran in Megatron, and fit as our runtime runs them too, which keeps
# the SP shard rather than the gathered input (runtime.sequence_parallel) and frees pipeline
# buffers once consumed (runtime.pipeline), as Megatron does
PUBLISHED = {
    "nemo-llama2-70b": ["--model", "llama2-70b", "--tp", "4", "--sp", "--pp", "4", "--vpp", "5", "--zero", "1",
                        "--global-batch", "128"],
    "mcore-mixtral-8x7b": ["--model", "mixtral-8x7b", "--pp", "4", "--vpp", "8", "--ep", "8", "--zero", "1",
                           "--global-batch", "256"],
}


@pytest.mark.parametrize("name", list(PUBLISHED))
@pytest.mark.parametrize("framework", ["megatron", "planner"])
def test_published_layouts_fit_as_megatron_and_the_runtime_run_them(name, framework, capsys):
    flags = [*PUBLISHED[name], "--cluster", "8x8xH100", "--seq-len", "4096", "--mbs", "1", "--json"]
    assert main(["predict", *flags, "--framework", framework]) == 0
    assert json.loads(capsys.readouterr().out)["estimate"]["fits"]


def test_megatron_cores_mixtral_8x22b_mapping_fits_as_megatron(capsys):
    """The Megatron-Core MoE model zoo's Mixtral 8x22B (run_mixtral_8x22B.sh, runtime.conf: TP2 PP8
    EP8 VPP7 MBS1 GBS256 on 16 H100 nodes, SP, distributed optimizer, no recomputation; the
    validate table's modelzoo_h100_mixtral_8x22b rows) fits: its first stage holds 63 layer
    micro-batches of interleaved 1F1B, each routed slot keeping only its weight (the weight
    multiplies inside the experts' SwiGLU: frameworks.moe_probs_in_activation)."""
    flags = ["--model", "mixtral-8x22b", "--cluster", "16x8xH100", "--tp", "2", "--sp", "--pp", "8", "--vpp", "7",
             "--ep", "8", "--zero", "1", "--mbs", "1", "--global-batch", "256", "--seq-len", "4096", "--json"]
    assert main(["predict", *flags, "--framework", "megatron"]) == 0
    estimate = json.loads(capsys.readouterr().out)["estimate"]
    assert estimate["fits"] and max(estimate["peak_memory_bytes"]) > 0.9 * 69.7 * 2**30   # near the edge, as run


# Megatron-Bridge's DeepSeek-V3 on 1,024 H100s (the calibration row mb2509_deepseek_h100_fp8_g1024)
V3_H100 = ["--model", "deepseek-v3", "--cluster", "128x8xH100", "--seq-len", "4096", "--global-batch", "8192",
           "--framework", "megatron", "--dtype", "fp8", "--recompute-modules", "mla_up_proj,mlp", "--ep-overlap",
           "--grad-dtype", "bf16"]


def test_the_search_spreads_deepseek_s_dense_layers_over_the_first_stages(capsys):
    """TP2 PP8 VP4 EP64 CP1 with selective recomputation (Megatron-Bridge's degrees): the 3 dense
    first layers all on the first stage ask the first rank for 12 layers (its stages even), which
    do not fit; spread over the first stages, as Megatron-Core's own layout Et|(tt|)*30mL spreads
    them, the search finds the plan, faster than predict's default layout of the same degrees."""
    fixed = [f"--fix={kv}" for kv in ("tp=2", "pp=8", "vpp=4", "ep=64", "cp=1", "mbs=1", "zero=1",
                                      "recompute=selective", "fp8=true", "etp=1")]
    assert main(["search", *V3_H100, *fixed, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)["plans"][0]
    layers = tuple(found["plan"]["layers_per_stage"])
    starts = [sum(layers[:j]) for j in range(len(layers))]
    by_stage = [max(0, min(start + n, 3) - start) for start, n in zip(starts, layers)]
    assert 0 < by_stage[0] < 3 and by_stage[1] > 0, layers   # spread over the first two ranks' first stages
    assert main(["predict", *V3_H100, "--tp", "2", "--pp", "8", "--vpp", "4", "--ep", "64", "--zero", "1",
                 "--recompute", "selective", "--json"]) == 0
    default = json.loads(capsys.readouterr().out)["estimate"]
    assert default["fits"] and found["estimate"]["step_time_s"] < default["step_time_s"]


def test_a_choice_that_fits_no_spread_of_the_dense_layers_is_too_big_not_bounded(capsys):
    """TP4 PP4 VP2 EP64 at 5,120 tokens: the least memory over where the dense layers may go
    fits, no spread of them does. The choice counts as too big (the closest plan says by how
    much), not as pruned by the bound (which left the message saying vpp 2 was impossible)."""
    fixed = [f"--fix={kv}" for kv in ("tp=4", "pp=4", "vpp=2", "ep=64", "cp=1", "mbs=1", "zero=1", "etp=1",
                                      "recompute=selective", "offload=no", "act_offload=no")]
    assert main(["search", "--model", "deepseek-v3", "--cluster", "128x8xH100", "--seq-len", "5120",
                 "--global-batch", "8192", "--framework", "megatron", *fixed]) == 2
    err = capsys.readouterr().err
    assert "nothing fits: the closest plan" in err and "GiB over" in err and "contradictory" not in err, err


@pytest.mark.parametrize("argv,message", [
    (["search", "--model", "llama3-8b", "--cluster", "1x8xH100", "--framework", "nemo"],
     "argument --framework: invalid choice: 'nemo'"),
    (["predict", "--model", "llama3-8b", "--cluster", "1x8xH100", "--pp", "2", "--schedule", "zb-h1",
      "--framework", "deepspeed"], "--framework deepspeed cannot run this plan as it is: schedule zb-h1"),
    (["search", "--model", "llama3-8b", "--cluster", "1x8xH100", "--schedule", "zb-h1", "--framework", "deepspeed"],
     "--framework deepspeed: schedule zb-h1 is not one it runs (1f1b)"),
    (["search", "--model", "llama3-8b", "--cluster", "1x8xA100+1x8xH100", "--framework", "megatron"],
     "megatron cannot run a mixed cluster"),
    (["search", "--model", "gpt3", "--cluster", "16x8xA100", "--framework", "torchtitan"],
     "--framework torchtitan: torchtitan cannot run this plan: it has no model of the gpt kind"),
    (["search", "--model", "llama3-8b", "--cluster", "1x8xH100", "--framework", "torchtitan", "--dtype", "fp16"],
     "--framework torchtitan: torchtitan cannot run this plan: its mixed precision is bf16 or fp32, not fp16"),
    (["search", "--model", "llama3-8b", "--cluster", "1x8xH100", "--framework", "torchtitan", "--grad-dtype", "bf16"],
     "it reduces gradients in fp32 (training.mixed_precision_reduce), not bf16"),
    (["predict", "--model", "llama3-8b", "--cluster", "1x8xH100", "--framework", "torchtitan", "--tp", "2",
      "--zero", "0"], "--framework torchtitan cannot run this plan as it is: zero 0 beside other parallelism"),
    (["predict", "--model", "mixtral-8x7b", "--cluster", "8x8xH100", "--framework", "deepspeed", "--ep", "8",
      "--zero", "3"], "--framework deepspeed cannot run this plan as it is: zero 3 with experts"),
    (["predict", "--model", "llama3-8b", "--cluster", "1x8xH100", "--framework", "megatron", "--attention", "eager",
      "--cp", "2", "--tp", "2", "--recompute", "full"], "its context parallelism runs in Transformer Engine's fused"),
    (["search", "--model", "llama3-8b", "--cluster", "1x8xH100", "--framework", "megatron", "--grad-dtype", "fp16"],
     "megatron cannot run this plan: it keeps gradients in fp32 or in the parameters' bf16, not in fp16"),
    (["search", "--model", "llama3-8b", "--cluster", "1x8xH100", "--framework", "megatron", "--export", "deepspeed"],
     "contradictory flags: --export deepspeed"),
    (["search", "--model", "llama3-8b", "--cluster", "4x8xH100", "--framework", "deepspeed", "--fix", "dp_replicate=2"],
     "dp_replicate=2: deepspeed does not shard over part of the data-parallel ranks"),
    (["predict", "--model", "llama3-8b", "--cluster", "4x8xH100", "--framework", "deepspeed", "--dp-replicate", "2"],
     "dp_replicate=2 (hybrid sharding): deepspeed does not shard over part of the data-parallel ranks"),
    (["predict", "--model", "llama3-8b", "--cluster", "4x8xH100", "--framework", "deepspeed", "--tp", "8", "--zero", "3",
      "--sp"], "zero 3 with tensor parallelism: DeepSpeed's AutoTP trains with ZeRO-0/1/2 (it would run ZeRO-2); "
               "sequence parallelism: DeepSpeed's AutoTP has none (it would run tensor parallelism without it)"),
    (["predict", "--model", "llama3-8b", "--cluster", "4x8xH100", "--framework", "deepspeed", "--tp", "8", "--pp", "2"],
     "--framework deepspeed cannot run this plan as it is: its AutoTP (tp 8) does not combine with its pipeline "
     "engine (pp 2)"),
    (["search", "--model", "qwen3-30b-a3b", "--cluster", "2x8xH100", "--framework", "torchtitan", "--fix", "pp=2"],
     "--framework torchtitan: torchtitan builds qwen3-30b-a3b without a pipeline (its train spec has no "
     "pipelining_fn); pp 2 is not one it runs"),
    (["predict", "--model", "qwen3-30b-a3b", "--cluster", "2x8xH100", "--framework", "torchtitan", "--pp", "2",
      "--ep", "8"], "--framework torchtitan cannot run this plan as it is: its qwen3 model (30B-A3B) runs without "
                    "a pipeline (the qwen3 train spec has no pipelining_fn), not at pp 2"),
    (["search", "--model", "mixtral-8x7b", "--cluster", "8x8xH100", "--ep-overlap"],
     "--ep-overlap is Megatron-Core's --overlap-moe-expert-parallel-comm: it needs --framework megatron"),
    (["search", "--model", "llama3-8b", "--cluster", "1x8xH100", "--framework", "megatron", "--ep-overlap"],
     "--ep-overlap needs a mixture of experts, and llama3-8b is dense"),
    (["predict", "--model", "mixtral-8x7b", "--cluster", "8x8xH100", "--framework", "megatron", "--ep-overlap",
      "--pp", "2", "--ep", "8"], "ep_overlap: needs an interleaved pipeline (vpp of 2 or more) where pp > 1"),
])
def test_bad_framework_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("framework", ["torchtitan", "planner"])
def test_the_search_weighs_hybrid_sharding_where_the_framework_runs_it(framework, tmp_path, capsys):
    """Llama 3 8B on 64 nodes: ZeRO over a node's 8 ranks or a few nodes', replicated over the rest,
    is among the plans the search ranks; pinned, it is the plan written and exported."""
    from planner import api
    found = api.search("llama3-8b", "64x8xH100", framework=framework, top=10).plans   # rows proven that far
    assert any(f.plan.dp_replicate > 1 for f in found), [f.plan.short() for f in found]
    out = tmp_path / "plan.json"
    assert main(["search", "--model", "llama3-8b", "--cluster", "64x8xH100", "--framework", framework,
                 "--fix", "dp_replicate=64", "--out", str(out), "--json"]) == 0
    plan = PlanFile.load(out).plan
    assert plan.dp_replicate == 64 and plan.zero_stage >= 1 and f"hsdp64x{plan.dp // 64}" in plan.short()


def test_float8_with_tensor_parallelism_is_a_frameworks_not_the_runtimes(capsys):
    """Transformer Engine runs fp8 GEMMs inside Megatron's TP layers; our runtime does not apply
    torchao's float8 TP styles (costmodel.frameworks `float8_with_tp`)."""
    flags = ["predict", "--model", "llama3-8b", "--cluster", "1x8xH100", "--tp", "2", "--dtype", "fp8",
             "--seq-len", "4096", "--global-batch", "64", "--json"]
    assert main([*flags, "--framework", "megatron"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["fp8_linears"]
    assert main(flags) == 2
    assert "the runtime runs float8 linears without tensor parallelism" in capsys.readouterr().err
    # the table's first line says the plan's linears run in float8, not only its compute dtype
    assert main([*flags[:-1], "--framework", "megatron"]) == 0
    assert "(bf16 with float8 linears, adamw," in capsys.readouterr().out.splitlines()[0]


def test_published_fp8_runs_are_read_with_float8_linears(tmp_path):
    import csv

    from planner.measure.validate import validate
    source = Path(__file__).resolve().parents[2] / "profiles" / "runs" / "published_runs.csv"
    rows = [r for r in csv.DictReader(source.open()) if r["id"] == "dgxc_v24111_llama31_70b_h100_fp8_g256"]
    table = tmp_path / "fp8.csv"
    with table.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    results, summary = validate(table)
    assert results[0].plan.fp8_linears and results[0].plan.tp > 1 and results[0].fits
    assert summary["max_abs_error_pct"] <= 10.0


def test_the_stages_and_modes_a_framework_declares_are_those_its_export_keeps():
    """A target's ZERO_STAGES and RECOMPUTE_MODES (planner.exports.torchtitan) leave the search's
    listing (planner.targets): they must be exactly what its `nearest` keeps, or the search would
    lose plans the framework runs."""
    from costmodel.plan import Recompute
    from planner.exports import torchtitan
    from planner.space import Choice, build_plan
    from planner.specs import build_specs
    model, train, cluster = build_specs("llama3-8b", "2x8xH100", framework="torchtitan")
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        for zero in range(4):
            for mode in Recompute:
                plan = build_plan(model, train, cluster, Choice(tp=tp, pp=pp, zero_stage=zero, recompute=mode,
                                                                mesh_axis_order=torchtitan.ORDER))
                kept = torchtitan.nearest(PlanFile(plan=plan, model=model, train=train, cluster=cluster)).plan
                # DDP (zero 0) only on a one-dimensional mesh: beside TP or PP it is ZeRO-2
                one_dimensional = zero != 0 or tp == pp == 1
                assert (kept.zero_stage == zero) == (zero in torchtitan.ZERO_STAGES and one_dimensional)
                assert (kept.recompute is mode) == (mode in torchtitan.RECOMPUTE_MODES)
    options = targets.options_for("torchtitan", model, train, cluster, SearchOptions())
    assert options.space.zero_stages == torchtitan.ZERO_STAGES
    assert options.space.recompute_modes == torchtitan.RECOMPUTE_MODES


@pytest.mark.parametrize("name", ["megatron", "deepspeed"])
def test_the_stages_a_frameworks_pipeline_runs_are_those_its_export_keeps(name):
    """A target's ZERO_STAGES_WITH_PP leave the listing of its pipelined choices (SharedModels.
    placements): exactly the ZeRO stages its `nearest` keeps under a pipeline, and every stage it
    runs for the training (DeepSpeed's zero_stages: no ZeRO-0 with fp32 gradients of bf16) without one."""
    from planner.search_options import STATE_OPTIONS
    from planner.search_state import SharedModels
    from planner.space import Choice, build_plan
    from planner.specs import build_specs
    module = targets._module(name)
    model, train, cluster = build_specs("llama3-8b", "2x8xH100", framework=name)
    options = targets.options_for(name, model, train, cluster, SearchOptions())
    shared = SharedModels(model, train, cluster, options)
    runs = module.zero_stages(train) if hasattr(module, "zero_stages") else range(4)
    tp = 1 if name == "deepspeed" else 2   # DeepSpeed's AutoTP does not combine with its pipeline
    for pp in (1, 2):
        choice = Choice(tp=tp, pp=pp, dp=16 // tp // pp)
        taken = {STATE_OPTIONS[i].zero_stage for i in shared.placements(choice)}
        for zero in range(4):
            plan = build_plan(model, train, cluster, Choice(tp=tp, pp=pp, dp=16 // tp // pp, zero_stage=zero))
            kept = module.nearest(PlanFile(plan=plan, model=model, train=train, cluster=cluster)).plan
            if pp > 1:
                assert (kept.zero_stage == zero) == (zero in module.ZERO_STAGES_WITH_PP and zero in runs), (pp, zero)
            assert (zero in taken) == (zero in runs and (pp == 1 or zero in module.ZERO_STAGES_WITH_PP)), (pp, zero)


def test_the_stages_torchtitan_s_replicas_run_beside_other_parallelism_are_those_its_export_keeps():
    """torchtitan's ZERO_STAGES_BESIDE_PARALLELISM leave the listing of choices whose replicas
    share the mesh with TP, PP or CP (SharedModels.placements): exactly the ZeRO stages its
    `nearest` keeps there (DDP only on a one-dimensional mesh), and its ZERO_STAGES elsewhere."""
    from planner.exports import torchtitan
    from planner.search_options import STATE_OPTIONS
    from planner.search_state import SharedModels
    from planner.space import Choice, build_plan
    from planner.specs import build_specs
    model, train, cluster = build_specs("llama3-8b", "2x8xH100", framework="torchtitan")
    options = targets.options_for("torchtitan", model, train, cluster, SearchOptions())
    shared = SharedModels(model, train, cluster, options)
    for degrees in ({"dp": 16}, {"tp": 2, "dp": 8}, {"pp": 2, "dp": 8}, {"cp": 2, "dp": 8}, {"tp": 8, "pp": 2, "dp": 1}):
        choice = Choice(**degrees, mesh_axis_order=torchtitan.ORDER)
        taken = {STATE_OPTIONS[i].zero_stage for i in shared.placements(choice)}
        beside = choice.dp > 1 and len(degrees) > 1   # a degree beside dp above 1
        for zero in torchtitan.ZERO_STAGES:
            plan = build_plan(model, train, cluster, replace(choice, zero_stage=zero))
            kept = torchtitan.nearest(PlanFile(plan=plan, model=model, train=train, cluster=cluster)).plan
            assert (kept.zero_stage == zero) == (not beside or zero in torchtitan.ZERO_STAGES_BESIDE_PARALLELISM)
            # without replicas, ZeRO-0 stands for every stage that shards nothing (states_for_group)
            if choice.dp > 1:
                assert (zero in taken) == (kept.zero_stage == zero), (degrees, zero)


@pytest.mark.parametrize("framework", ["planner", "megatron", "torchtitan"])
def test_a_fixed_interleaving_may_split_layers_unevenly(framework, capsys):
    """32 layers over pp 3 x vpp 2 chunks cannot be equal; our runtime, torchtitan and Megatron-Core
    (its explicit layout) run unequal chunks, so a --vpp the user fixes is searched (the space
    enumerates equal chunks only)."""
    argv = ["search", "--model", "llama3-8b", "--cluster", "1x6xH100", "--seq-len", "4096", "--global-batch", "60",
            "--fix", "pp=3", "--fix", "vpp=2", "--framework", framework, "--json"]
    assert main(argv) == 0
    plan = json.loads(capsys.readouterr().out)["plans"][0]["plan"]
    assert (plan["pp"], plan["vpp"], sum(plan["layers_per_stage"])) == (3, 2, 32)
    assert len(set(plan["layers_per_stage"])) > 1


@pytest.mark.parametrize("framework,zero,sp", [("planner", 1, True), ("megatron", 1, True),
                                               ("torchtitan", 3, True), ("deepspeed", 1, False)])
def test_predicts_unset_flags_follow_the_framework(framework, zero, sp, capsys):
    """A plan given by its degrees alone runs under each framework: an unset --zero is a stage it
    runs (torchtitan has no stage 1), an unset --sp is off where it has no sequence parallelism."""
    assert main(["predict", "--model", "llama3-8b", "--cluster", "4x8xH100", "--tp", "8",
                 "--framework", framework, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["zero_stage"] == zero and plan["sequence_parallel"] is sp
    assert targets.default_zero_stage("megatron", pp=2) == 1 and targets.default_zero_stage("torchtitan", pp=2) == 3


def test_the_closest_plan_when_nothing_fits_is_one_the_framework_runs(capsys):
    """Llama 3 405B on 32 H100s fits nowhere; under DeepSpeed the closest plan told is one
    DeepSpeed runs (no context parallelism, which it has not), and a pinned degree it cannot run
    is named as the reason, not as a contradiction of the pins."""
    assert main(["search", "--model", "llama3-405b", "--cluster", "4x8xH100", "--framework", "deepspeed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    closest = re.search(r"the closest plan \((.*?)\) needs", err).group(1)
    assert "cp" not in closest and "+sp" not in closest, err
    assert main(["search", "--model", "llama3-70b", "--cluster", "8x8xH100", "--framework", "deepspeed",
                 "--fix", "cp=2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "every candidate was ruled out: deepspeed cannot run: cp=2" in err and "together" not in err


@pytest.mark.parametrize("framework,runs", [("megatron", True), ("deepspeed", True), ("torchtitan", False),
                                            ("planner", False)])
def test_fewer_micro_batches_than_stages_run_under_frameworks_with_their_own_1f1b(framework, runs, capsys):
    """Two micro-batches through four stages: Megatron's and DeepSpeed's 1F1B run it (a bubble of
    3/5 of the pipeline's time, the step less its own host work), torch's Schedule1F1B (our
    runtime, torchtitan) refuses it."""
    # DeepSpeed's pipeline without AutoTP beside it (the two do not combine)
    degrees = ["--cluster", "1x4xH100", "--tp", "1"] if framework == "deepspeed" else ["--cluster", "4x8xH100",
                                                                                      "--tp", "8"]
    code = main(["predict", "--model", "llama3-8b", *degrees, "--pp", "4", "--global-batch", "2",
                 "--framework", framework, "--json"])
    out = capsys.readouterr()
    if runs:
        est = json.loads(out.out)["estimate"] if code == 0 else {}
        parts = est.get("time_breakdown_s", {})
        assert code == 0 and parts["pipeline/bubble"] / (est["step_time_s"] - parts["host/step"]) > 0.5
    else:
        assert code == 2 and "torch's Schedule1F1B refuses fewer" in out.err


def test_megatron_shards_its_distributed_optimizer_over_instances(tmp_path, capsys):
    """Pinned hybrid sharding under Megatron is its partial distributed optimizer: ZeRO-1 over
    instances of dp / R ranks, all-reduced over the R instances, exported as
    --num-distributed-optimizer-instances, which Megatron-Core's DDP config takes."""
    out, script = tmp_path / "plan.json", tmp_path / "run.sh"
    assert main(["search", "--model", "llama3-8b", "--cluster", "8x8xH100", "--framework", "megatron",
                 "--fix", "dp_replicate=2", "--out", str(out), "--export", "megatron", "--export-out", str(script),
                 "--json"]) == 0
    plan = PlanFile.load(out).plan
    assert plan.dp_replicate == 2 and plan.zero_stage == 1
    assert "--num-distributed-optimizer-instances 2" in script.read_text()
    pytest.importorskip("megatron.core", reason="megatron-core (test extra) is not installed")
    from megatron.core.distributed import DistributedDataParallelConfig
    assert DistributedDataParallelConfig(use_distributed_optimizer=True,
                                         num_distributed_optimizer_instances=2).num_distributed_optimizer_instances == 2


def test_the_expert_all_to_all_overlap_is_searched_kept_and_exported(tmp_path, capsys):
    """--ep-overlap (Megatron-Core's --overlap-moe-expert-parallel-comm): every plan listed is one
    Megatron-Core runs with it (expert parallelism, no full recomputation, interleaved where
    pipelined), priced with its all-to-alls hidden, said on the cluster line, kept in the plan
    file and written by the export."""
    flags = ["search", "--model", "mixtral-8x7b", "--cluster", "8x8xH100", "--framework", "megatron", "--json"]
    docs = {}
    for name, extra in (("plain", []), ("overlap", ["--ep-overlap"])):
        assert main([*flags, *extra, "--out", str(tmp_path / f"{name}.json")]) == 0
        docs[name] = json.loads(capsys.readouterr().out)
    for plan in (row["plan"] for row in docs["overlap"]["plans"]):
        assert plan["ep"] >= 2 and plan["recompute"] != "full" and (plan["pp"] == 1 or plan["vpp"] >= 2), plan
    best = [min(row["estimate"]["step_time_s"] for row in docs[n]["plans"]) for n in ("plain", "overlap")]
    assert best[1] < best[0]
    pf = PlanFile.load(tmp_path / "overlap.json")
    assert pf.cluster.framework.ep_a2a_overlap and json.loads((tmp_path / "overlap.json").read_text())["cluster"]["ep_overlap"]
    assert main(["predict", "--plan", str(tmp_path / "overlap.json")]) == 0
    assert "expert all-to-alls overlapped" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "overlap.json"), "--to", "megatron", "--out", str(tmp_path / "run.sh")]) == 0
    text = (tmp_path / "run.sh").read_text()
    assert "--overlap-moe-expert-parallel-comm" in text and "export CUDA_DEVICE_MAX_CONNECTIONS=32" in text


def test_a_closest_plan_that_fits_as_predict_lays_it_out_is_said_so():
    """Where the search's own splits leave no plan but the closest one, laid out as predict lays it
    out, fits, the message says so and how to price it, never a negative overflow."""
    from costmodel.estimate import estimate
    from planner.no_plan import infeasible_message
    from planner.search_result import Found, SearchResult, SearchStats
    from planner.space import Choice, build_plan
    from planner.specs import build_specs
    model, train, cluster = build_specs("llama3-8b", "1x8xH100", seq_len=4096, global_batch=64)
    plan = build_plan(model, train, cluster, Choice(tp=2, pp=2, dp=2))
    est = estimate(model, train, cluster, plan)
    assert est.fits
    text = infeasible_message(SearchResult(plans=[], stats=SearchStats(), evaluated=[], closest=Found(plan=plan, estimate=est)),
                              cluster.name)
    layers = ",".join(str(n) for n in plan.layers_per_stage)
    assert "fits as `planner predict` lays it out" in text and f"--layers {layers}" in text and "GiB over" not in text
