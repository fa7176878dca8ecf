"""`planner sweep`: one row per size with its proven plan, days, GPU-hours and cost; the cheapest
size within the deadline; the curve as CSV and picture; bad input in one line, exit 2."""
from __future__ import annotations

import csv
import json

import pytest

from planner.cli import main

BASE = ["sweep", "--model", "llama3-8b", "--seq-len", "4096", "--global-batch", "64", "--tokens", "1e11"]


def _sweep(capsys, *argv: str) -> dict:
    assert main([*BASE, *argv, "--json"]) == 0
    captured = capsys.readouterr()
    return {"doc": json.loads(captured.out), "err": captured.err}


def test_rows_days_and_cost(capsys):
    got = _sweep(capsys, "--device", "H100", "--nodes", "1,2,4", "--gpu-hour-usd", "2")
    doc = got["doc"]
    rows = doc["rows"]
    assert [r["num_gpus"] for r in rows] == [8, 16, 32] and all(r["proven_optimal"] for r in rows)
    assert rows[0]["days"] > rows[1]["days"] > rows[2]["days"]   # days fall as the cluster grows
    for r in rows:
        assert r["gpu_hours"] == pytest.approx(r["num_gpus"] * r["days"] * 24)
        assert r["cost_usd"] == pytest.approx(r["gpu_hours"] * 2)
        assert r["days"] == pytest.approx(1e11 / r["effective_tokens_per_s"] / 86400)
        assert r["effective_tokens_per_s"] < r["tokens_per_s"]   # checkpoints and failures paid
    assert doc["best"]["cost_usd"] == min(r["cost_usd"] for r in rows)
    assert got["err"].count("sweep [") == 3   # a progress line per size


def test_deadline_devices_csv_and_plot(capsys, tmp_path):
    table, picture = tmp_path / "s.csv", tmp_path / "s.png"
    doc = _sweep(capsys, "--device", "A100,H100", "--nodes", "1,2", "--gpu-hour-usd", "1.5,2.5", "--deadline-days",
                 "30", "--csv", str(table), "--plot", str(picture))["doc"]
    assert {(r["device"], r["num_gpus"]) for r in doc["rows"]} == {
        ("A100-SXM4-80GB", 8), ("A100-SXM4-80GB", 16), ("H100-SXM5-80GB", 8), ("H100-SXM5-80GB", 16)}
    within = [r for r in doc["rows"] if r["days"] <= 30]
    assert doc["best"]["cost_usd"] == min(r["cost_usd"] for r in within)
    assert all((r["outside_limits"] is None) == (r in within) for r in doc["rows"])
    assert len(list(csv.DictReader(table.open()))) == 4
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_picture_draws_sizes_past_the_limits_hollow_and_names_the_answer(capsys, tmp_path, monkeypatch):
    import matplotlib
    monkeypatch.setitem(matplotlib.rcParams, "svg.fonttype", "none")   # the legend as searchable text
    picture = tmp_path / "s.svg"
    doc = _sweep(capsys, "--device", "H100", "--nodes", "1,2", "--objective", "time", "--gpu-hour-usd", "2",
                 "--budget-usd", "1e9", "--deadline-days", "10", "--plot", str(picture))["doc"]
    outside = [r for r in doc["rows"] if r["outside_limits"]]
    assert outside and doc["best"]["num_gpus"] == 16   # 8 GPUs take past 10 days
    svg = picture.read_text()
    assert "outside 10 days and $1,000,000,000" in svg and "ends soonest within 10 days" in svg
    assert "cheapest" not in svg


def test_the_table_names_the_cheapest_and_the_knee(capsys):
    assert main([*BASE, "--device", "H100", "--nodes", "1,2"]) == 0
    out = capsys.readouterr().out
    assert "* cheapest:" in out and "knee:" in out and "days" in out


@pytest.mark.parametrize("argv,message", [
    (["--device", "H100", "--nodes", ""], "--nodes"),
    (["--device", "H100", "--nodes", "1", "--gpu-hour-usd", "-1"], "--gpu-hour-usd"),
    (["--device", "H100", "--nodes", "1,2", "--deadline-days", "0.001"],
     "no size meets the deadline of 0.001 days; the closest is 16 H100-SXM5-80GB"),
    (["--device", "Z100", "--nodes", "1"], "Z100"),
    (["--device", "H100", "--nodes", "1", "--cluster", "1x8xH100"], "leave out --cluster"),
    (["--device", "A100,H100", "--nodes", "1", "--gpu-hour-usd", "1,2,3"], "3 prices for 2 devices"),
    (["--device", "A100,A100", "--nodes", "1"], "--device A100,A100: give each device once"),
    (["--device", "A100+H100", "--nodes", "1"], "--device A100+H100: a sweep sizes clusters of one device each"),
    (["--device", "A100,A100-80GB", "--nodes", "1"],   # two aliases of one profile: one curve, not two
     "--device A100 and A100-80GB are both the profile 'A100-SXM4-80GB'"),
    # a pin no plan takes is named as search names it, not as plans that overflow
    (["--device", "H100", "--nodes", "1", "--fix", "schedule=zbv"],
     "contradictory constraints: schedule=zbv has no closed-form pipeline time"),
    (["--device", "H100", "--nodes", "1", "--fix", "mbs=0"], "--fix 'mbs=0': 0 is not a positive integer"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main([*BASE, *argv]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("sweep [")]
    assert len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("command", [["predict", "--tp", "2"], ["search"]])
def test_search_and_predict_say_what_training_takes(command, capsys):
    flags = ["--model", "llama3-8b", "--cluster", "1x8xH100", "--seq-len", "4096", "--global-batch", "64"]
    assert main([command[0], *flags, *command[1:], "--tokens", "1e11", "--gpu-hour-usd", "2", "--json"]) == 0
    training = json.loads(capsys.readouterr().out)["training"]
    assert training["num_gpus"] == 8 and training["cost_usd"] == pytest.approx(training["gpu_hours"] * 2)
    assert main([command[0], *flags, *command[1:], "--gpu-hour-usd", "2"]) == 2
    assert "--gpu-hour-usd prices the --tokens" in capsys.readouterr().err


def test_the_help_leaves_out_the_flags_a_sweep_refuses(capsys):
    assert main(["sweep", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--device" in text and "--cluster" not in text and "--group-link" not in text


def test_without_a_model_the_sweep_asks_for_it_not_for_a_cluster(capsys):
    assert main(["sweep", "--device", "H100", "--nodes", "1", "--tokens", "1e11"]) == 2
    assert "sweep needs --model" in capsys.readouterr().err


def test_no_size_within_the_deadline_still_shows_the_sizes_and_marks_them(capsys):
    """The table (or --json) is what the user reads to move the deadline: shown, each size
    marked outside it, then the one-line answer that none meets it, exit 2."""
    assert main([*BASE, "--device", "H100", "--nodes", "1,2", "--deadline-days", "0.001"]) == 2
    captured = capsys.readouterr()
    sizes = [line for line in captured.out.splitlines() if "1f1b" in line]
    assert len(sizes) == 2 and all(line.startswith("x") for line in sizes)
    assert "x: outside 0.001 days" in captured.out and "no size meets the deadline" in captured.err
    assert main([*BASE, "--device", "H100", "--nodes", "1", "--deadline-days", "0.001", "--json"]) == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["best"] is None and doc["rows"][0]["outside_limits"] == "past the 0.001-day deadline"


def test_pins_no_size_can_take_are_one_error_and_nothing_is_written(capsys, tmp_path):
    """A --fix that rules out every size (tp=3 on 32 heads) is the user's constraint, not a size's
    result: one error line after the sizes' progress, exit 2, no table, CSV or report."""
    assert main(["sweep", "--model", "llama3-8b", "--device", "A100", "--nodes", "1,2", "--tokens", "1e12",
                 "--fix", "tp=3", "--csv", str(tmp_path / "s.csv"), "--report", str(tmp_path / "rep")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines()[-1].startswith("planner sweep: error: contradictory constraints: tp=3")
    assert "(at every size; nothing written)" in err and not list(tmp_path.iterdir())


def test_a_size_without_a_plan_says_why_and_claims_no_optimum(capsys):
    """Llama 3 405B on one node of H100s: no plan, its reason in the row, and no proven optimum
    (there is none to prove)."""
    assert main(["sweep", "--model", "llama3-405b", "--seq-len", "4096", "--global-batch", "64", "--tokens", "1e11",
                 "--device", "H100", "--nodes", "1", "--json"]) == 2
    row = json.loads(capsys.readouterr().out)["rows"][0]
    assert row["plan"] is None and row["proven_optimal"] is None and row["reason"].startswith("nothing fits")
