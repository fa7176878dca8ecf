"""Peak memory of two-rank data-parallel plans of the closed loops' models, predicted against
measured by `planner run`, per ZeRO stage below 3 and micro-batch size.

    python benchmarks/dp_memory.py [--out DIR]

The closed loops' unseen models (benchmarks/closed_loop.py: the hidden Llama and the held-out GPT)
in bf16 on 2 gloo ranks (dp2, a datasheet CPU profile: memory does not depend on its speeds),
sequence 128, one micro-batch of 1 or 4 a rank, ZeRO-0/1/2; one warm-up step (CPU memory is
tracked there) and one timed step each. Their layers are far below an FSDP unit's bucket
(costmodel.params.fsdp_unit_layers), so each rank's model is one unit, whose once-a-step reduction
copies all its gradients at once (costmodel.memory.buffer_bytes says why that copy is not priced
apart). Prints predicted and measured MiB and their ratio; about two minutes.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from closed_loop import MODELS   # this directory: the script's own

ZEROS, MICRO_BATCHES, SEQ_LEN = ("0", "1", "2"), (1, 4), 128


def _planner(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "planner", *args], check=True, capture_output=True, text=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="directory for the plans and runs (default: a temporary one)")
    args = p.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="dp-memory-"))
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    print(f"{'model':<14}{'zero':>5}{'mbs':>5}{'predicted MiB':>15}{'measured MiB':>14}{'pred/meas':>11}")
    for name, config in MODELS.items():
        model = out / f"{name}.json"
        model.write_text(json.dumps(config))
        for zero in ZEROS:
            for mbs in MICRO_BATCHES:
                tag = f"{name}-z{zero}-mbs{mbs}"
                plan, run = out / f"{tag}.json", out / tag
                _planner("predict", "--model", str(model), "--cluster", "1x2xxeon-amx", "--dtype", "bf16",
                         "--dp", "2", "--zero", zero, "--mbs", str(mbs), "--seq-len", str(SEQ_LEN),
                         "--global-batch", str(2 * mbs), "--json", "--out", str(plan), "--overwrite")
                _planner("run", str(plan), "--steps", "1", "--warmup", "1", "--out", str(run), "--overwrite")
                m = json.loads((run / "measured.json").read_text())
                meas, pred = m["peak_memory_bytes"][0], m["predicted_memory_compared_bytes"][0]
                print(f"{name:<14}{zero:>5}{mbs:>5}{pred / 2**20:>15,.1f}{meas / 2**20:>14,.1f}{pred / meas - 1:>+11.1%}",
                      flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s; command: python benchmarks/dp_memory.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
