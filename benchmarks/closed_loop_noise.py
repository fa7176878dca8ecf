"""How much of a closed loop's error is the measurement's own: over stored runs of
benchmarks/closed_loop.py (their first passes), each plan's log step time less its run's mean
and its plan's mean, and the scatter of the steps within one run.

    python benchmarks/closed_loop_noise.py DIR [DIR ...]     # DIRs written by closed_loop.py --out

Prints the residual's standard deviation (overall and per plan) and mean absolute value, the
within-run scatter of one step (the median over every run of the standard deviation of its log
step times), and each DIR's mean against the mean of all (the machine's speed from run to run).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from closed_loop import MATRIX
from planner.calibrate import load_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="output directories of benchmarks/closed_loop.py")
    args = parser.parse_args()
    if len(args.dirs) < 2:
        parser.error("give at least two closed-loop directories: the residual needs each plan measured twice")
    names = [name for name, *_ in MATRIX]
    runs = [[load_run(d / name) for name in names] for d in args.dirs]
    logs = np.log([[r.measured_step_s for r in row] for row in runs])
    residual = logs - logs.mean(1, keepdims=True) - logs.mean(0, keepdims=True) + logs.mean()
    dof = (len(args.dirs) - 1) * (len(names) - 1)
    print(f"{len(args.dirs)} runs x {len(names)} plans: residual standard deviation "
          f"{100 * np.sqrt((residual ** 2).sum() / dof):.1f} %, mean absolute {100 * np.abs(residual).mean():.1f} %")
    print("per plan: " + ", ".join(f"{n} {100 * residual[:, i].std(ddof=1):.1f} %" for i, n in enumerate(names)))
    within = [np.log(r.measured.step_times_s).std(ddof=1) for row in runs for r in row
              if r.measured is not None and len(r.measured.step_times_s) > 1]
    print(f"one step within a run: {100 * statistics.median(within):.1f} % (median over {len(within)} runs)")
    effects = logs.mean(1) - logs.mean()
    print("each run against the mean of all: " + ", ".join(f"{d.name} {100 * e:+.0f} %" for d, e in zip(args.dirs, effects)))


if __name__ == "__main__":
    main()
