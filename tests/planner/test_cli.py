"""The command line as a user meets it: output shapes, JSON contract, one-line errors, exit 2."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main

RUNS = Path(__file__).resolve().parents[2] / "profiles" / "runs" / "published_runs.csv"
PREDICT = ["predict", "--model", "llama-70b", "--cluster", "8x8xA100", "--tp", "8", "--pp", "4",
           "--zero", "1", "--recompute", "selective"]


def test_predict_prints_a_full_ledger(capsys):
    assert main(PREDICT) == 0
    out = capsys.readouterr().out
    for text in ("compute/forward", "comm/tp_exposed", "pipeline/bubble", "optimizer/step", "total",
                 "stage 3", "MFU", "tokens/s"):
        assert text in out


def test_a_fallback_recipe_and_a_sequence_past_the_positions_are_noted(capsys):
    """What the user did not choose is said: the SC'21 setting for a model without a published
    recipe, and a RoPE model priced past the positions it was trained for; nothing when given."""
    assert main(["predict", "--model", "megatron-1.7b", "--cluster", "1x8xA100", "--dp", "8"]) == 0
    err = capsys.readouterr().err
    assert ("note: megatron-1.7b has no pre-training recipe of its authors here, so --seq-len and --global-batch "
            "take Megatron's SC'21 setting: seq 2048 x global batch 512\n") in err
    # a framework's recipe for the model, which search compares with, is named with its setting
    assert main(["predict", "--model", "mixtral-8x7b", "--cluster", "8x8xH100", "--framework", "megatron",
                 "--dp", "8", "--pp", "8", "--ep", "8"]) == 0
    assert "NeMo mixtral_8x7b pretrain recipe runs seq 8192 x global batch 512 (--seq-len 8192" in capsys.readouterr().err
    assert main(["predict", "--model", "megatron-1.7b", "--cluster", "1x8xA100", "--dp", "8", "--seq-len", "1024",
                 "--global-batch", "64"]) == 0
    assert "note:" not in capsys.readouterr().err
    assert main(["predict", "--model", "llama-7b", "--cluster", "1x8xH100", "--tp", "8", "--seq-len", "8192",
                 "--global-batch", "8"]) == 0
    assert "note: seq 8,192 is past the 4,096 positions llama2-7b was trained for" in capsys.readouterr().err


def test_predict_json_contract(capsys):
    assert main(PREDICT + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    est = doc["estimate"]
    for key in ("step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes", "fits",
                "time_breakdown_s", "memory_breakdown_bytes"):
        assert key in est
    assert len(est["peak_memory_bytes"]) == 4 and doc["plan"]["pp"] == 4


def test_predict_writes_a_plan_that_predict_reads_back(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(PREDICT + ["--json", "--out", str(path)]) == 0
    first = json.loads(capsys.readouterr().out)
    assert main(["predict", "--plan", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == first
    # every flag that sets a spec or the plan is refused beside --plan; the run's tokens are not
    for flag in (["--ep", "2"], ["--expert-imbalance", "2"], ["--etp", "2"], ["--dp-replicate", "2"],
                 ["--group-link", "50"], ["--tp", "2"]):
        assert main(["predict", "--plan", str(path), *flag]) == 2
        assert f"{flag[0]} would be ignored: --plan takes" in capsys.readouterr().err
    assert main(["predict", "--plan", str(path), "--tokens", "1e9", "--json"]) == 0


@pytest.mark.parametrize("args,message", [
    (["predict", "--model", "gpt5", "--cluster", "8x8xA100"], "unknown model 'gpt5'; known:"),
    (["predict", "--model", "llama-70b", "--cluster", "8xA100"], "malformed cluster '8xA100'"),
    (["search", "--model", "llama-70b", "--cluster", "4x8xA100+4x8xB999"],
     "cluster '4x8xA100+4x8xB999', group '4x8xB999': unknown device 'B999'"),
    (["search", "--model", "llama-70b", "--cluster", "4x8xA100+0x8xH100"],
     "node and device counts must be positive (group '0x8xH100')"),
    (["search", "--model", "llama-70b", "--cluster", "4x8xA100+4x4xH100"], "every group needs the same devices per node"),
    (["search", "--model", "llama-70b", "--cluster", "4x8xA100+4x8xH100", "--dtype", "fp8"],
     "device A100-SXM4-80GB has no float8 tensor cores"),
    (["predict", "--model", "llama-70b", "--cluster", "1x8xA100", "--offload-optimizer", "--zero", "0"],
     "offload_optimizer needs zero_stage >= 1"),
    (["predict", "--model", "llama-70b", "--cluster", "8x8xA100", "--tp", "16"], "tp=16 does not divide"),
    (["predict", "--model", "llama-70b", "--cluster", "8x8xA100", "--tp", "3"], "does not divide the cluster"),
    (["predict", "--model", "llama-70b", "--cluster", "1x8xA100", "--zero", "0"], "stage 0 needs"),
    (["predict", "--plan", "/nonexistent/plan.json"], "does not exist"),
    (["predict", "--model", "llama-70b", "--cluster", "1x8xV100", "--tp", "8"], "no bf16 support"),
    (["predict", "--model", "llama3-8b", "--cluster", "1x8xH100", "--expert-imbalance", "2"],
     "--expert-imbalance would be ignored: it loads the experts of a mixture, and llama3-8b is dense"),
    (["predict", "--model", "llama3-8b", "--cluster", "1x8xH100", "--pp", "2", "--layers", "40,-8"],
     "--layers '40,-8': -8 is negative"),
    (["export", "/nonexistent/plan.json", "--to", "megatron", "--overwrite"],
     "--overwrite would be ignored: without --out nothing is written"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err


def test_validate_json_contract(tmp_path):
    """The document's shape, on every 25th row of the published table (the whole table's
    figures are tests/planner/test_fidelity.py's: one validation of it costs about a minute)."""
    header, *rows = [line for line in RUNS.read_text().splitlines() if line.strip()]
    table = tmp_path / "runs.csv"
    table.write_text("\n".join([header, *rows[::25]]) + "\n")
    out = subprocess.run([sys.executable, "-m", "planner", "validate", str(table), "--json"],
                         capture_output=True, text=True, check=True)
    doc = json.loads(out.stdout)
    assert set(doc["summary"]) >= {"n", "mape_pct", "max_abs_error_pct", "spearman",
                                   "num_status_rows", "num_status_correct"}
    row = doc["rows"][0]
    assert set(row) >= {"id", "published", "predicted", "error_pct", "fits", "filled", "published_mfu"}
    assert doc["summary"]["n"] == len(rows[::25]) == len(doc["rows"])


def test_validate_says_which_row_it_has_reached(tmp_path, monkeypatch):
    """Long work shows progress: the row reached, by its id, on the progress callback."""
    import planner.measure.validate as validate
    header, *rows = [line for line in RUNS.read_text().splitlines() if line.strip()]
    table = tmp_path / "runs.csv"
    table.write_text("\n".join([header, *rows[:3]]) + "\n")
    monkeypatch.setattr(validate, "PROGRESS_EVERY_S", 0.0)
    heard = []
    validate.validate(table, progress=heard.append)
    assert [line.split("] ", 1)[1] for line in heard] == [f"row {n} of 3 ({row.split(',')[0]})"
                                                         for n, row in enumerate(rows[:3], 1)]


def test_validate_rejects_missing_columns(tmp_path, capsys):
    bad = tmp_path / "runs.csv"
    bad.write_text("id,arch,layers\nx,gpt,2\n")
    assert main(["validate", str(bad)]) == 2
    assert "missing columns hidden, heads" in capsys.readouterr().err


def test_models_and_devices_list(capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "llama3-405b" in out and "llama-70b -> llama2-70b" in out
    assert next(line for line in out.splitlines() if line.startswith("debug-small")).split()[1] == "4.2M"
    assert main(["models", "--json"]) == 0
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)["models"]}
    assert models["llama2-70b"]["aliases"] == ["llama-70b"] and models["llama3-8b"]["aliases"] == ["llama-8b"] and models["llama2-13b"]["aliases"] == ["llama-13b"]
    assert main(["search", "--model", "llama3-8b", "--cluster", "1x8xV100"]) == 2   # Volta has no bf16
    assert "(--dtype fp16 or fp32)" in capsys.readouterr().err
    assert main(["devices", "--json"]) == 0
    devices = {d["name"]: d for d in json.loads(capsys.readouterr().out)["devices"]}
    assert "H100-SXM5-80GB" in devices
    # the memory a search budgets from: what torch.cuda reports, where the profile gives it
    assert devices["B200"]["usable_memory_bytes"] == 191_502_483_456 < devices["B200"]["memory_bytes"] * 1.07
    assert main(["devices"]) == 0
    assert next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("B200 ")).split()[3] == "178.4"


def test_closed_pipe_is_not_a_traceback():
    """`planner predict ... | head -1` must not print a BrokenPipeError traceback."""
    cmd = f"{sys.executable} -m planner {' '.join(PREDICT)} | head -1"
    out = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True)
    assert out.stdout.startswith("model") and "Traceback" not in out.stderr


def test_the_cli_module_runs_as_the_command_does():
    """`python -m planner.cli` is the command, as `python -m planner` is."""
    out = subprocess.run([sys.executable, "-m", "planner.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("usage: planner")


def test_a_path_the_system_refuses_is_the_users_one_line(tmp_path, capsys):
    """A name over the file system's limit, or a symbolic link loop, where a command first touches
    it: one line naming the path, exit 2 (not a bug report)."""
    long_name = str(tmp_path / ("z" * 300 + ".json"))
    assert main([*PREDICT, "--out", long_name]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.endswith(".json: File name too long") and "internal error" not in err
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    plan = tmp_path / "plan.json"
    assert main([*PREDICT, "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), "--data", str(loop), "--print-launch"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--data" in err and "loops" in err and "internal error" not in err
    assert main([*PREDICT, "--out", str(loop / "x.json")]) == 2   # a file to write under the loop
    assert "loop is a symbolic link that leads nowhere" in capsys.readouterr().err


def test_a_run_directory_takes_a_safe_stem_of_the_model_name():
    """A plan's model name (a config path's, or edited by hand) never leaves runs/ or grows past a name."""
    from planner.commands.run import RUN_DIR_STEM_CHARS, run_dir_stem
    assert run_dir_stem("llama3-70b") == "llama3-70b"
    assert run_dir_stem("../../escape") == "escape" and run_dir_stem("a/b") == "a-b"
    assert run_dir_stem("") == run_dir_stem("..") == "model"
    assert len(run_dir_stem("x" * 300)) == RUN_DIR_STEM_CHARS


def test_predict_takes_a_searched_split_and_per_rank_recomputation(capsys):
    """A plan as the search prints it (layers/stage 21,20,20,19, rc=full:3/0) is one predict away: --layers
    and a --recompute-layers list give exactly that plan."""
    flags = ["predict", "--model", "llama-70b", "--cluster", "4x8xA100", "--tp", "8", "--pp", "2", "--vpp", "2",
             "--layers", "21,20,20,19", "--recompute", "full", "--recompute-layers", "3,0", "--json"]
    assert main(flags) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["layers_per_stage"] == [21, 20, 20, 19] and plan["recompute_num_layers"] == [3, 0]
    # and the table prints the split as --layers takes it
    assert main(flags[:-1]) == 0
    assert "layers/stage 21,20,20,19 " in capsys.readouterr().out
    # a rank the split makes longer than an even one recomputes as many as it holds, not more
    uneven = [*flags[:11], "--layers", "22,22,22,14", "--recompute", "full", "--recompute-layers"]
    assert main([*uneven, "44,0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["recompute_num_layers"] == [44, 0]
    assert main([*uneven, "45,0"]) == 2
    assert "--recompute-layers 45,0: pipeline rank 0 holds 44 layers, not 45" in capsys.readouterr().err
    # one count for every rank: at most the longest rank's
    assert main([*uneven, "45"]) == 2
    assert "--recompute-layers 45: a pipeline rank holds at most 44 layers" in capsys.readouterr().err
    # DeepSeek-V3's default layout puts its 3 dense first layers on the first stage: rank 0 holds 9
    v3 = ["predict", "--model", "deepseek-v3", "--cluster", "128x8xH100", "--tp", "2", "--pp", "8", "--vpp", "4",
          "--ep", "64", "--recompute", "full", "--json", "--recompute-layers"]
    assert main([*v3, "9,7,7,8,8,8,7,7"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["recompute_num_layers"] == [9, 7, 7, 8, 8, 8, 7, 7]


@pytest.mark.parametrize("extra,message", [
    (["--layers", "40,40,1"], r"--layers 40,40,1: expected 2 counts .* adding up to the model's 80 layers"),
    (["--layers", "41,40"], r"--layers 41,40: expected 2 counts"),
    (["--recompute", "full", "--recompute-layers", "1,2,3"], r"one count, or one per pipeline rank \(2\)"),
    (["--recompute", "full", "--recompute-layers", "1,x"], r"--recompute-layers '1,x': expected whole numbers"),
])
def test_bad_layer_counts_are_one_line(extra, message, capsys):
    assert main(["predict", "--model", "llama-70b", "--cluster", "4x8xA100", "--tp", "8", "--pp", "2", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
