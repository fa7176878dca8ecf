"""The fuzzing harness: random command lines, JSON and CSV mutations of real inputs and random
output paths, thrown at `planner.cli.main` in-process. Every example must end with exit 0, or
with exit 1/2 and exactly one line on stderr; no exception may escape, no input file may
change, and the command must end within its time bound.

Used by tests/planner/test_fuzz.py (a few hundred examples, derandomised in CI) and by
benchmarks/fuzz.py (longer, random seeds).
"""
from __future__ import annotations

import contextlib
import copy
import csv
import hashlib
import io
import json
import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hypothesis import strategies as st

from costmodel.hardware import parse_cluster, profile_dir
from costmodel.plan import PlanFile
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.cli import main
from planner.space import Choice, build_plan

PROFILE = "xeon-amx"            # a shipped CPU profile: plans on it are cheap to price
SEARCH_LIMIT_S = 2.0            # --time-limit the harness gives a search unless it draws its own
SLACK_S = 8.0                   # start-up and the work after a search's limit (tables, files)

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
          "max_position_embeddings": 256, "tie_word_embeddings": False}


@dataclass(frozen=True)
class Workspace:
    inputs: Path    # read-only by contract: hashed before and after every example
    outputs: Path   # where drawn output paths point
    plan: Path
    config: Path
    runs: Path
    measured: Path
    run_dir: Path
    profile: Path
    tokens: Path
    binary: Path

    def digest(self) -> dict[str, str]:
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(self.inputs.rglob("*")) if p.is_file()}


def make_workspace(root: Path) -> Workspace:
    from runtime.measure import measured_record
    inputs, outputs = root / "inputs", root / "outputs"
    inputs.mkdir(parents=True)
    outputs.mkdir()
    model, cluster = resolve_model("debug-tiny"), parse_cluster(f"1x2x{PROFILE}")
    train = TrainSpec(seq_len=64, global_batch_size=4)
    pf = PlanFile(plan=build_plan(model, train, cluster, Choice(pp=2, micro_batch_size=1)),
                  model=model, train=train, cluster=cluster)
    run_dir = inputs / "run"
    run_dir.mkdir()
    pf.save(run_dir / "plan.json")
    pf.save(inputs / "plan.json")
    raw = {"losses": [5.5, 5.4], "step_times_s": [0.05], "peak_memory_bytes": [4e6, 4e6],
           "memory_source": "live tensor bytes", "device": "cpu"}
    measured_record(pf, raw, steps=1, warmup=1, wall_s=1.0).save(run_dir / "measured.json")
    shutil.copy(run_dir / "measured.json", inputs / "measured.json")
    (inputs / "config.json").write_text(json.dumps(CONFIG))
    shutil.copy(profile_dir() / f"{PROFILE}.toml", inputs / "profile.toml")
    with open(profile_dir() / "runs" / "published_runs.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    stated = [r for r in rows if all(r[k] for k in ("tp", "pp", "dp", "micro_batch", "zero_stage"))][:3]
    with open(inputs / "runs.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(stated)
    np.save(inputs / "tokens.npy", np.arange(4096, dtype=np.uint16) % 512)
    (inputs / "binary.bin").write_bytes(bytes(range(256)) * 4)
    (inputs / "a-directory").mkdir()
    os.mkfifo(inputs / "a-fifo")   # reading it would block: must be refused, not read
    return Workspace(inputs=inputs, outputs=outputs, plan=inputs / "plan.json", config=inputs / "config.json",
                     runs=inputs / "runs.csv", measured=inputs / "measured.json", run_dir=run_dir,
                     profile=inputs / "profile.toml", tokens=inputs / "tokens.npy", binary=inputs / "binary.bin")


# --- what an example may be made of ----------------------------------------------------------

NUMBERS = st.sampled_from(["-1", "0", "1", "2", "3", "4", "8", "64", "1e3", "nan", "inf", "-0.5", "0.05",
                           "1000000000", "99999999999999999999", "", "two", "0x10"])


def input_paths(ws: Workspace):
    return st.sampled_from([str(ws.plan), str(ws.config), str(ws.runs), str(ws.measured), str(ws.profile),
                            str(ws.tokens), str(ws.binary), str(ws.inputs / "a-directory"), str(ws.run_dir),
                            str(ws.inputs / "missing.json"), "/dev/null", "/dev/zero", "/proc",
                            str(ws.inputs / "a-fifo")])


def output_paths(ws: Workspace, suffix: str):
    existing = ws.outputs / f"existing{suffix}"
    return st.sampled_from([str(ws.outputs / f"new{suffix}"), str(ws.outputs / "deep" / "er" / f"new{suffix}"),
                            str(existing), str(ws.outputs), str(ws.plan), f"/proc/no{suffix}",
                            str(ws.binary / f"under-a-file{suffix}"), str(ws.inputs / "a-directory")])


def models(ws: Workspace):
    return st.sampled_from(["debug-tiny"] * 4 + [str(ws.config)] * 3 + [
        "llama-7b", "nonsense", str(ws.inputs), str(ws.binary), str(ws.plan), ""])


def clusters(ws: Workspace):
    return st.sampled_from([f"1x2x{PROFILE}"] * 4 + [f"1x4x{PROFILE}", "1x8xA100", "2x8xH100", "0x8xA100",
                            "100000000x8xA100", "1x2xnothing", f"1x2x{ws.profile}", f"1x2x{ws.inputs}",
                            "1x2x/proc/x.toml", "8x8", "x", f"1x2x{ws.binary}"])


FLAG_VALUES = {
    "--seq-len": lambda ws: NUMBERS, "--global-batch": lambda ws: NUMBERS, "--dp": lambda ws: NUMBERS,
    "--tp": lambda ws: NUMBERS, "--pp": lambda ws: NUMBERS, "--cp": lambda ws: NUMBERS,
    "--mbs": lambda ws: NUMBERS, "--vpp": lambda ws: NUMBERS, "--zero": lambda ws: NUMBERS,
    "--recompute-layers": lambda ws: NUMBERS, "--memory-headroom": lambda ws: NUMBERS,
    "--dtype": lambda ws: st.sampled_from(["bf16", "fp32", "fp8", ""]),
    "--recompute": lambda ws: st.sampled_from(["none", "selective", "full", "half"]),
    "--schedule": lambda ws: st.sampled_from(["1f1b", "gpipe", "zbv", "zb-h1", "interleaved-1f1b", "dualpipev", "x"]),
    "--mesh-order": lambda ws: st.sampled_from(["pp,dp,cp,tp", "tp,dp", "pp,dp,cp,tp,tp", ""]),
    "--model": models, "--cluster": clusters,
    "--fix": lambda ws: st.sampled_from(["tp=1", "tp=2", "pp=2", "zero=3", "sp=true", "sp=maybe", "nope=1",
                                         "tp", "=2", "schedule=zbv"]),
    "--top": lambda ws: NUMBERS, "--max-tp": lambda ws: NUMBERS,
    "--time-limit": lambda ws: st.sampled_from(["0.5", "1", "0", "-1", "nan", "inf", "x"]),
    "--objective": lambda ws: st.sampled_from(["time", "memory", "speed"]),
    "--steps": lambda ws: NUMBERS, "--warmup": lambda ws: NUMBERS, "--seed": lambda ws: NUMBERS,
    "--lr": lambda ws: NUMBERS, "--nproc": lambda ws: NUMBERS,
    "--data": lambda ws: st.sampled_from([str(ws.tokens), str(ws.binary), str(ws.inputs / "missing.npy"),
                                          str(ws.inputs / "a-directory")]),
    "--plan": input_paths, "--measured": input_paths, "--profile": input_paths,
    "--data-dtype": lambda ws: st.sampled_from(["uint16", "uint32", "int8"]),
    "--to": lambda ws: st.sampled_from(["torchtitan", "megatron", "deepspeed", "nccl", ""]),
}
SWITCHES = {"--json", "--sp", "--no-sp", "--overwrite", "--no-recompute", "--dry-run", "--print-launch"}

# per command: the flags drawn for it, and the positionals it takes
COMMANDS = {
    "predict": ["--model", "--cluster", "--seq-len", "--global-batch", "--dtype", "--dp", "--tp", "--pp", "--cp",
                "--mbs", "--vpp", "--zero", "--recompute", "--recompute-layers", "--schedule", "--mesh-order",
                "--memory-headroom", "--plan", "--out", "--json", "--sp", "--no-sp", "--overwrite"],
    "search": ["--model", "--cluster", "--seq-len", "--global-batch", "--dtype", "--fix", "--top", "--max-tp",
               "--time-limit", "--objective", "--zero", "--schedule", "--out", "--csv", "--report", "--json",
               "--overwrite", "--no-recompute"],
    "run": ["--steps", "--warmup", "--seed", "--lr", "--nproc", "--data", "--data-dtype", "--out", "--dry-run",
            "--print-launch", "--json", "--overwrite"],
    "validate": ["--json"],
    "report": ["--measured", "--out", "--overwrite"],
    "calibrate": ["--profile", "--out", "--overwrite"],
    "export": ["--to", "--to", "--out", "--json", "--overwrite"],
    "models": ["--json"], "devices": ["--json"],
}
ANY_FLAG = sorted(SWITCHES | set(FLAG_VALUES))   # a flag of another command, now and then
OUT_SUFFIX = {"predict": ".json", "search": ".json", "calibrate": ".toml"}


@st.composite
def command_lines(draw, ws: Workspace) -> list[str]:
    command = draw(st.sampled_from(sorted(COMMANDS)))
    argv = [command]
    if command in ("run", "report", "export"):
        argv.append(draw(input_paths(ws)))
    elif command == "validate":
        argv.append(draw(st.sampled_from([str(ws.runs), str(ws.plan), str(ws.binary), str(ws.inputs / "a-directory"),
                                          str(ws.inputs / "missing.csv")])))
    elif command == "calibrate":
        argv.append(draw(st.sampled_from([str(ws.run_dir), str(ws.inputs), str(ws.plan)])))
    elif command in ("predict", "search") and draw(st.integers(0, 9)) < 8:
        argv += ["--model", draw(models(ws)), "--cluster", draw(clusters(ws))]
    own = st.sampled_from(COMMANDS[command]) if COMMANDS[command] else st.nothing()
    for flag in draw(st.lists(st.one_of(own, own, own, own, own, own, own, own, own, st.sampled_from(ANY_FLAG)),
                              max_size=5, unique=True)):
        if flag in SWITCHES:
            argv.append(flag)
        elif flag in ("--out", "--csv", "--report"):
            suffix = ".csv" if flag == "--csv" else "" if flag == "--report" else OUT_SUFFIX.get(command, "")
            argv += [flag, draw(output_paths(ws, suffix))]
        else:
            argv += [flag, draw(FLAG_VALUES[flag](ws))]
    return _bounded(argv)


DEGREES = st.sampled_from(["1", "2", "4", "8"])


@st.composite
def plan_command_lines(draw, ws: Workspace) -> list[str]:
    """predict and search with plausible values only: what valid-looking combinations of degrees,
    schedules, recomputation, dtypes and shapes do (a crash hides better there than in nonsense)."""
    command = draw(st.sampled_from(["predict", "predict", "predict", "search"]))
    argv = [command, "--model", draw(st.sampled_from(["debug-tiny", "llama-7b", "llama3-8b", str(ws.config)])),
            "--cluster", draw(st.sampled_from(["1x8xA100", "2x8xH100", "1x4xA100-40GB", f"1x2x{PROFILE}",
                                               f"1x4x{PROFILE}"])), "--json"]
    for flag in ("tp", "pp", "cp", "mbs", "vpp"):
        if draw(st.booleans()):
            argv += [f"--{flag}", draw(DEGREES)] if command == "predict" else ["--fix", f"{flag}={draw(DEGREES)}"]
    choices = {"--zero": ["0", "1", "2", "3"], "--schedule": ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"],
               "--dtype": ["fp32", "bf16", "fp16"], "--seq-len": ["128", "256", "2048", "4096"],
               "--global-batch": ["8", "16", "64", "512"], "--attention": ["flash", "eager"]}
    if command == "predict":
        choices |= {"--recompute": ["none", "selective", "full"],
                    "--mesh-order": ["pp,dp,cp,tp", "dp,pp,cp,tp", "tp,cp,dp,pp"]}
    for flag, values in choices.items():
        if draw(st.booleans()):
            argv += [flag, draw(st.sampled_from(values))]
    if command == "predict" and draw(st.booleans()):
        argv.append(draw(st.sampled_from(["--sp", "--no-sp"])))
    return _bounded(argv)


def _bounded(argv: list[str]) -> list[str]:
    """A search the harness runs gets a time limit (its own drawn one is kept and is what binds);
    a run only ever prints or dry-runs: training is the runtime tests' work, not the fuzzer's."""
    if argv[0] == "search" and "--time-limit" not in argv:
        argv += ["--time-limit", str(SEARCH_LIMIT_S)]
    if argv[0] == "run" and "--dry-run" not in argv and "--print-launch" not in argv:
        argv.append("--print-launch")
    return argv


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.sampled_from([0, -1, 1, 2, 3, 7, 2**40, 10**30, -(2**63)])
    | st.sampled_from([0.0, -0.5, 1e300, float("nan"), float("inf")]) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, prefix + (i,))


@st.composite
def json_mutations(draw, doc) -> object:
    """`doc` with one place changed: a value replaced by random JSON, a key deleted or renamed."""
    doc = copy.deepcopy(doc)
    path = draw(st.sampled_from(list(_paths(doc))))
    if not path:
        return draw(JSON_VALUES)
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    how = draw(st.sampled_from(["replace", "replace", "delete", "rename"]))
    if how == "replace" or isinstance(parent, list):
        parent[path[-1]] = draw(JSON_VALUES)
    elif how == "delete":
        del parent[path[-1]]
    else:
        parent[path[-1] + "_x"] = parent.pop(path[-1])
    return doc


@st.composite
def csv_mutations(draw, text: str) -> str:
    rows = list(csv.reader(io.StringIO(text)))
    how = draw(st.sampled_from(["cell", "cell", "cell", "drop_column", "duplicate", "header_only", "bom",
                                "truncate", "empty"]))
    if how == "cell":
        r = draw(st.integers(1, len(rows) - 1))
        c = draw(st.integers(0, len(rows[0]) - 1))
        rows[r][c] = draw(st.sampled_from(["", "x", "-1", "0", "1e9", "nan", "OOM", "1000000000", "3.5"]))
    elif how == "drop_column":
        c = draw(st.integers(0, len(rows[0]) - 1))
        rows = [row[:c] + row[c + 1:] for row in rows]
    elif how == "duplicate":
        rows.append(rows[1])
    elif how == "header_only":
        rows = rows[:1]
    elif how == "empty":
        return ""
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    text = out.getvalue()
    if how == "bom":
        return "\ufeff" + text
    if how == "truncate":
        return text[: draw(st.integers(0, len(text)))]
    return text


def time_bound_s(argv: list[str]) -> float:
    limit = SEARCH_LIMIT_S
    if "--time-limit" in argv:
        try:
            drawn = float(argv[argv.index("--time-limit") + 1])
        except ValueError:
            drawn = math.nan
        if math.isfinite(drawn):   # otherwise the command refuses it
            limit = min(max(drawn, 0.0), 60.0)
    return (limit if argv[0] == "search" else 0.0) + SLACK_S


def check(ws: Workspace, argv: list[str]) -> int:
    """Run one example; assert the property; return its exit code."""
    before = ws.digest()
    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:   # argparse: --help and usage errors
            code = exc.code if isinstance(exc.code, int) else 2
    elapsed = time.perf_counter() - start
    text = err.getvalue()
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("search [")]
    assert code in (0, 1, 2), f"{argv}: exit {code}"
    assert "Traceback" not in text, f"{argv}: {text}"
    if code != 0:
        assert len(lines) == 1, f"{argv}: exit {code} with {len(lines)} stderr lines:\n{text}"
    assert elapsed <= time_bound_s(argv), f"{argv}: {elapsed:.1f} s"
    after = ws.digest()   # new files are allowed (calibrate writes beside its profile by default)
    assert all(after.get(path) == digest for path, digest in before.items()), f"{argv}: changed an input file"
    return code


def write_input(ws: Workspace, name: str, content: str | bytes) -> Path:
    """A mutated input, written where outputs go (inputs stay as they were)."""
    path = ws.outputs / "mutated" / name
    path.parent.mkdir(exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path
