"""Closed loop on this machine: profile it, run a matrix of plans with `planner run`, and compare
predicted with measured step time (MAPE, max error, Spearman), then the same after calibration.

    python benchmarks/closed_loop.py [--out runs/closed-loop] [--steps 6] [--skip-profile] [--skip-runs]

1. `planner profile --out profiles/local.toml` (unless --skip-profile).
2. For each plan of MATRIX (debug-small / debug-tiny, 1-2 ranks, fp32): `planner predict ... --out
   plan.json`, then `planner run plan.json` (torchrun, gloo) into OUT/NAME (unless --skip-runs).
3. `planner calibrate OUT/* --profile profiles/local.toml --out profiles/local-calibrated.toml`,
   and the table again with the calibrated profile (predictions recomputed, runs reused); then
   leave-one-out: each plan predicted by a calibration on the other plans only.
4. The runtime's overhead: a plain single-process torch loop (no FSDP, no planner) of the
   1-rank plan's model and batch against `planner run`'s measured step time.
Targets (issue 6): MAPE <= 10 %, max <= 20 %, Spearman >= 0.9; runtime overhead <= 3 %.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from scipy.stats import spearmanr

# (name, model, ranks, predict flags): DP, TP, PP with two schedules, ZeRO-1/3, recompute full and
# selective, several micro-batch sizes.
MATRIX = [
    ("single_mbs4", "debug-small", 1, ["--mbs", "4"]),
    ("single_mbs1", "debug-small", 1, ["--mbs", "1"]),
    ("ddp_mbs2", "debug-small", 2, ["--zero", "0", "--mbs", "2"]),
    ("zero1_mbs4", "debug-small", 2, ["--zero", "1", "--mbs", "4"]),
    ("zero3_mbs2", "debug-small", 2, ["--zero", "3", "--mbs", "2"]),
    ("zero1_full_rc", "debug-small", 2, ["--zero", "1", "--mbs", "4", "--recompute", "full"]),
    ("tp2_sp", "debug-small", 2, ["--tp", "2", "--mbs", "4"]),
    ("tp2_selective", "debug-small", 2, ["--tp", "2", "--no-sp", "--mbs", "4", "--recompute", "selective"]),
    ("pp2_1f1b", "debug-small", 2, ["--pp", "2", "--mbs", "2"]),
    ("pp2_gpipe", "debug-small", 2, ["--pp", "2", "--mbs", "2", "--schedule", "gpipe"]),
    ("pp2_interleaved", "debug-small", 2, ["--pp", "2", "--vpp", "2", "--mbs", "2"]),
    ("tiny_ddp", "debug-tiny", 2, ["--zero", "0", "--mbs", "1"]),
]
PROFILE, CALIBRATED = Path("profiles/local.toml"), Path("profiles/local-calibrated.toml")


def planner(*args: str, quiet: bool = True) -> None:
    subprocess.run([sys.executable, "-m", "planner", *args], check=True,
                   stdout=subprocess.DEVNULL if quiet else None)


def run_matrix(out: Path, steps: int) -> None:
    for i, (name, model, ranks, flags) in enumerate(MATRIX, 1):
        print(f"[{i}/{len(MATRIX)}] {name}", file=sys.stderr, flush=True)
        plan = out / name / "plan.json"
        planner("predict", "--model", model, "--cluster", f"1x{ranks}x{PROFILE}", "--dtype", "fp32",
                *flags, "--out", str(plan), "--json")
        planner("run", str(plan), "--steps", str(steps), "--warmup", "2", "--out", str(out / name))


def table(out: Path, profile: Path) -> list[tuple[str, float, float]]:
    from costmodel.cluster import load_profile
    from planner.calibrate import load_run, predict_with
    device = load_profile(profile)
    rows = []
    for name, *_ in MATRIX:
        run = load_run(out / name)
        rows.append((name, predict_with(run, device).step_time_s, run.measured_step_s))
    return rows


def summarise(label: str, rows: list[tuple[str, float, float]]) -> None:
    errors = [100 * (p - m) / m for _, p, m in rows]
    print(f"\n{label}")
    print(f"{'plan':<18}{'predicted ms':>14}{'measured ms':>14}{'error %':>10}")
    for (name, p, m), e in zip(rows, errors):
        print(f"{name:<18}{1e3 * p:>14.1f}{1e3 * m:>14.1f}{e:>+10.1f}")
    rho = spearmanr([p for _, p, _ in rows], [m for _, _, m in rows]).statistic
    print(f"MAPE {statistics.mean(map(abs, errors)):.1f}%   max |error| {max(map(abs, errors)):.1f}%   "
          f"Spearman {rho:.3f}   ({len(rows)} plans)")


def leave_one_out(out: Path) -> list[tuple[str, float, float]]:
    """Each plan predicted by a profile calibrated on the other plans only: how well the
    calibration predicts a plan it has not seen (the in-sample table can flatter)."""
    from costmodel.cluster import load_profile
    from planner.calibrate import fit, load_run, predict_with
    base = load_profile(PROFILE)
    runs = [load_run(out / name) for name, *_ in MATRIX]
    rows = []
    for i, (name, *_) in enumerate(MATRIX):
        device, _ = fit(runs[:i] + runs[i + 1:], base)
        rows.append((name, predict_with(runs[i], device).step_time_s, runs[i].measured_step_s))
    return rows


def plain_loop_overhead(out: Path, steps: int) -> None:
    """`planner run` of the 1-rank plan against the same model trained by a bare loop."""
    import torch
    from costmodel.plan import PlanFile
    from runtime.data import TokenSource
    from runtime.job import cross_entropy
    from runtime.model import Transformer
    pf = PlanFile.load(out / "single_mbs4" / "plan.json")
    from costmodel.cluster import load_profile
    torch.set_num_threads(load_profile(PROFILE).threads_per_rank or 1)   # as `planner run` gives its rank
    model = Transformer(pf.model)
    model.init_weights(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    src = TokenSource(pf.model.vocab_size, pf.train.seq_len, 0)
    m, b = pf.plan.num_micro_batches, pf.train.global_batch_size
    times = []
    for step in range(2 + steps):
        x, y = src.batch(step * b, b)
        start = time.perf_counter()
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            (cross_entropy(model(xs), ys) / m).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= 2:
            times.append(time.perf_counter() - start)
    plain = statistics.median(times)
    measured = json.loads((out / "single_mbs4" / "measured.json").read_text())["step_time_s"]
    print(f"\nruntime overhead: plain loop {1e3 * plain:.1f} ms, planner run {1e3 * measured:.1f} ms "
          f"per step: {100 * (measured / plain - 1):+.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("runs/closed-loop"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip-profile", action="store_true")
    parser.add_argument("--skip-runs", action="store_true")
    args = parser.parse_args()
    start = time.perf_counter()
    if not args.skip_profile:
        planner("profile", "--out", str(PROFILE), quiet=False)
    if not args.skip_runs:
        run_matrix(args.out, args.steps)
    summarise(f"profile {PROFILE} (measured curves, no calibration)", table(args.out, PROFILE))
    planner("calibrate", *[str(args.out / name) for name, *_ in MATRIX], "--profile", str(PROFILE),
            "--out", str(CALIBRATED), quiet=False)
    summarise(f"calibrated profile {CALIBRATED} (fitted on all {len(MATRIX)} plans)", table(args.out, CALIBRATED))
    summarise("leave-one-out: each plan predicted by a profile calibrated on the other plans",
              leave_one_out(args.out))
    plain_loop_overhead(args.out, args.steps)
    print(f"\n{time.perf_counter() - start:.0f} s; command: python benchmarks/closed_loop.py "
          + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
