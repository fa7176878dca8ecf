"""Issue 18's named cases, each ending cleanly: one stderr line naming the file or flag, exit 2;
nothing replaced without --overwrite; bounded work on huge inputs. (Interruption: tests/runtime/
test_interrupt.py; random inputs: test_fuzz.py.)"""
from __future__ import annotations

import csv
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from costmodel.hardware import profile_dir
from planner.cli import main

CPU = "1x2xxeon-amx"
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 512}


@pytest.fixture()
def files(tmp_path: Path, capsys) -> dict[str, Path]:
    plan = tmp_path / "plan.json"
    assert main(["predict", "--model", "debug-tiny", "--cluster", CPU, "--pp", "2", "--out", str(plan), "--json"]) == 0
    capsys.readouterr()
    doc = json.loads(plan.read_text())
    out = {"plan": plan, "dir": tmp_path / "a-dir"}
    out["dir"].mkdir()
    for name, content in {
        "list.json": [1, 2], "str_hidden.json": {**LLAMA, "hidden_size": "64"},
        "null_ffn.json": {**LLAMA, "intermediate_size": None},
        "huge_layers.json": {**LLAMA, "num_hidden_layers": 10**9},
        "plan_str_dp.json": {**doc, "plan": {**doc["plan"], "dp": "2"}},
        "plan_null.json": {**doc, "plan": None}, "measured_list.json": [], "unversioned.json": {"step_times_s": [1.0]},
    }.items():
        out[name] = tmp_path / name
        out[name].write_text(json.dumps(content))
    out["twice.json"] = tmp_path / "twice.json"   # json.loads keeps the last "tp" without a word
    out["twice.json"].write_text(plan.read_text().replace('"tp": 1,', '"tp": 1, "tp": 2,', 1))
    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    out["loop"] = tmp_path / "loop1"
    out["garbage.npy"] = tmp_path / "garbage.npy"
    out["garbage.npy"].write_bytes(os.urandom(1000))
    out["negative.npy"] = tmp_path / "negative.npy"
    np.save(out["negative.npy"], np.arange(-5, 4000, dtype=np.int32))
    return out


def _one_line(capsys, code: int, *phrases: str) -> str:
    """The error is one line (progress lines of a long search before it are not errors)."""
    err = "\n".join(line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("search ["))
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for phrase in phrases:
        assert phrase in err, err
    assert code == 2
    return err


CASES = [  # (argv with {names} for fixture files, phrases the line must hold)
    (["predict", "--model", "{list.json}", "--cluster", CPU], ["list.json", "JSON object"]),
    (["predict", "--model", "{str_hidden.json}", "--cluster", CPU], ["str_hidden.json", "hidden_size", "integer"]),
    (["predict", "--model", "{null_ffn.json}", "--cluster", CPU], ["null_ffn.json", "intermediate_size"]),
    (["predict", "--plan", "{plan_str_dp.json}"], ["plan_str_dp.json", "plan: dp", "integer"]),
    (["predict", "--plan", "{plan_null.json}"], ["plan_null.json", "plan must be a JSON object"]),
    (["predict", "--plan", "{twice.json}"], ["twice.json", "key 'tp' is given twice"]),
    (["report", "{plan}", "--measured", "{measured_list.json}", "--out", "{dir}/r"],
     ["measured_list.json", "a JSON object is expected, not a list"]),
    (["report", "{plan}", "--measured", "{plan}", "--out", "{dir}/r"],
     ["plan.json: a plan file, not a measured.json"]),
    (["report", "{plan}", "--measured", "{unversioned.json}", "--out", "{dir}/r"],
     ["unversioned.json: has no version; this planner reads measured.json versions 1 to"]),
    (["predict", "--plan", "{dir}"], ["a-dir", "is a directory"]),
    (["predict", "--plan", "{loop}"], ["loop1", "symbolic links"]),
    (["predict", "--plan", "{garbage.npy}"], ["garbage.npy", "not a text file"]),
    (["search", "--model", "debug-tiny", "--cluster", CPU, "--out", "{plan}"], ["plan.json exists", "--overwrite"]),
    (["search", "--model", "debug-tiny", "--cluster", CPU, "--out", "{dir}"], ["a-dir is a directory"]),
    (["search", "--model", "debug-tiny", "--cluster", CPU, "--out", "/proc/x.json"], ["--out /proc/x.json", "cannot"]),
    (["search", "--model", "debug-tiny", "--cluster", CPU, "--csv", "/proc/x.csv"], ["--csv /proc/x.csv", "cannot"]),
    (["predict", "--plan", "/dev/zero"], ["/dev/zero is not a regular file"]),
    (["predict", "--model", "debug-tiny", "--cluster", CPU, "--overwrite"], ["--overwrite would be ignored"]),
    (["run", "{plan}", "--nproc", "2", "--data-dtype", "uint32"], ["--data-dtype would be ignored"]),
    (["run", "{plan}", "--nproc", "2", "--seed", "99999999999999999999"], ["--seed", "2^32"]),
    (["search", "--model", "debug-tiny", "--cluster", CPU, "--report", "/proc/rep"], ["--report /proc/rep"]),
    (["predict", "--model", "debug-tiny", "--cluster", CPU, "--out", "/proc/p.json"], ["--out /proc/p.json"]),
    (["report", "{plan}", "--out", "/proc/rep"], ["--out /proc/rep"]),
    (["run", "{plan}", "--nproc", "2", "--out", "/proc/run"], ["--out /proc/run"]),
    (["calibrate", "{dir}", "--profile", "xeon-amx", "--out", "/proc/c.toml"], ["--out /proc/c.toml"]),
    (["predict", "--model", "debug-tiny", "--cluster", CPU, "--global-batch", "0"], ["--global-batch", "positive"]),
    (["predict", "--model", "debug-tiny", "--cluster", CPU, "--seq-len", "0"], ["--seq-len", "positive"]),
    (["run", "{plan}", "--nproc", "0"], ["--nproc", "positive"]),
    (["predict", "--model", "debug-tiny", "--cluster", CPU, "--tp", "2", "--sp", "--no-sp"], ["--sp and --no-sp"]),
    (["search", "--model", "debug-tiny", "--cluster", CPU, "--fix", "tp=1", "--fix", "tp=2"], ["--fix tp given twice"]),
    (["search", "--model", "debug-tiny", "--cluster", CPU, "--fix", "schedule=zbh1"],
     ["'zbh1' is not a valid schedule", "one of gpipe, 1f1b, interleaved-1f1b, zb-h1"]),
    (["search", "--model", "debug-tiny", "--cluster", CPU, "--fix", "sp=maybe"], ["'maybe' is not a valid sp; yes or no"]),
    (["predict", "--plan", "{plan}", "--model", "llama-70b", "--cluster", "8x8xA100"],
     ["--cluster, --model would be ignored", "--plan"]),
    (["predict", "--model", "debug-tiny", "--cluster", CPU, "--tp", "-1"], ["--tp", "-1 is not a positive integer"]),
    (["predict", "--model", "debug-tiny", "--cluster", "1x2x{dir}"], ["a-dir", "not a .toml profile"]),
    (["predict", "--model", "debug-tiny", "--cluster", CPU, "--dtype", "fp9"], ["--dtype", "see planner predict --help"]),
    (["run", "{plan}", "--dry-run", "--steps", "3"], ["--steps would be ignored", "--dry-run"]),
    (["run", "{plan}", "--nproc", "2", "--data", "{garbage.npy}"], ["token file", "garbage.npy"]),
    (["run", "{plan}", "--nproc", "2", "--data", "{negative.npy}"], ["negative.npy", "token id -5"]),
    (["models", "--steps", "3"], ["planner models: error: unrecognized arguments: --steps 3"]),
    (["predict", "--model", "debug-tiny", "--cluster", CPU, "--vpp", "1000000"], ["pipeline stages", "layers"]),
    (["predict", "--model", "debug-tiny", "--cluster", CPU, "--dp", "1", "--pp", "1000000"], ["devices"]),
    (["predict", "--model", "debug-tiny", "--cluster", CPU, "--recompute-layers", "1"], ["needs --recompute"]),
    (["predict", "--model", "debug-tiny", "--cluster", CPU, "--recompute", "full", "--recompute-layers", "999"],
     ["--recompute-layers 999", "at most"]),
]


@pytest.mark.parametrize("argv, phrases", CASES, ids=[" ".join(c[0][:4]) + f" #{i}" for i, c in enumerate(CASES)])
def test_named_case_is_one_line_and_exit_2(files, capsys, argv, phrases):
    def filled(arg: str) -> str:
        for name, path in files.items():
            arg = arg.replace("{" + name + "}", str(path))
        return arg
    _one_line(capsys, main([filled(a) for a in argv]), *phrases)


@pytest.mark.parametrize("config, limit", [({**LLAMA, "num_hidden_layers": 10**9}, "num_hidden_layers"),
                                           (None, "world size")])
def test_huge_inputs_end_at_once(tmp_path, capsys, config, limit):
    """10^9 layers or 8 x 10^8 devices end at once, not after minutes of work before --time-limit is looked at."""
    model = "debug-tiny"
    if config:
        (tmp_path / "c.json").write_text(json.dumps(config))
        model = str(tmp_path / "c.json")
    start = time.perf_counter()
    code = main(["search", "--model", model, "--cluster", "8x8xA100" if config else "100000000x8xA100",
                 "--time-limit", "10"])
    assert time.perf_counter() - start < 5
    _one_line(capsys, code, limit, "limit")


def test_the_largest_allowed_cluster_obeys_the_time_limit(capsys):
    """Within the second a plan, or (on a slower machine) one line saying none was found in it."""
    start = time.perf_counter()
    code = main(["search", "--model", "llama-70b", "--cluster", "131072x8xA100", "--time-limit", "1", "--json"])
    assert time.perf_counter() - start < 8   # the limit bounds the search; tables and start-up follow
    if code != 0:
        err = capsys.readouterr().err
        assert code == 2 and "no plan found within the --time-limit of 1 s" in err.splitlines()[-1]


def _runs_table(tmp_path: Path, name: str, edit) -> Path:
    with open(profile_dir() / "runs" / "published_runs.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    stated = [r for r in rows if all(r[k] for k in ("tp", "pp", "dp", "micro_batch"))][:2]
    path = tmp_path / name
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(edit(stated))
    return path


@pytest.mark.parametrize("name, edit, phrases", [
    ("header.csv", lambda rows: [], ["no runs (only a header)"]),
    ("negative.csv", lambda rows: [{**rows[0], "metric_value": "-3"}], ["line 2", "is out of range for iteration_time_s"]),
    ("dupes.csv", lambda rows: [rows[0], rows[0]], ["line 3", "duplicate id"]),
    ("huge.csv", lambda rows: [{**rows[0], "layers": "1000000000"}], ["line 2", "layers 1,000,000,000", "limit"]),
])
def test_bad_runs_tables(tmp_path, capsys, name, edit, phrases):
    path = _runs_table(tmp_path, name, edit)
    start = time.perf_counter()
    code = main(["validate", str(path)])
    assert time.perf_counter() - start < 10
    _one_line(capsys, code, name, *phrases)


def test_a_byte_order_mark_is_not_part_of_a_column_name(tmp_path, capsys):
    path = _runs_table(tmp_path, "bom.csv", lambda rows: rows[:1])
    path.write_text("\ufeff" + path.read_text())
    assert main(["validate", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["summary"]["n"] == 1 and doc["summary"]["spearman"] is None   # one row: no rank correlation


def test_nothing_is_replaced_without_overwrite(tmp_path, capsys):
    out = tmp_path / "plan.json"
    tiny = ["search", "--model", "debug-tiny", "--cluster", CPU, "--out", str(out)]
    assert main(tiny) == 0
    first = out.read_text()
    out.write_text(first.replace('"dp"', '"dp" ', 1))   # marked, to see whether it is replaced
    capsys.readouterr()
    _one_line(capsys, main(tiny), "exists", "--overwrite")
    assert out.read_text() != first
    assert main([*tiny, "--overwrite"]) == 0 and out.read_text() == first


def test_a_used_run_directory_is_refused_before_anything_runs(files, capsys):
    run = files["dir"] / "run"
    run.mkdir()
    (run / "measured.json").write_text("{}")
    start = time.perf_counter()
    code = main(["run", str(files["plan"]), "--nproc", "2", "--out", str(run)])
    assert time.perf_counter() - start < 3
    _one_line(capsys, code, "holds an earlier result (measured.json)", "--overwrite")


def test_validate_obeys_its_time_limit(capsys):
    start = time.perf_counter()
    code = main(["validate", "--time-limit", "0.5"])
    assert time.perf_counter() - start < 5
    from planner.measure.runs_table import default_runs_path, read_runs
    _one_line(capsys, code, "stopped at --time-limit 0.5 s after", f"of {len(read_runs(default_runs_path()))} rows")


def test_gpt2_configs_with_null_optional_fields_are_read(tmp_path, capsys):
    """Hugging Face writes "n_inner": null for the default 4h; null is the default, not an error."""
    config = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512,
              "n_positions": 128, "n_inner": None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["predict", "--model", str(tmp_path), "--cluster", CPU, "--json"]) == 0


def test_a_space_too_large_to_list_obeys_the_time_limit(capsys):
    """40,320 devices (a number with many divisors) and a batch as divisible: listing the
    candidates takes about a second, so --time-limit is looked at while they are listed. Where the
    limit falls during the listing the search says so in one line; where the listing ends first
    (a faster machine, imports already warm) the plans solved by then are shown, marked as
    stopped at the limit and not proven optimal."""
    start = time.perf_counter()
    code = main(["search", "--model", "llama3-405b", "--cluster", "5040x8xH100", "--global-batch", "40320",
                 "--time-limit", "1"])
    assert time.perf_counter() - start < 4
    if code == 0:
        out = capsys.readouterr().out
        assert "NOT proven optimal (stopped at --time-limit" in out, out
        return
    _one_line(capsys, code, "no plan found within the --time-limit of 1 s", "still being listed")


def test_odd_profiles_are_refused_naming_the_number(tmp_path, capsys):
    """A zero bandwidth would divide by zero, a negative one make plans faster, NaN print 'step nan s'."""
    text = (profile_dir() / "H100-SXM5-80GB.toml").read_text()
    for name, old, new, phrase in (("zero_bw.toml", "bandwidth_bytes_per_s = ", "bandwidth_bytes_per_s = 0 #", "bandwidth_bytes_per_s"),
                                   ("neg_gemm.toml", "\ngemm = ", "\ngemm = -1 #", "efficiency.gemm")):
        assert old in text
        (tmp_path / name).write_text(text.replace(old, new, 1))
        _one_line(capsys, main(["predict", "--model", "llama-7b", "--cluster", f"2x8x{tmp_path / name}"]),
                  name, phrase, "out of range")


def test_colliding_outputs_are_refused_before_the_search(tmp_path, capsys):
    same = str(tmp_path / "x.json")
    _one_line(capsys, main(["search", "--model", "debug-tiny", "--cluster", CPU, "--out", same, "--csv",
                            str(tmp_path / "y.csv"), "--report", same]),
              "--out and --report name the same path")   # the two that collide, not --csv


def test_a_config_file_names_the_model_and_its_own_keys(tmp_path, capsys):
    """A config.json elsewhere than a snapshot folder is named after its file, and the spec's own
    checks speak of the file and of the config's keys, not the planner's fields."""
    (tmp_path / "my-model.json").write_text(json.dumps({**LLAMA, "num_key_value_heads": 5}))
    _one_line(capsys, main(["predict", "--model", str(tmp_path / "my-model.json"), "--cluster", "1x8xH100"]),
              "my-model.json: model 'my-model': num_attention_heads", "num_key_value_heads 5")
    from costmodel.hf_config import model_from_hf_config
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "config.json").write_text(json.dumps(LLAMA))
    assert model_from_hf_config(tmp_path / "snap" / "config.json").name == "snap"


def test_a_qwen2_moe_config_without_its_shared_expert_width_is_refused(tmp_path, capsys):
    """transformers builds Qwen2-MoE's shared expert whatever the config says (5632 wide if
    unstated): a config leaving the width out is refused by name, not priced without it."""
    cfg = {"model_type": "qwen2_moe", "hidden_size": 1024, "intermediate_size": 2816, "moe_intermediate_size": 704,
           "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 4, "num_experts": 8,
           "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 4096}
    (tmp_path / "qmoe.json").write_text(json.dumps(cfg))
    _one_line(capsys, main(["predict", "--model", str(tmp_path / "qmoe.json"), "--cluster", "1x8xH100"]),
              "qmoe.json", "shared_expert_intermediate_size")


def test_a_plan_file_error_names_the_file_and_a_json_error_its_place(tmp_path, capsys):
    """predict --plan names the plan file whose plan is invalid, as run, report and export do; a
    JSON syntax error says where it is, and asks "truncated?" only where the text ends early."""
    assert main(["predict", "--model", "debug-tiny", "--cluster", CPU, "--out", str(tmp_path / "p.json")]) == 0
    capsys.readouterr()
    doc = json.loads((tmp_path / "p.json").read_text())
    doc["plan"]["tp"] = -4
    (tmp_path / "neg.json").write_text(json.dumps(doc))
    _one_line(capsys, main(["predict", "--plan", str(tmp_path / "neg.json")]),
              f"{tmp_path / 'neg.json'} is not a valid plan", "tp must be at least 1")
    text = (tmp_path / "p.json").read_text()
    (tmp_path / "comma.json").write_text(text.replace('"version": 1,', '"version": 1,,', 1))
    err = _one_line(capsys, main(["predict", "--plan", str(tmp_path / "comma.json")]), "comma.json", "not valid JSON",
                    "line ")
    assert "truncated" not in err
    (tmp_path / "cut.json").write_text(text[:len(text) // 2])
    _one_line(capsys, main(["predict", "--plan", str(tmp_path / "cut.json")]), "cut.json", "(truncated?)")


def test_an_empty_model_or_cluster_is_said_to_be_empty(capsys):
    _one_line(capsys, main(["search", "--model", "llama-70b", "--cluster", ""]), "--cluster is empty")
    _one_line(capsys, main(["predict", "--cluster", CPU]), "--model is required", "--plan")
