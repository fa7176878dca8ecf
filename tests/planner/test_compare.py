"""Why the first plan wins: line by line of the ledger against the fastest plan of another
layout and against the model's published recipes placed on the cluster asked (or one line
saying why a recipe cannot be placed there)."""
from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.plan import Plan
from planner.cli import main
from planner.compare import OTHER_LAYOUT, layout, ledger_lines
from planner.recipes import RECIPES_PATH, load_recipes, place, recipes_for
from planner.specs import build_specs

SEARCH = ["search", "--model", "llama3-8b", "--cluster", "1x8xH100", "--seq-len", "4096", "--global-batch", "64"]


def test_every_recipe_names_its_source_and_its_model():
    recipes = load_recipes()
    assert {r.model for r in recipes} >= {"llama3-8b", "llama3-70b", "llama2-70b", "mixtral-8x7b"}
    for r in recipes:
        assert re.search(r"github\.com/\S+ \S+ @ (tag \S+|[0-9a-f]{40})", r.source), r.source
        build_specs(r.model, f"{r.num_gpus // r.gpus_per_node}x{r.gpus_per_node}x{r.device}")   # a known model


def test_a_recipe_that_overlaps_experts_it_does_not_have_is_refused_by_name(tmp_path):
    from costmodel.inputs import UserError
    text = (RECIPES_PATH.read_text().split("[[recipe]]")[1]   # NeMo's Llama 3 8B: no experts
            .replace('framework = "megatron"', 'framework = "megatron"\nep_overlap = true'))
    (path := tmp_path / "recipes.toml").write_text("[[recipe]]" + text)
    with pytest.raises(UserError, match=r"recipes\.toml recipe 1: ep_overlap is Megatron-Core's, for a recipe "
                                        r"with expert parallelism"):
        load_recipes.__wrapped__(path)


@pytest.mark.parametrize("model, cluster, framework, expected", [
    ("mixtral-8x7b", "8x8xH100", "planner", "dp16 tp1 pp4x8v ep8 z1 mbs1x"),   # the cluster it was written for
    ("llama3-70b", "16x8xH100", "planner", "dp4 tp4+sp pp4x5v cp2 z1 mbs1x"),  # dp adapted to 128 devices
    ("mixtral-8x7b", "2x8xH100", "planner", "ep=8 is more than the tp x cp x dp = 4 ranks of a pipeline stage"),
    ("mixtral-8x7b", "2x8xH100", "deepspeed", "ep8 is carved from data parallelism, and this cluster leaves dp4"),
    ("llama3-70b", "3x8xH100", "planner", "tp*pp*cp = 32 does not divide this cluster's 24 devices"),
    ("mixtral-8x7b", "8x8xH100", "deepspeed", "deepspeed would have to change it: schedule interleaved-1f1b"),
])
def test_a_recipe_is_placed_on_the_cluster_asked_or_says_why_not(model, cluster, framework, expected):
    m, t, c = build_specs(model, cluster, framework=framework)
    [recipe] = [r for r in recipes_for(m) if r.framework == "megatron"]
    plan, why = place(recipe, m, t, c)
    assert (plan.short() if plan else why).startswith(expected)


def test_the_ledger_lines_say_where_the_other_plan_spends_more_then_less():
    m, t, c = build_specs("llama3-8b", "1x8xH100", seq_len=4096, global_batch=64)
    [recipe] = recipes_for(m)
    plan, _ = place(recipe, m, t, c)   # cp2 against tp2: context against tensor communication
    mine, other = estimate(m, t, c, plan), estimate(m, t, c, replace(plan, cp=1, tp=2, sequence_parallel=True))
    lines = ledger_lines(mine, other)
    deltas = [float(x.replace(",", "")) for x in re.findall(r"\(([+-][\d,]+) ms\)", "\n".join(lines))]
    more = [d for d in deltas if d > 0]
    assert deltas[:len(more)] == sorted(more, reverse=True) and all(d < 0 for d in deltas[len(more):])
    assert lines[-1].startswith("peak memory: ") and "GiB vs" in lines[-1]
    key = lines[0].split(":")[0]
    assert f"{other.time_breakdown_s[key]:.3f} s vs {mine.time_breakdown_s[key]:.3f} s" in lines[0]


def test_search_compares_the_first_plan_with_another_layout_and_the_recipe(capsys):
    assert main(SEARCH + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    first = doc["plans"][0]["plan"]
    by = {c["against"].split(":")[0]: c for c in doc["comparisons"]}
    other = by[OTHER_LAYOUT]
    assert layout(_plan(other["plan"])) != layout(_plan(first)) and other["lines"]
    # robust-first may rank a plan up to the error band slower first; never more
    step_s = doc["plans"][0]["estimate"]["step_time_s"]
    assert other["delta_s"] >= -doc["search"]["error_band"] * step_s and other["fits"]
    recipe = by["recipe"]
    assert "NeMo llama3_8b" in recipe["against"] and (recipe["plan"]["tp"], recipe["plan"]["cp"]) == (1, 2)
    assert "seq 4096 x global batch 64" in recipe["note"]
    assert main(SEARCH) == 0
    out = capsys.readouterr().out
    assert f"vs {OTHER_LAYOUT} (" in out and "vs recipe: NeMo llama3_8b" in out


def _plan(d: dict) -> Plan:
    return Plan.from_dict(d, "plan")


def test_a_recipe_that_does_not_fit_is_not_called_equivalent(capsys):
    """NeMo's Llama 2 70B layout placed on 32 H100s overflows: faster on paper, it is said not to
    be a plan, not to lie within the error band where the first is the more robust."""
    assert main(["search", "--model", "llama-70b", "--cluster", "4x8xH100", "--fix", "pp=4", "--fix", "vpp=2",
                 "--fix", "tp=4", "--zero", "1"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("vs recipe: NeMo"))
    assert "(does not fit)" in line and "faster per step (it does not fit, so it is not a plan)" in line
    assert "more robust" not in line


def _recipes_shown(args: list[str], capsys) -> list[dict]:
    assert main(args + ["--json"]) == 0
    return [c for c in json.loads(capsys.readouterr().out)["comparisons"] if c["against"].startswith("recipe: ")]


def test_of_several_recipes_those_placed_on_the_cluster_are_shown(capsys):
    """Llama 3 70B on 16 H100s: NeMo's tp4 pp4 cp2 cannot be placed there, torchtitan's tp8 can:
    only the one compared is shown; on 4 H100s neither can, and each says why."""
    shown = _recipes_shown(["search", "--model", "llama3-70b", "--cluster", "2x8xH100"], capsys)
    assert [c["against"].split(" (")[0] for c in shown] == ["recipe: torchtitan llama3_70b.toml"]
    assert shown[0]["plan"] is not None
    shown = _recipes_shown(["search", "--model", "llama3-70b", "--cluster", "1x4xH100"], capsys)
    assert len(shown) == 2 and all(c["plan"] is None and "does not divide" in c["lines"][0] for c in shown)


def test_a_recipe_priced_with_other_gradients_than_its_own_says_so(capsys):
    """DGX Cloud's Llama 3.1 405B layout reduces bf16 gradients (performance mode); priced with
    the default fp32 ones on 1,024 H100s it overflows, and the note names the difference."""
    args = ["search", "--model", "llama3-405b", "--cluster", "128x8xH100", "--framework", "megatron",
            "--seq-len", "8192", "--global-batch", "512"]
    [recipe] = _recipes_shown(args, capsys)   # its pp9 recipe cannot be placed on 1,024
    assert (recipe["plan"]["pp"], recipe["plan"]["vpp"], recipe["plan"]["cp"]) == (8, 8, 2)
    assert "priced with fp32 gradients (the recipe's: bf16, --grad-dtype bf16)" in recipe["note"]
    assert not recipe["fits"] and not recipe["within_error_band"]   # faster on paper, not a plan
    [recipe] = _recipes_shown(args + ["--grad-dtype", "bf16"], capsys)
    assert recipe["fits"] and "gradients" not in recipe["note"]


def test_a_recipe_priced_without_its_expert_overlap_says_so(capsys):
    """Megatron-Bridge's Qwen3-235B layout on 256 H100s (tp2 pp8 vp4 ep32) overlaps its expert
    all-to-all with another micro-batch's compute; priced without `--ep-overlap` its note says
    so; with it, on the cluster it was written for, nothing is adapted and less of its expert
    communication is exposed. (The search is held to the recipe's degrees: the recipe is priced
    the same whatever the search finds, and the whole space of this model takes seconds.)"""
    args = ["search", "--model", "qwen3-235b-a22b", "--cluster", "32x8xH100", "--framework", "megatron",
            "--seq-len", "4096", "--global-batch", "8192", "--grad-dtype", "bf16",
            "--fix", "tp=2", "--fix", "pp=8", "--fix", "ep=32"]
    [plain] = _recipes_shown(args, capsys)
    assert (plain["plan"]["tp"], plain["plan"]["pp"], plain["plan"]["vpp"], plain["plan"]["ep"]) == (2, 8, 4, 32)
    assert "priced without the expert all-to-all overlap its recipe runs (--ep-overlap)" in plain["note"]
    [overlapped] = _recipes_shown(args + ["--ep-overlap"], capsys)
    assert not overlapped["note"]
    assert _recipe_ep_exposed_s(overlapped) < _recipe_ep_exposed_s(plain)


def _recipe_ep_exposed_s(compared: dict) -> float:
    [line] = [line for line in compared["lines"] if line.startswith("comm/ep_exposed: ")]
    return float(line.split()[1])   # "comm/ep_exposed: <the recipe's> s vs <the first plan's> s (...)"


def test_a_recipe_without_the_expert_overlap_priced_with_it_says_so(capsys):
    """NeMo's Mixtral 8x7B recipe leaves the expert all-to-all overlap off: a search with
    `--ep-overlap` prices it with the overlap, and its note says that difference."""
    [recipe] = _recipes_shown(["search", "--model", "mixtral-8x7b", "--cluster", "8x8xH100", "--framework",
                               "megatron", "--seq-len", "8192", "--global-batch", "512", "--ep-overlap"], capsys)
    assert recipe["plan"] is not None
    assert recipe["note"] == "priced with an expert all-to-all overlap its recipe leaves off"


@pytest.mark.parametrize("model, cluster, fp8", [("llama3-70b", "8x8xH100", True), ("qwen3-30b-a3b", "2x8xH100", False)])
def test_under_float8_a_recipe_runs_the_faster_of_its_linears(capsys, model, cluster, fp8):
    """Under --dtype fp8 the plans may run float8 linears: a recipe's layout is priced both ways
    and keeps the faster that fits, as the search weighs them (NeMo's Llama 3 70B gains from
    float8; Qwen3-30B-A3B's small expert GEMMs lose more to the casts than they save), and says so."""
    shown = _recipes_shown(["search", "--model", model, "--cluster", cluster, "--framework", "megatron",
                            "--dtype", "fp8"], capsys)
    assert shown and all(c["plan"]["fp8_linears"] is fp8 for c in shown)
    assert all(("its linears in float8 (--dtype fp8)" in (c["note"] or "")) is fp8 for c in shown)
