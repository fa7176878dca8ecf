"""Per-stage peak memory of every pipeline schedule, predicted against measured by `planner run`.

    python benchmarks/pipeline_memory.py [--out DIR]

The configuration of tests/runtime/test_run_cli.py::test_pipeline_schedules_hold_the_memory_the_model_says
(debug-small, fp32, sequence 512, 16 sequences in micro-batches of 2, pp2 x dp1, ZeRO-0, on 2 gloo
ranks), one warm-up step (CPU memory is tracked there) and one timed step per schedule. Prints,
per schedule and stage, the predicted and measured MiB and their ratio; about a minute.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2))
PLAN = ["--model", "debug-small", "--cluster", "1x2xxeon-amx", "--dtype", "fp32", "--seq-len", "512",
        "--global-batch", "16", "--mbs", "2", "--pp", "2", "--dp", "1", "--zero", "0"]


def _planner(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "planner", *args], check=True, capture_output=True, text=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory for the plans and runs (default: a temporary one)")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="pipeline-memory-"))
    start = time.perf_counter()
    print(f"{'schedule':<18}{'stage':>6}{'predicted MiB':>15}{'measured MiB':>14}{'pred/meas':>11}")
    for schedule, vpp in SCHEDULES:
        plan, run = out / f"{schedule}.json", out / schedule
        _planner("predict", *PLAN, "--vpp", str(vpp), "--schedule", schedule, "--json", "--out", str(plan),
                 "--overwrite")
        _planner("run", str(plan), "--steps", "1", "--warmup", "1", "--out", str(run), "--overwrite")
        m = json.loads((run / "measured.json").read_text())
        for stage, (meas, pred) in enumerate(zip(m["peak_memory_bytes"], m["predicted_memory_compared_bytes"])):
            print(f"{schedule:<18}{stage:>6}{pred / 2**20:>15,.1f}{meas / 2**20:>14,.1f}{pred / meas - 1:>+11.1%}")
    print(f"\n{time.perf_counter() - start:.0f} s; command: python benchmarks/pipeline_memory.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
