"""The closed loop on one GPU: profile the device, run single-GPU plans of a Llama-style model
sized to it, and compare predicted with measured step time and peak memory.

    python benchmarks/gpu_check.py [--out runs/gpu-check] [--steps 5] [--quick] [--skip-profile]

1. `planner profile --out OUT/gpu.toml --nproc 1` (the profiler's CUDA path: GEMM and memory
   curves, attention, probes on one device; no collectives without a peer).
2. A Llama-style model with GQA sized to the device's memory (MODEL; 8 layers below 60 GB),
   bf16, every combination of micro-batch 1/2/4, recompute none/selective/full and sequence
   2k/4k (--quick: micro-batch 1/4, recompute none/full, sequence 2k): `planner predict`, and
   `planner run` for the plans predicted to fit.
3. OUT/gpu_check.json and a table: step time, peak allocated (`torch.cuda.max_memory_allocated`)
   and reserved (`max_memory_reserved`) memory, measured against predicted.
Needs CUDA; without it, it says so and exits 2 (tests skip it).
"""
from __future__ import annotations

import argparse
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


def matrix(quick: bool) -> list[tuple[int, str, int]]:
    mbs, recompute, seq = ((1, 4), ("none", "full"), (2048,)) if quick else \
        ((1, 2, 4), ("none", "selective", "full"), (2048, 4096))
    return list(itertools.product(mbs, recompute, seq))


def check(out: Path, profile: Path, config: Path, steps: int, quick: bool) -> list[dict]:
    rows = []
    for mbs, recompute, seq in matrix(quick):
        name = f"mbs{mbs}_{recompute}_s{seq}"
        plan, run_dir = out / name / "plan.json", out / name
        plan.unlink(missing_ok=True)
        pred = planner("predict", "--model", str(config), "--cluster", f"1x1x{profile}", "--dtype", "bf16",
                       "--seq-len", str(seq), "--global-batch", str(4 * mbs), "--mbs", str(mbs),
                       "--recompute", recompute, "--out", str(plan), "--overwrite", "--json")
        row = {"plan": name, "predicted_fits": pred.returncode == 0}
        if pred.returncode != 0:
            row["refusal"] = pred.stderr.strip().splitlines()[-1] if pred.stderr.strip() else "refused"
            rows.append(row)
            print(f"{name}: predicted not to fit ({row['refusal']})", file=sys.stderr)
            continue
        print(f"{name}: running", file=sys.stderr, flush=True)
        ran = planner("run", str(plan), "--steps", str(steps), "--warmup", "2", "--out", str(run_dir), "--overwrite", "--json")
        if ran.returncode != 0:
            row["run_error"] = ran.stderr.strip().splitlines()[-1] if ran.stderr.strip() else "failed"
            rows.append(row)
            continue
        m = MeasuredRun.load(run_dir / "measured.json")
        row |= {"predicted_step_s": m.predicted["step_time_s"], "measured_step_s": m.step_time_s,
                "predicted_peak_bytes": m.predicted_memory_compared_bytes[0],
                "measured_allocated_bytes": m.peak_memory_bytes[0],
                "measured_reserved_bytes": (m.peak_reserved_bytes or [None])[0]}
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'plan':<24}{'pred ms':>10}{'meas ms':>10}{'err %':>8}{'pred GiB':>10}{'alloc GiB':>11}"
          f"{'resv GiB':>10}{'err %':>8}")
    errors, mem_errors = [], []
    for r in rows:
        if "measured_step_s" not in r:
            print(f"{r['plan']:<24}  {r.get('refusal') or r.get('run_error')}")
            continue
        e = 100 * (r["predicted_step_s"] / r["measured_step_s"] - 1)
        me = 100 * (r["predicted_peak_bytes"] / r["measured_allocated_bytes"] - 1)
        errors.append(e)
        mem_errors.append(me)
        resv = r["measured_reserved_bytes"]
        print(f"{r['plan']:<24}{1e3 * r['predicted_step_s']:>10.1f}{1e3 * r['measured_step_s']:>10.1f}{e:>+8.1f}"
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
    parser.add_argument("--skip-profile", action="store_true")
    args = parser.parse_args()
    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check", file=sys.stderr)
        return 2
    start = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    profile = args.out / "gpu.toml"
    if not args.skip_profile:
        done = planner("profile", "--out", str(profile), "--nproc", "1", "--overwrite")
        print(done.stdout + done.stderr.splitlines()[-1] if done.stderr else done.stdout, file=sys.stderr)
        if done.returncode != 0:
            return done.returncode
    config = args.out / "model" / "config.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(model_config(torch.cuda.get_device_properties(0).total_memory), indent=2))
    rows = check(args.out, profile, config, args.steps, args.quick)
    (args.out / "gpu_check.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                        "date": time.strftime("%Y-%m-%d"),
                                                        "command": " ".join(["python", *sys.argv]),
                                                        "rows": rows}, indent=2))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print_table(rows)
    print(f"{time.perf_counter() - start:.0f} s; command: python benchmarks/gpu_check.py {' '.join(sys.argv[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
