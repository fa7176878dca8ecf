"""What each rank runs under torchrun: `python -m runtime.worker --plan plan.json --out DIR ...`.

Rank 0 writes DIR/raw.json (losses, step times, memory); a rank that raises writes
DIR/errors/rank<R>.txt (the cause on the first line, then the traceback) so the launcher can name
it. `PLANNER_FAULT=RANK:STEP:raise|exit` injects a failure (used by the failure tests).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch.distributed as dist

from costmodel.plan import PlanFile
from runtime.train import RunConfig, init_distributed, run_rank


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m runtime.worker")
    p.add_argument("--plan", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--data", default=None)
    p.add_argument("--data-dtype", default="uint16")
    return p.parse_args(argv)


def fault_hook() -> tuple[int, int, str] | None:
    spec = os.environ.get("PLANNER_FAULT")
    if not spec:
        return None
    rank, step, kind = spec.split(":")
    return int(rank), int(step), kind


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    try:
        pf = PlanFile.load(Path(args.plan))
        init_distributed()
        cfg = RunConfig(steps=args.steps, warmup=args.warmup, seed=args.seed, lr=args.lr,
                        data=args.data, data_dtype=args.data_dtype, fault=fault_hook())
        raw = run_rank(pf, cfg)
        if raw is not None:
            raw.pop("params", None)
            (out / "raw.json").write_text(json.dumps(raw, indent=2))
        dist.barrier()   # no rank tears gloo down while a peer still talks to it
        dist.destroy_process_group()
        return 0
    except BaseException as exc:   # noqa: BLE001 - recorded for the launcher, then re-raised
        errors = out / "errors"
        errors.mkdir(parents=True, exist_ok=True)
        cause = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        (errors / f"rank{rank}.txt").write_text(cause + "\n\n" + traceback.format_exc())
        raise


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's teardown once the job is done: a C++ thread of gloo or of the
    # pipelining runtime destroyed during static destruction aborts the process now and then
    # ("terminate called without an active exception", SIGABRT after the last step), which
    # torchrun would report as a failed run. Everything is written and the group destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
