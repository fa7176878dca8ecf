"""The best interleaved plans laid out again by simulation where the closed form misses the
pipeline's phase lock (planner.relayout)."""
from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.plan import Plan, Recompute
from planner.api import predict
from planner.cli import main
from planner.relayout import phase_locked, relaid
from planner.search_options import SearchOptions
from planner.search_result import Found
from planner.space import Choice, build_plan
from planner.specs import build_specs

# Megatron-Bridge's DeepSeek-V3 on 1,024 H100s (the calibration row mb2509_deepseek_h100_fp8_g1024)
V3_TRAIN = {"seq_len": 4096, "global_batch": 8192, "dtype": "fp8", "recompute_modules": ("mla_up_proj", "mlp"),
            "ep_overlap": True, "grad_dtype": "bf16"}
V3_H100 = ["--model", "deepseek-v3", "--cluster", "128x8xH100", "--seq-len", "4096", "--global-batch", "8192",
           "--framework", "megatron", "--dtype", "fp8", "--recompute-modules", "mla_up_proj,mlp", "--ep-overlap",
           "--grad-dtype", "bf16"]
V3_DEGREES = {"tp": 2, "pp": 8, "vpp": 4, "ep": 64, "cp": 1, "mbs": 1, "zero": 1, "recompute": "selective",
              "fp8": "true", "etp": 1}
# Megatron-Core's own layout of it, Et|(tt|)*30mL: the MTP module and the loss alone on the last stage
V3_LAYOUT = (1,) + (2,) * 30 + (0,)


def test_deepseek_v3_is_laid_out_again_past_megatron_s_own_layout(capsys):
    """With Bridge's degrees the search's split leaves one layer beside the head, the MTP module
    and the losses on the last stage: the closed form prices rank totals and misses that the
    stage holds the interleaved pipeline back (21.9 s closed form, 26.7 s simulated). Laid out
    again by simulation the plan's last stage holds no layer, as Megatron-Core's own layout's,
    and the plan is at least as fast as that layout; the JSON names the closed-form plan the
    proof is about beside it."""
    fixed = [f"--fix={k}={v}" for k, v in V3_DEGREES.items()]
    assert main(["search", *V3_H100, *fixed, "--top", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    first, proven = doc["plans"][0], doc["search"]["proven_fastest"]
    layers = first["plan"]["layers_per_stage"]
    assert layers[-1] == 0 and sum(layers) == 61 and first["estimate"]["fits"]
    assert doc["search"]["fastest"]["plan"] == first["plan"] and proven["plan"] != first["plan"]
    assert first["estimate"]["step_time_s"] < 0.95 * proven["estimate"]["step_time_s"]
    plan = _with_layers(Plan.from_dict(first["plan"]), V3_LAYOUT)
    published = predict("deepseek-v3", "128x8xH100", plan, framework="megatron", **V3_TRAIN)
    assert published.estimate.fits and first["estimate"]["step_time_s"] <= published.estimate.step_time_s


def test_an_even_interleaved_plan_is_not_phase_locked():
    """Llama 2 70B at PP4 VP5 (no heavy stage): the closed form and the simulation agree."""
    model, train, cluster = build_specs("llama-70b", "8x8xH100", seq_len=4096, global_batch=256)
    plan = build_plan(model, train, cluster, Choice(tp=8, pp=4, vpp=5, recompute=Recompute.FULL))
    even = Found(plan=plan, estimate=estimate(model, train, cluster, plan))
    assert not phase_locked(even, estimate(model, train, cluster, plan, simulate=False).step_time_s)


@pytest.mark.parametrize("framework,empty_last", [("megatron", True), ("planner", False)])
def test_a_phase_locked_split_is_laid_out_again_within_what_the_framework_runs(framework, empty_last):
    """Llama 3 8B with a 256k vocabulary at PP4 VP2, split by the search (rank totals balanced, the
    head beside two layers on the last stage): simulated well above its closed form. Laid out
    again, it fits, is faster, keeps every layer and recomputes as before; its last stage holds
    the head and the loss alone under Megatron, which runs such a stage, and a layer beside them
    under our runtime, which does not."""
    from planner.partition import apply_split, solve_split
    from planner.targets import options_for
    model, train, cluster = build_specs("llama3-8b", "1x8xH100", seq_len=4096, global_batch=64, framework=framework)
    model = replace(model, vocab_size=256000)
    plan = build_plan(model, train, cluster, Choice(tp=1, pp=4, vpp=2))
    plan = apply_split(plan, solve_split(model, train, cluster, plan))
    locked = Found(plan=plan, estimate=estimate(model, train, cluster, plan))
    assert phase_locked(locked, estimate(model, train, cluster, plan, simulate=False).step_time_s)
    options = options_for(framework, model, train, cluster, SearchOptions())
    found = relaid(model, train, cluster, options, locked, time.perf_counter() + 60)
    assert found is not None and found.estimate.fits
    assert found.estimate.step_time_s < 0.95 * locked.estimate.step_time_s
    assert sum(found.plan.layers_per_stage) == model.num_layers and found.plan.recompute_num_layers == (0,) * 4
    assert (found.plan.layers_per_stage[-1] == 0) == empty_last and min(found.plan.layers_per_stage[:-1]) >= 1


def test_a_rank_recomputing_part_of_its_layers_keeps_as_many_and_one_recomputing_all_keeps_all():
    """A moved layer keeps each rank's recomputation: all of its layers where it recomputed all,
    else the same count (at most its layers)."""
    from planner.relayout import _with_stages
    model, train, cluster = build_specs("llama-70b", "8x8xH100", seq_len=4096, global_batch=256)
    plan = build_plan(model, train, cluster, Choice(tp=8, pp=2, vpp=2, recompute=Recompute.FULL))
    plan = replace(plan, layers_per_stage=(20, 20, 20, 20), recompute_num_layers=(40, 3))
    moved = _with_stages(plan, (21, 19, 20, 20))   # stage 1 is rank 1's first: it loses one
    assert moved.recompute_num_layers == (41, 3)
    moved = _with_stages(replace(plan, recompute_num_layers=(40, 39)), (19, 21, 20, 20))
    assert moved.recompute_num_layers == (39, 39)   # rank 0 gives one away, rank 1 keeps its 39 of 41


def _with_layers(plan, layers_per_stage):
    moved = replace(plan, layers_per_stage=layers_per_stage)
    return replace(moved, recompute_num_layers=tuple(moved.layers_on_rank(r) for r in range(moved.pp)))


def test_a_framework_that_splits_evenly_keeps_its_even_layout():
    """The descent keeps to what the framework runs: Llama 3 8B at PP4 as DeepSpeed runs it (TP1,
    ZeRO-1, its even split), whose last rank holds a head that costs more than two layers, gains
    by layers moved off that rank under no framework's rules, and keeps its even split under
    DeepSpeed's."""
    from planner.targets import options_for
    model, train, cluster = build_specs("llama3-8b", "1x8xH100", seq_len=4096, global_batch=64, framework="deepspeed")
    plan = build_plan(model, train, cluster, Choice(tp=1, pp=4, vpp=1, zero_stage=1))
    options = options_for("deepspeed", model, train, cluster, SearchOptions())
    assert not options.space.problems(plan)
    found = Found(plan=plan, estimate=estimate(model, train, cluster, plan))
    free = relaid(model, train, cluster, SearchOptions(), found, time.perf_counter() + 60)
    assert free is not None and free.estimate.step_time_s < found.estimate.step_time_s
    assert relaid(model, train, cluster, options, found, time.perf_counter() + 60) is None


def test_predict_names_a_faster_layout_of_the_same_degrees_and_its_flags_give_it(capsys):
    """predict on DeepSeek-V3 with Bridge's degrees and the default layout (three dense layers
    on the first stage: its rank holds nine): the same degrees laid out again run at least 5 %
    faster, and the --layers (and --recompute-layers) the line names price exactly that."""
    degrees = ["--tp", "2", "--pp", "8", "--vpp", "4", "--ep", "64", "--zero", "1", "--recompute", "selective"]
    assert main(["predict", *V3_H100, *degrees, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    relaid_plan, relaid_estimate = doc["relaid"]["plan"], doc["relaid"]["estimate"]
    assert relaid_estimate["fits"] and relaid_estimate["step_time_s"] < 0.95 * doc["estimate"]["step_time_s"]
    assert main(["predict", *V3_H100, *degrees]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("layout"))
    flags = line.split(": ", 1)[1].split()
    assert flags[:2] == ["--layers", ",".join(map(str, relaid_plan["layers_per_stage"]))]
    assert main(["predict", *V3_H100, *degrees, *flags, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["estimate"]["step_time_s"] == pytest.approx(relaid_estimate["step_time_s"])
    assert again["relaid"] is None


def test_predict_names_no_layout_where_the_even_one_is_as_good(capsys):
    assert main(["predict", "--model", "llama-70b", "--cluster", "8x8xA100", "--tp", "4", "--pp", "4", "--vpp", "5",
                 "--zero", "1", "--recompute", "full", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["relaid"] is None
