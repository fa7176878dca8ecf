"""Can a reference kernel timed beside a run tell how fast the run's steps will go? If it could,
`planner run` would time it before its steps and say how far the machine is from its profile
(the profile sees the machine at one moment; a shared 2-core machine's runs of one plan move by
5-7 % from run to run: benchmarks/closed_loop_noise.py).

    python benchmarks/speed_reference.py DIR [--minutes 9] [--window-s 0.6] [--out rows.json]
    python benchmarks/speed_reference.py --rows rows.json        # the figures again, nothing run

DIR: a closed-loop output (benchmarks/closed_loop.py --out DIR). Its plans run in turn with
`planner run` (4 steps after 2 warm-up) until the time is up; before and after each run, one
process (with the profile's threads per rank) times a GEMM (512 x 384 x 1024, fp32) and an
elementwise add (1M fp32) each for --window-s seconds, the median call kept. Prints the runs'
scatter (the standard deviation of log step time less its plan's mean), and for each reference
(before, after, both) its correlation with that scatter and what is left of it after dividing
the step by the reference (slope 1) and by the best power of it (the least-squares slope): a
reference that tracked the steps would shrink the scatter.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KINDS = ("gemm_fp32", "add_fp32")


def reference_s(window_s: float) -> dict[str, float]:
    """The median call of each reference kernel over a window of `window_s` seconds."""
    import torch
    a, b = torch.randn(512, 384), torch.randn(384, 1024)
    x, y = torch.randn(1 << 20), torch.randn(1 << 20)
    calls = {"gemm_fp32": lambda: a @ b, "add_fp32": lambda: x + y}
    out = {}
    for kind, fn in calls.items():
        fn()
        times, end = [], time.perf_counter() + window_s
        while time.perf_counter() < end:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        out[kind] = statistics.median(times)
    return out


def run_rows(out: Path, minutes: float, window_s: float, rows_path: Path | None) -> list[dict]:
    import torch
    from closed_loop import MATRIX   # beside this file: run as a script
    from costmodel.plan import PlanFile
    names = [name for name, *_ in MATRIX if (out / name / "plan.json").exists()]
    if not names:
        sys.exit(f"speed_reference: no plan.json under {out}/<plan>: give a benchmarks/closed_loop.py --out directory")
    threads = PlanFile.load(out / names[0] / "plan.json").cluster.device.threads_per_rank or 1
    torch.set_num_threads(threads)
    rows, deadline = [], time.time() + 60 * minutes
    with tempfile.TemporaryDirectory() as tmp:
        i = 0
        while time.time() < deadline:
            name = names[i % len(names)]
            i += 1
            before = reference_s(window_s)
            subprocess.run([sys.executable, "-m", "planner", "run", str(out / name / "plan.json"), "--steps", "4",
                            "--warmup", "2", "--out", f"{tmp}/{name}", "--overwrite"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            after = reference_s(window_s)
            step_s = json.loads(Path(f"{tmp}/{name}/measured.json").read_text())["step_time_s"]
            rows.append({"plan": name, "step_s": step_s, "before": before, "after": after})
            print(f"[{len(rows)}] {name}: step {1e3 * step_s:.0f} ms, reference before "
                  + ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in before.items()), file=sys.stderr, flush=True)
            if rows_path:
                rows_path.write_text(json.dumps(rows, indent=1))
    return rows


def _less_plan_mean(rows: list[dict], values: list[float]) -> list[float]:
    means = {p: statistics.mean(v for r, v in zip(rows, values) if r["plan"] == p) for p in {r["plan"] for r in rows}}
    return [v - means[r["plan"]] for r, v in zip(rows, values)]


def tracking(rows: list[dict], kind: str, which: str) -> tuple[float, float, float, float]:
    """(correlation, slope, scatter left after dividing by the reference, after its best power)
    of the log step times less their plan's mean against the log reference (`which`: before,
    after, or both: their geometric mean) less its own."""
    ref = [0.5 * (math.log(r["before"][kind]) + math.log(r["after"][kind])) if which == "both"
           else math.log(r[which][kind]) for r in rows]
    step = _less_plan_mean(rows, [math.log(r["step_s"]) for r in rows])
    ref = _less_plan_mean(rows, ref)
    corr = statistics.correlation(step, ref)
    slope = corr * statistics.pstdev(step) / statistics.pstdev(ref)
    return (corr, slope, statistics.pstdev([s - f for s, f in zip(step, ref)]),
            statistics.pstdev([s - slope * f for s, f in zip(step, ref)]))


def report(rows: list[dict]) -> None:
    if len(rows) < 2 * len({r["plan"] for r in rows}):
        sys.exit(f"speed_reference: {len(rows)} runs; each plan needs two at least (give more --minutes)")
    scatter = statistics.pstdev(_less_plan_mean(rows, [math.log(r["step_s"]) for r in rows]))
    print(f"{len(rows)} runs of {len({r['plan'] for r in rows})} plans: log step time less its plan's mean, "
          f"standard deviation {100 * scatter:.1f} %")
    print(f"{'reference':10s} {'timed':7s} {'corr':>6s} {'slope':>6s} {'left / ref':>11s} {'left / ref^slope':>17s}")
    for kind in KINDS:
        for which in ("before", "after", "both"):
            corr, slope, left1, left = tracking(rows, kind, which)
            print(f"{kind:10s} {which:7s} {corr:+6.2f} {slope:6.2f} {100 * left1:10.1f}% {100 * left:16.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", type=Path, help="a benchmarks/closed_loop.py --out directory")
    parser.add_argument("--minutes", type=float, default=9.0, help="how long to keep running plans (default 9)")
    parser.add_argument("--window-s", type=float, default=0.6, help="each reference kernel's window (default 0.6 s)")
    parser.add_argument("--out", type=Path, help="write the rows (step times and references) here as JSON")
    parser.add_argument("--rows", type=Path, help="report on rows written by --out; runs nothing")
    args = parser.parse_args()
    if (args.dir is None) == (args.rows is None):
        parser.error("give a closed-loop DIR to run, or --rows FILE to report on")
    if args.rows:
        rows = json.loads(args.rows.read_text())
    else:
        if args.out and args.out.exists():
            parser.error(f"--out {args.out} exists; give a new file")
        rows = run_rows(args.dir, args.minutes, args.window_s, args.out)
    report(rows)


if __name__ == "__main__":
    main()
