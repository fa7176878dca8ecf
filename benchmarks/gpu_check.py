"""The closed loop on one GPU: profile the device, run single-GPU plans of a Llama-style model
sized to it, and compare predicted with measured step time and peak memory.

    python benchmarks/gpu_check.py [--out runs/gpu-check] [--steps 5] [--quick]
                                   [--profile PROFILE | --skip-profile] [--plans A,B] [--budget-s 900]
    python benchmarks/gpu_check.py --replay RESULTS [--profile PROFILE]

1. `planner profile --out OUT/gpu.toml --nproc 1` (the profiler's CUDA path: GEMM and memory
   curves, attention, probes on one device; no collectives without a peer).
2. A Llama-style model with GQA sized to the device's memory (MODEL; 8 layers below 60 GB),
   bf16, every combination of micro-batch 1/2/4, recompute none/selective/full and sequence
   2k/4k (--quick: micro-batch 1/4, recompute none/full, sequence 2k): `planner predict`, and
   `planner run` for the plans predicted to fit.
3. OUT/gpu_check.json (rewritten after every plan, so an interrupted check keeps what it ran)
   and a table: step time, peak allocated (`torch.cuda.max_memory_allocated`) and reserved
   (`max_memory_reserved`) memory, measured against predicted.
--replay RESULTS needs no GPU: it prices an earlier check's runs with the current cost model (the
profile's stored probes fitted again), so a change of the model is judged on what a GPU measured;
benchmarks/results/gpu-check-h100-* holds an H100 check's runs (its profiles are in run1/ and
run2/: pass --profile RESULTS/run2/gpu.toml).
--profile prices the plans with a profile you have (a datasheet's, or an earlier measurement)
instead of measuring one; --budget-s: no plan is started after that many seconds (the plans
left are listed as skipped). Needs CUDA; without it, it says so and exits 2 (tests skip it).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
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


def planner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True)


def predict_in_process(*args: str) -> subprocess.CompletedProcess:
    """`planner predict ...` without a new interpreter (CUDA's torch takes seconds to import)."""
    from planner.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["predict", *args])
    return subprocess.CompletedProcess(["planner", "predict", *args], code, out.getvalue(), err.getvalue())


def matrix(quick: bool) -> list[tuple[int, str, int]]:
    mbs, recompute, seq = ((1, 4), ("none", "full"), (2048,)) if quick else \
        ((1, 2, 4), ("none", "selective", "full"), (2048, 4096))
    return list(itertools.product(mbs, recompute, seq))


def plan_name(mbs: int, recompute: str, seq: int) -> str:
    return f"mbs{mbs}_{recompute}_s{seq}"


def check(out: Path, profile: Path, config: Path, steps: int, quick: bool,
          deadline: float = float("inf"), save=lambda rows: None, only: set[str] | None = None) -> list[dict]:
    rows = []
    for mbs, recompute, seq in matrix(quick):
        name = plan_name(mbs, recompute, seq)
        if only is not None and name not in only:
            continue
        if time.perf_counter() > deadline:
            rows.append({"plan": name, "skipped": "--budget-s spent before it started"})
            save(rows)
            continue
        plan, run_dir = out / name / "plan.json", out / name
        plan.unlink(missing_ok=True)
        pred = predict_in_process("--model", str(config), "--cluster", f"1x1x{profile}", "--dtype", "bf16",
                       "--seq-len", str(seq), "--global-batch", str(4 * mbs), "--mbs", str(mbs),
                       "--recompute", recompute, "--out", str(plan), "--overwrite", "--json")
        row = {"plan": name, "predicted_fits": pred.returncode == 0}
        if pred.returncode != 0:
            row["refusal"] = pred.stderr.strip().splitlines()[-1] if pred.stderr.strip() else "refused"
            rows.append(row)
            save(rows)
            print(f"{name}: predicted not to fit ({row['refusal']})", file=sys.stderr)
            continue
        print(f"{name}: running", file=sys.stderr, flush=True)
        ran = planner("run", str(plan), "--steps", str(steps), "--warmup", "2", "--out", str(run_dir), "--overwrite", "--json")
        if ran.returncode != 0:
            row["run_error"] = ran.stderr.strip().splitlines()[-1] if ran.stderr.strip() else "failed"
            (run_dir / "run.stderr").write_text(ran.stderr)
            print(f"{name}: the run failed: {row['run_error']}", file=sys.stderr)
            rows.append(row)
            save(rows)
            continue
        m = MeasuredRun.load(run_dir / "measured.json")
        row |= {"predicted_step_s": m.predicted["step_time_s"], "measured_step_s": m.step_time_s,
                "predicted_peak_bytes": m.predicted_memory_compared_bytes[0],
                "measured_allocated_bytes": m.peak_memory_bytes[0],
                "measured_reserved_bytes": (m.peak_reserved_bytes or [None])[0]}
        rows.append(row)
        save(rows)
        print(f"{name}: {1e3 * row['predicted_step_s']:.1f} ms predicted, {1e3 * row['measured_step_s']:.1f} ms "
              f"measured; {row['predicted_peak_bytes'] / GIB:.2f} GiB predicted, "
              f"{row['measured_allocated_bytes'] / GIB:.2f} GiB allocated", file=sys.stderr, flush=True)
    return rows


def replay(results: Path, profile: Path) -> list[dict]:
    """The runs under `results` (any depth: DIR/.../plan.json with its measured.json) priced by the
    current cost model with `profile`'s stored probes fitted again (planner.measure.probes.refit_stored):
    no GPU needed, so a change of the model is checked against what a GPU measured."""
    from planner.measure import probes
    from planner.measure.calibrate import load_run, predict_with
    from runtime.measure import predicted_tensor_peaks_bytes
    device, _, _, after, used, stored = probes.refit_stored(profile)
    print(f"{profile}: {used} of {stored} stored probes fitted again ({after['mape_pct']:.1f}% MAPE on them)",
          file=sys.stderr)
    rows = []
    for measured in sorted(results.rglob("measured.json")):
        run = load_run(measured.parent, device=profile)   # the runs name the GPU machine's own path
        est = predict_with(run, device)
        rows.append({"plan": str(measured.parent.relative_to(results)), "predicted_step_s": est.step_time_s,
                     "measured_step_s": run.measured_step_s,
                     "predicted_peak_bytes": predicted_tensor_peaks_bytes(est)[0],
                     "measured_allocated_bytes": run.measured.peak_memory_bytes[0],
                     "measured_reserved_bytes": (run.measured.peak_reserved_bytes or [None])[0]})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'plan':<28}{'pred ms':>10}{'meas ms':>10}{'err %':>8}{'pred GiB':>10}{'alloc GiB':>11}"
          f"{'resv GiB':>10}{'err %':>8}")
    errors, mem_errors = [], []
    for r in rows:
        if "measured_step_s" not in r:
            print(f"{r['plan']:<28}  {r.get('refusal') or r.get('run_error') or r.get('skipped')}")
            continue
        e = 100 * (r["predicted_step_s"] / r["measured_step_s"] - 1)
        me = 100 * (r["predicted_peak_bytes"] / r["measured_allocated_bytes"] - 1)
        errors.append(e)
        mem_errors.append(me)
        resv = r["measured_reserved_bytes"]
        print(f"{r['plan']:<28}{1e3 * r['predicted_step_s']:>10.1f}{1e3 * r['measured_step_s']:>10.1f}{e:>+8.1f}"
              f"{r['predicted_peak_bytes'] / GIB:>10.2f}{r['measured_allocated_bytes'] / GIB:>11.2f}"
              f"{(resv or 0) / GIB:>10.2f}{me:>+8.1f}")
    if errors:
        print(f"step time: MAPE {statistics.mean(map(abs, errors)):.1f}%  max {max(map(abs, errors)):.1f}%; "
              f"peak memory (vs allocated): MAPE {statistics.mean(map(abs, mem_errors)):.1f}%  "
              f"max {max(map(abs, mem_errors)):.1f}%  ({len(errors)} plans run)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-check"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--profile", type=Path, help="price the plans with this profile instead of measuring one")
    which.add_argument("--skip-profile", action="store_true", help="reuse OUT/gpu.toml from an earlier check")
    parser.add_argument("--plans", help="only these plans of the matrix, comma-separated (e.g. mbs4_full_s2048)")
    parser.add_argument("--budget-s", type=float, default=900.0,
                        help="start no plan after this many seconds (default 900)")
    parser.add_argument("--replay", type=Path, metavar="RESULTS",
                        help="no GPU: price the runs under RESULTS (an earlier check's OUT) with the current cost "
                        "model and --profile (default RESULTS/gpu.toml), its probes fitted again")
    args = parser.parse_args()
    if args.replay:
        rows = replay(args.replay, args.profile or args.replay / "gpu.toml")
        print_table(rows)
        print(f"command: python benchmarks/gpu_check.py {' '.join(sys.argv[1:])}")
        return 0
    names = {plan_name(*p) for p in matrix(args.quick)}
    only = set(args.plans.split(",")) if args.plans else names
    if only - names:
        parser.error(f"--plans: {', '.join(sorted(only - names))} not in the matrix ({', '.join(sorted(names))})")
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check", file=sys.stderr)
        return 2
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    profile = args.profile or args.out / "gpu.toml"
    if args.profile is None and not args.skip_profile:
        done = planner("profile", "--out", str(profile), "--nproc", "1", "--overwrite")
        print(done.stdout + done.stderr, file=sys.stderr)
        if done.returncode != 0:
            return done.returncode
    config = args.out / "model" / "config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(model_config(torch.cuda.get_device_properties(0).total_memory), indent=2))
    header = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "profile": str(profile), "command": " ".join(["python", *sys.argv])}

    def save(rows: list[dict]) -> None:
        (args.out / "gpu_check.json").write_text(json.dumps({**header, "rows": rows}, indent=2))
    rows = check(args.out, profile, config, args.steps, args.quick, start + args.budget_s, save, only)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, profile {profile}")
    print_table(rows)
    print(f"{time.perf_counter() - start:.0f} s; command: python benchmarks/gpu_check.py {' '.join(sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
