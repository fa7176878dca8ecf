import csv
import json
import re
from pathlib import Path

import pytest

from costmodel.plan import DEFAULT_AXIS_ORDER
from planner.cli import main

SEARCH = ["search", "--model", "llama3-8b", "--cluster", "1x8xH100", "--seq-len", "4096", "--global-batch", "64"]


def test_search_json_contract(capsys):
    assert main(SEARCH + ["--json", "--top", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["search"]) >= {"wall_s", "num_candidates", "num_feasible", "pruned_by_reason", "optimal"}
    assert doc["search"]["optimal"] is True and 1 <= len(doc["plans"]) <= 3   # rows beaten in time and memory are not listed
    times = [p["estimate"]["step_time_s"] for p in doc["plans"]]
    assert all(p["estimate"]["fits"] for p in doc["plans"])
    # the plans within the model's error band of the fastest come first, most robust first
    # (planner.ranking.robust_first); those after them by time
    fastest, band = doc["search"]["fastest"]["estimate"]["step_time_s"], doc["search"]["error_band"]
    near = min(doc["search"]["equivalent_plans"], len(times))
    assert all(t <= fastest * (1 + band) for t in times[:near]) and times[near:] == sorted(times[near:])
    assert min(times) >= fastest


def test_search_out_is_a_plan_predict_reproduces(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(SEARCH + ["--json", "--out", str(path)]) == 0
    best = json.loads(capsys.readouterr().out)["plans"][0]["estimate"]["step_time_s"]
    assert main(["predict", "--plan", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["estimate"]["step_time_s"] == pytest.approx(best)


def test_search_table_says_whether_optimal_and_why_runner_up_lost(capsys):
    assert main(SEARCH + ["--fix", "tp=2", "--no-recompute"]) == 0
    out = capsys.readouterr().out
    assert "proven optimal under the cost model" in out and "runner-up" in out
    assert " tp2" in out.splitlines()[2]


def test_constraints_are_honoured(capsys):
    assert main(SEARCH + ["--json", "--fix", "pp=2", "--zero", "1", "--schedule", "1f1b"]) == 0
    for entry in json.loads(capsys.readouterr().out)["plans"]:
        plan = entry["plan"]
        assert (plan["pp"], plan["zero_stage"], plan["schedule"]) == (2, 1, "1f1b")


def test_nothing_fits_explains_why(capsys):
    # 405B: even offloaded, each A100's share of the host (1 TB) cannot hold 16 bytes per parameter
    assert main(["search", "--model", "llama3-405b", "--cluster", "1x2xA100"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "nothing fits: the closest plan" in err and "GiB over" in err and "more devices" in err


def test_the_closest_plan_is_looked_for_among_the_fully_recomputed_first(capsys, monkeypatch):
    """Of the choices that did not fit, the queue meets the unrecomputed first (they bound time
    lowest); the closest plan is looked for among the fully recomputed first, which keep least.
    With room for only a few candidates, the closest plan quoted recomputes every layer."""
    import planner.repricing as repricing
    monkeypatch.setattr(repricing, "CLOSEST_CANDIDATES", 3)
    assert main(["search", "--model", "llama2-7b", "--cluster", "1x8xA100", "--seq-len", "1048576",
                 "--global-batch", "8", "--fix", "offload=no", "--fix", "act_offload=no"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "nothing fits: the closest plan (" in err and " rc=full" in err.split("needs")[0], err


def test_a_model_too_large_for_the_devices_trains_with_its_states_on_the_host(capsys):
    """Llama 2 70B on two A100s: no plan keeps its states on the devices; offloaded, ZeRO-3 holds
    a layer at a time there and 560 GB per device on the host."""
    assert main(["search", "--model", "llama2-70b", "--cluster", "1x2xA100", "--fix", "offload=no"]) == 2
    capsys.readouterr()
    assert main(["search", "--model", "llama2-70b", "--cluster", "1x2xA100", "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and all(p["plan"]["offload_optimizer"] for p in plans)


@pytest.mark.parametrize("extra,message", [
    (["--fix", "tp=16", "--max-tp", "8"], "contradictory constraints: --fix tp=16 exceeds --max-tp 8"),
    (["--no-recompute", "--fix", "recompute=full"], "contradictory constraints: --no-recompute"),
    (["--fix", "colour=blue"], "KEY one of dp, tp"),
    (["--fix", "zero=1", "--zero", "2"], "contradictory constraints"),
    # values no plan can take (pp must divide the 8 devices), and values possible only apart
    (["--fix", "pp=3"], "pp=3 is not possible for llama3-8b on 1x8xH100"),
    (["--fix", "tp=8", "--fix", "pp=2"], "tp=8, pp=2 are not possible together for llama3-8b on 1x8xH100"),
    # of more pins, the fewest that do not go together are named
    (["--fix", "mbs=1", "--fix", "tp=8", "--fix", "zero=1", "--fix", "pp=2"],
     "contradictory constraints: tp=8, pp=2 are not possible together"),
    # a schedule priced only by simulation competes as a variant; pinned, the user is told how to use it
    (["--fix", "schedule=dualpipev"], "schedule=dualpipev has no closed-form pipeline time, so the search cannot pin it"),
    (["--schedule", "zbv"], "argument --schedule: invalid choice: 'zbv' (choose from 'gpipe', '1f1b'"),   # not offered
    # values no plan field takes, named before any search
    (["--fix", "mbs=0"], "--fix 'mbs=0': 0 is not a positive integer (give 1 to 1,048,576)"),
    (["--fix", "zero=7"], "--fix 'zero=7': 7 is too large (give 0 to 3)"),
    (["--fix", "dp=999999999999999999999"], "is too large (give 1 to 1,048,576)"),
    (["--fix", "vpp=2", "--fix", "pp=1"], "contradictory constraints: vpp=2, pp=1 are not possible together"),
])
def test_contradictions_are_named(capsys, extra, message):
    assert main(SEARCH + extra) == 2
    assert message in capsys.readouterr().err


def test_csv_has_every_evaluated_plan(tmp_path, capsys):
    path = tmp_path / "all.csv"
    assert main(SEARCH + ["--csv", str(path), "--top", "2"]) == 0
    rows = list(csv.DictReader(open(path)))
    assert len(rows) >= 2 and {"tp", "pp", "etp", "dp_replicate", "step_time_s", "mfu"} <= set(rows[0])
    assert all(row["dp_replicate"].isdigit() and row["etp"].isdigit() for row in rows)   # no empty cells
    # lists as JSON, as plan.json writes them: a reader gets the plan's values back
    assert all(sorted(json.loads(row["mesh_axis_order"])) == sorted(DEFAULT_AXIS_ORDER) for row in rows)
    assert f"wrote {path} ({len(rows):,} plans priced)" in capsys.readouterr().err


def test_memory_objective_trades_a_little_time_for_memory(capsys):
    # under Megatron at 2,048 tokens the fastest plan keeps its gradients whole (ZeRO-1), about
    # 10 GiB fuller than plans sharding them, which are as fast within the model's error
    search = [*SEARCH[:-4], "--seq-len", "2048", "--global-batch", "64", "--framework", "megatron"]
    assert main(search + ["--json"]) == 0
    # the fastest plan, not the most robust one shown first (honest ties)
    fastest = json.loads(capsys.readouterr().out)["search"]["fastest"]["estimate"]
    assert main(search + ["--json", "--objective", "memory"]) == 0
    lean = json.loads(capsys.readouterr().out)["plans"][0]["estimate"]
    assert lean["step_time_s"] <= 1.05 * fastest["step_time_s"] + 1e-9
    # the memory objective's plan holds under 0.9 of the fastest's peak
    assert max(lean["peak_memory_bytes"]) < 0.9 * max(fastest["peak_memory_bytes"])
    # a faster row below the first is there for its memory, not for robustness
    assert main(["search", "--model", "llama3-8b", "--cluster", "1x8xH100", "--objective", "memory"]) == 0
    out = capsys.readouterr().out
    assert "for robustness" not in out and "the first is chosen as the more robust" not in out
    assert "--objective memory ranks the plans within 5% of the fastest by their memory" in out


@pytest.mark.parametrize("cluster,basis", [("1x2xxeon-amx", "per rank as the profile sets it"),
                                           ("1x8xH100", "as CUDA reports it"),
                                           ("1x8xB200", "as CUDA reports it"),
                                           ("1x8x{datasheet_only}", "as the datasheet gives it")])
def test_the_memory_line_says_where_the_capacity_comes_from(capsys, tmp_path, cluster, basis):
    """A CPU profile's capacity is a share of the machine's RAM, not anything CUDA reports; a GPU
    profile without torch.cuda's figure (a user's own) states its datasheet's."""
    b200 = (Path(__file__).parents[2] / "profiles" / "B200.toml").read_text().splitlines(keepends=True)
    datasheet_only = tmp_path / "datasheet-only.toml"
    datasheet_only.write_text("".join(ln for ln in b200 if not ln.startswith("reported_memory_bytes")))
    cluster = cluster.format(datasheet_only=datasheet_only)
    assert main(["search", "--model", "debug-tiny", "--cluster", cluster, "--top", "1"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "memory:" in ln)
    assert basis in line


def test_a_space_with_no_plan_says_what_ruled_its_candidates_out():
    """The one line names the rules that ruled the candidates out, the most frequent first with
    their counts (the CLI case: test_the_closest_plan_when_nothing_fits_is_one_the_framework_runs),
    not flags the user never gave."""
    from planner.no_plan import ruled_out
    text = ruled_out({"memory": 3, "global batch not divisible by dp": 1_092, "a": 1, "b": 1})
    assert text == ("every candidate was ruled out: global batch not divisible by dp (1,092 candidates); "
                    "memory (3 candidates); a (1 candidates); 1 more reasons")
    assert "--fix" in ruled_out({}) and "no candidate" in ruled_out({})


def test_a_refusal_is_counted_by_its_words_not_its_figures():
    from planner.search_options import REASON_CHARS, reason_key
    long = "cp=2 with multi-token prediction: " + "word " * 40 + "(cp 2)"
    assert reason_key("pp=3 does not divide 8 (layers 80)") == "pp=3 does not divide 8"
    assert len(reason_key(long)) <= REASON_CHARS + 4 and reason_key(long).endswith(" ...")


@pytest.mark.parametrize("pins,message", [
    (["--fix", "fp8=yes"], r"fp8_linears=True is not possible .*: float8 linears need --dtype fp8"),
    (["--fix", "tp=16", "--max-tp", "16"], r"tp=16 is not possible .*: tp=16 does not divide the model's num_kv_heads"),
])
def test_a_pin_no_plan_takes_names_the_rule(pins, message, capsys):
    assert main(["search", "--model", "llama3-70b", "--cluster", "8x8xH100", *pins]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(message, err), err


def test_the_csv_marks_plans_that_overflow_once_simulated(tmp_path, capsys):
    """Every priced plan is a row, and the one that fits under the closed form's memory but not
    once simulated says so; the summary's feasible count is of those that fit."""
    import pandas as pd
    out = tmp_path / "plans.csv"
    assert main(["search", "--model", "llama-70b", "--cluster", "4x8xH100", "--fix", "pp=4", "--fix", "vpp=2",
                 "--fix", "tp=4", "--fix", "cp=2", "--zero", "1", "--csv", str(out)]) == 0
    rows = pd.read_csv(out)
    feasible = int(re.search(r"([\d,]+) feasible", capsys.readouterr().out).group(1).replace(",", ""))
    assert (~rows.fits).sum() >= 1 and feasible == rows.fits.sum()


def test_out_holds_the_first_plan_within_the_deadline(tmp_path, capsys):
    """--deadline-days leaves plans out of the table: --out and --export hold the first it keeps."""
    out, script = tmp_path / "plan.json", tmp_path / "run.sh"
    assert main(["search", "--model", "llama3-8b", "--cluster", "2x8xA100", "--framework", "megatron", "--fix", "pp=4",
                 "--fix", "vpp=2", "--top", "3", "--tokens", "1e10", "--deadline-days", "2", "--out", str(out),
                 "--export", "megatron", "--export-out", str(script), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    first = doc["plans"][0]["plan"]
    assert json.loads(out.read_text())["plan"] == first
    assert 1 <= doc["search"]["equivalent_plans"] <= len(doc["plans"])   # of the plans left
    assert f"--micro-batch-size {first['micro_batch_size']} " in script.read_text()


def test_a_flag_that_would_be_ignored_is_refused_before_anything_is_written(tmp_path, capsys):
    assert main(SEARCH + ["--out", str(tmp_path / "p.json"), "--report", str(tmp_path / "rep"),
                          "--gpu-hour-usd", "2"]) == 2
    assert "--gpu-hour-usd would be ignored" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_a_framework_chosen_by_export_is_named_by_that_flag(capsys):
    assert main(["search", "--model", "megatron-1.7b", "--cluster", "1x8xH100", "--export", "torchtitan"]) == 2
    assert capsys.readouterr().err.startswith("planner search: error: --export torchtitan: torchtitan cannot run")


def test_the_equivalent_plans_are_counted_among_those_the_limits_leave(capsys):
    """Of the plans alike within the error band, the most robust one misses the deadline: the
    others are left, and the JSON counts them, not it."""
    # llama-70b on 8x8xA100: the most robust plan of the band (the safe memory margin) is a little
    # slower than the others; the deadline falls between their training days, read from the search
    args = ["search", "--model", "llama-70b", "--cluster", "8x8xA100", "--tokens", "1e11", "--gpu-hour-usd", "2",
            "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    robust, *others = doc["plans"][:doc["search"]["equivalent_plans"]]
    slowest_other = max(p["training"]["days"] for p in others)
    assert others and robust["training"]["days"] > slowest_other
    deadline = (robust["training"]["days"] + slowest_other) / 2
    assert main(args + ["--deadline-days", f"{deadline:.6f}"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert robust["plan"] not in [p["plan"] for p in doc["plans"]]
    assert [p["plan"] for p in doc["plans"][:doc["search"]["equivalent_plans"]]] == [p["plan"] for p in others]
