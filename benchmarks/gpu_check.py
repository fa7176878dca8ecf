"""The closed loop on one GPU: profile the device, run single-GPU plans of a Llama-style model
sized to it, eager and compiled (`planner run --compile`), and compare predicted with measured
step time and peak memory.

    python benchmarks/gpu_check.py [--out DIR] [--steps 5] [--quick] [--modes eager,compiled]
                                   [--profile PROFILE | --skip-profile] [--plans A,B] [--budget-s 480]
    python benchmarks/gpu_check.py --replay RESULTS [--profile PROFILE]

1. `planner profile --out OUT/gpu.toml --nproc 1` (the profiler's CUDA path: GEMM and memory
   curves, attention, probes on one device; no collectives without a peer).
2. A Llama-style model with GQA sized to the device's memory (MODEL; 8 layers below 60 GB),
   bf16, every combination of micro-batch 1/2/4, recompute none/selective/full and sequence
   2k/4k (--quick: micro-batch 1/4, recompute none/full, sequence 2k): `planner predict`, and
   `planner run` for the plans predicted to fit.
   Each plan runs eager, then compiled (each run priced as it runs: costmodel.frameworks
   `compiled_layer` for the compiled one), so a budget that ends early still holds pairs.
3. OUT/gpu_check.json (rewritten after every run, so an interrupted check keeps what it ran)
   and a table: step time, peak allocated (`torch.cuda.max_memory_allocated`) and reserved
   (`max_memory_reserved`) memory, measured against predicted, and each plan's compiled step
   against its eager one. OUT defaults to benchmarks/results/gpu-check-<device>-<date>.
--budget-s bounds the whole call (a lent GPU's minutes in one command): the profile and every
run get the time left, a run still going at the end is stopped (SIGTERM: planner run keeps its
timed steps as an incomplete measured.json, which the row reads), and no run starts after it.
Without CUDA the same check runs on this CPU with a tiny model (CPU_MODEL, sequence 128) priced
by the shipped profiles/xeon-amx.toml unless --profile names another (no profiling: a CPU
profile takes longer than the check).
--replay RESULTS needs no GPU: it prices an earlier check's runs with the current cost model (the
profile's stored probes fitted again), so a change of the model is judged on what a GPU measured;
benchmarks/results/gpu-check-h100-* holds an H100 check's runs (its profiles are in run1/ and
run2/: pass --profile RESULTS/run2/gpu.toml).
--profile prices the plans with a profile you have (a datasheet's, or an earlier measurement)
instead of measuring one.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from costmodel.measured import MeasuredRun
from costmodel.units import GIB


def model_config(memory_bytes: int) -> dict:
    """0.85B parameters (16 layers of hidden 2048, costmodel.params.total_params) from 60 GB,
    0.49B (8 layers) below."""
    layers = 16 if memory_bytes >= 60 * GIB else 8
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
            "intermediate_size": 5632, "num_hidden_layers": layers, "num_attention_heads": 16,
            "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


# the CPU check's model: two Llama-style layers with GQA, small enough to compile and run in seconds
CPU_MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
             "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 512, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
CPU_PROFILE = Path(__file__).resolve().parents[1] / "profiles" / "xeon-amx.toml"
MODES = ("eager", "compiled")
STOP_GRACE_S = 30.0   # a stopped run's time to keep what it measured before it is killed


class OutOfBudget(Exception):
    pass


def planner(*args: str, timeout_s: float | None = None) -> subprocess.CompletedProcess:
    """`planner ARGS` in a new interpreter; past `timeout_s` it is sent SIGTERM (it stops its ranks
    and keeps what it measured), then killed, and OutOfBudget carries what it printed."""
    proc = subprocess.Popen([sys.executable, "-m", "planner", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise OutOfBudget(err) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def predict_in_process(*args: str) -> subprocess.CompletedProcess:
    """`planner predict ...` without a new interpreter (CUDA's torch takes seconds to import)."""
    from planner.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["predict", *args])
    return subprocess.CompletedProcess(["planner", "predict", *args], code, out.getvalue(), err.getvalue())


def matrix(quick: bool, cpu: bool = False) -> list[tuple[int, str, int]]:
    mbs, recompute, seq = ((1, 4), ("none", "full"), (2048,)) if quick else \
        ((1, 2, 4), ("none", "selective", "full"), (2048, 4096))
    if cpu:   # the tiny model: its steps take milliseconds, its compiles the time
        mbs, recompute, seq = ((1, 4), ("none", "full"), (128,))
    return list(itertools.product(mbs, recompute, seq))


def plan_name(mbs: int, recompute: str, seq: int) -> str:
    return f"mbs{mbs}_{recompute}_s{seq}"


def check(out: Path, profile: Path, config: Path, steps: int, quick: bool,
          deadline: float = float("inf"), save=lambda rows: None, only: set[str] | None = None,
          modes: tuple[str, ...] = MODES, cpu: bool = False) -> list[dict]:
    """Every plan of the matrix predicted, and run in each mode while the budget lasts."""
    rows = []
    for mbs, recompute, seq in matrix(quick, cpu):
        name = plan_name(mbs, recompute, seq)
        if only is not None and name not in only:
            continue
        plan = out / name / "plan.json"
        plan.unlink(missing_ok=True)
        pred = predict_in_process("--model", str(config), "--cluster", f"1x1x{profile}",
                                  "--dtype", "fp32" if cpu else "bf16", "--seq-len", str(seq),
                                  "--global-batch", str(4 * mbs), "--mbs", str(mbs), "--recompute", recompute,
                                  "--out", str(plan), "--overwrite", "--json")
        if pred.returncode != 0:
            refusal = pred.stderr.strip().splitlines()[-1] if pred.stderr.strip() else "refused"
            rows.append({"plan": name, "predicted_fits": False, "refusal": refusal})
            save(rows)
            print(f"{name}: predicted not to fit ({refusal})", file=sys.stderr)
            continue
        for mode in modes:
            rows.append(run_row(name, mode, plan, out / name / mode, steps, deadline))
            save(rows)
    return rows


def run_row(name: str, mode: str, plan: Path, run_dir: Path, steps: int, deadline: float) -> dict:
    """One `planner run` of the plan (`--compile` in the compiled mode) in the time left."""
    row = {"plan": name, "mode": mode, "predicted_fits": True}
    left_s = deadline - time.perf_counter()
    if left_s <= 0:
        return row | {"skipped": "--budget-s spent before it started"}
    print(f"{name} {mode}: running", file=sys.stderr, flush=True)
    try:
        ran = planner("run", str(plan), "--steps", str(steps), "--warmup", "2", "--out", str(run_dir), "--overwrite",
                      "--json", *(["--compile"] if mode == "compiled" else []), timeout_s=left_s)
    except OutOfBudget:
        row["stopped"] = "--budget-s spent while it ran"
    else:
        if ran.returncode != 0:
            row["run_error"] = ran.stderr.strip().splitlines()[-1] if ran.stderr.strip() else "failed"
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "run.stderr").write_text(ran.stderr)
            print(f"{name} {mode}: the run failed: {row['run_error']}", file=sys.stderr)
            return row
    if not (run_dir / "measured.json").exists():
        return row
    m = MeasuredRun.load(run_dir / "measured.json")
    row |= {"predicted_step_s": m.predicted["step_time_s"], "measured_step_s": m.step_time_s, "mfu": m.mfu,
            "predicted_peak_bytes": m.predicted_memory_compared_bytes[0],
            "measured_allocated_bytes": (m.peak_memory_bytes or [None])[0],
            "measured_reserved_bytes": (m.peak_reserved_bytes or [None])[0], "complete": m.complete}
    print(f"{name} {mode}: {1e3 * row['predicted_step_s']:.1f} ms predicted, {1e3 * row['measured_step_s']:.1f} ms "
          f"measured, MFU {100 * m.mfu:.1f}%", file=sys.stderr, flush=True)
    return row


def replay(results: Path, profile: Path) -> list[dict]:
    """The runs under `results` (any depth: DIR/.../plan.json with its measured.json) priced by the
    current cost model with `profile`'s stored probes fitted again (planner.measure.probes.refit_stored):
    no GPU needed, so a change of the model is checked against what a GPU measured."""
    from planner.measure import probes
    from planner.measure.run_dirs import load_run, predict_with
    from runtime.measure import predicted_tensor_peaks_bytes
    device, _, _, after, used, stored = probes.refit_stored(profile)
    print(f"{profile}: {used} of {stored} stored probes fitted again ({after['mape_pct']:.1f}% MAPE on them)",
          file=sys.stderr)
    rows = []
    for measured in sorted(results.rglob("measured.json")):
        run = load_run(measured.parent, device=profile)   # the runs name the GPU machine's own path
        est = predict_with(run, device)
        where = measured.parent.relative_to(results)   # PLAN/MODE as the check writes it, or a plan's own folder
        mode = "compiled" if run.compiled else "eager"
        rows.append({"plan": str(where.parent if where.name == mode else where), "mode": mode,
                     "predicted_step_s": est.step_time_s,
                     "measured_step_s": run.measured_step_s, "mfu": run.measured.mfu,
                     "predicted_peak_bytes": predicted_tensor_peaks_bytes(est)[0],
                     "measured_allocated_bytes": run.measured.peak_memory_bytes[0],
                     "measured_reserved_bytes": (run.measured.peak_reserved_bytes or [None])[0]})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'plan':<28}{'mode':<10}{'pred ms':>10}{'meas ms':>10}{'err %':>8}{'pred GiB':>10}{'alloc GiB':>11}"
          f"{'resv GiB':>10}{'err %':>8}")
    errors, mem_errors = [], []
    for r in rows:
        mode = r.get("mode", "eager")
        if "measured_step_s" not in r:
            print(f"{r['plan']:<28}{mode:<10}  {r.get('refusal') or r.get('run_error') or r.get('skipped') or r.get('stopped')}")
            continue
        e = 100 * (r["predicted_step_s"] / r["measured_step_s"] - 1)
        errors.append(e)
        alloc, resv = r["measured_allocated_bytes"], r["measured_reserved_bytes"]
        me = None if not alloc else 100 * (r["predicted_peak_bytes"] / alloc - 1)
        mem_errors += [] if me is None else [me]
        print(f"{r['plan']:<28}{mode:<10}{1e3 * r['predicted_step_s']:>10.1f}{1e3 * r['measured_step_s']:>10.1f}"
              f"{e:>+8.1f}{r['predicted_peak_bytes'] / GIB:>10.2f}{(alloc or 0) / GIB:>11.2f}{(resv or 0) / GIB:>10.2f}"
              + (f"{me:>+8.1f}" if me is not None else f"{'-':>8}"))
    if errors:
        print(f"step time: MAPE {statistics.mean(map(abs, errors)):.1f}%  max {max(map(abs, errors)):.1f}% "
              f"({len(errors)} runs)" + (f"; peak memory (vs allocated): MAPE {statistics.mean(map(abs, mem_errors)):.1f}%"
                                         f"  max {max(map(abs, mem_errors)):.1f}%" if mem_errors else ""))
    for plan, eager, compiled in compile_pairs(rows):
        print(f"{plan}: compiled step {compiled['measured_step_s'] / eager['measured_step_s']:.2f}x eager's "
              f"(predicted {compiled['predicted_step_s'] / eager['predicted_step_s']:.2f}x); "
              f"MFU {100 * eager['mfu']:.1f}% -> {100 * compiled['mfu']:.1f}%")


def compile_pairs(rows: list[dict]) -> list[tuple[str, dict, dict]]:
    """(plan, eager row, compiled row) for every plan measured both ways."""
    ran = {(r["plan"], r.get("mode")): r for r in rows if "measured_step_s" in r}
    return [(plan, r, ran[plan, "compiled"]) for (plan, mode), r in ran.items()
            if mode == "eager" and (plan, "compiled") in ran]


def default_out(cpu: bool) -> Path:
    """benchmarks/results/gpu-check-<device>-<date>: where a lent GPU's figures are kept."""
    import torch
    name = "cpu" if cpu else torch.cuda.get_device_name().split()[-1].lower()
    slug = "".join(c if c.isalnum() else "-" for c in name).strip("-")
    return Path(__file__).resolve().parent / "results" / f"gpu-check-{slug}-{time.strftime('%Y-%m-%d')}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="default benchmarks/results/gpu-check-<device>-<date>")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--modes", default=",".join(MODES), help="eager, compiled or both (default both)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--profile", type=Path, help="price the plans with this profile instead of measuring one")
    which.add_argument("--skip-profile", action="store_true", help="reuse OUT/gpu.toml from an earlier check")
    parser.add_argument("--plans", help="only these plans of the matrix, comma-separated (e.g. mbs4_full_s2048)")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="the whole check's seconds: runs still going then are stopped, none starts after (default 480)")
    parser.add_argument("--replay", type=Path, metavar="RESULTS",
                        help="no GPU: price the runs under RESULTS (an earlier check's OUT) with the current cost "
                        "model and --profile (default RESULTS/gpu.toml), its probes fitted again")
    args = parser.parse_args()
    if args.replay:
        rows = replay(args.replay, args.profile or args.replay / "gpu.toml")
        print_table(rows)
        print(f"command: python benchmarks/gpu_check.py {' '.join(sys.argv[1:])}")
        return 0
    modes = tuple(args.modes.split(","))
    if set(modes) - set(MODES) or not modes:
        parser.error(f"--modes: {args.modes} is not a choice of {', '.join(MODES)}")
    import torch
    cpu = not torch.cuda.is_available()
    names = {plan_name(*p) for p in matrix(args.quick, cpu)}
    only = set(args.plans.split(",")) if args.plans else names
    if only - names:
        parser.error(f"--plans: {', '.join(sorted(only - names))} not in the matrix ({', '.join(sorted(names))})")
    return run_check(args, modes, only, cpu)


def run_check(args: argparse.Namespace, modes: tuple[str, ...], only: set[str], cpu: bool) -> int:
    import torch
    start = time.perf_counter()
    out = args.out or default_out(cpu)
    out.mkdir(parents=True, exist_ok=True)
    profile = args.profile or (CPU_PROFILE if cpu else out / "gpu.toml")
    if args.profile is None and not args.skip_profile and not cpu:
        try:
            done = planner("profile", "--out", str(profile), "--nproc", "1", "--overwrite", timeout_s=args.budget_s)
        except OutOfBudget:
            print(f"gpu_check: --budget-s {args.budget_s:.0f} spent profiling the device", file=sys.stderr)
            return 1
        print(done.stdout + done.stderr, file=sys.stderr)
        if done.returncode != 0:
            return done.returncode
    config = out / "model" / "config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    model = CPU_MODEL if cpu else model_config(torch.cuda.get_device_properties(0).total_memory)
    config.write_text(json.dumps(model, indent=2))
    device = "cpu" if cpu else torch.cuda.get_device_name()
    header = {"device": device, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "profile": str(profile),
              "budget_s": args.budget_s, "command": " ".join(["python", *sys.argv]), "cpus": os.cpu_count()}

    def save(rows: list[dict]) -> None:
        (out / "gpu_check.json").write_text(json.dumps({**header, "rows": rows}, indent=2))
    rows = check(out, profile, config, args.steps, args.quick, start + args.budget_s, save, only, modes, cpu)
    print(f"{device}, torch {torch.__version__}, profile {profile}, results in {out}")
    print_table(rows)
    print(f"{time.perf_counter() - start:.0f} s; command: python benchmarks/gpu_check.py {' '.join(sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
