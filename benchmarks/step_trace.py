"""Where a plan's training step spends its time, op by op: torch.profiler over timed steps of
`planner run`'s own step (runtime.train.run_rank) on the plan's ranks, on this CPU, rank 0's
table sorted by self time (FSDP's collectives show as FSDP::post_backward_reduce and
FSDP::all_gather, their self time the rank's wait on gloo and its bucket copies).

    python benchmarks/step_trace.py PLAN.json [--steps 2] [--rows 30] [--shapes]

--shapes: one row per op and input shape (torch.profiler's record_shapes), so each collective's
wait shows per buffer (what the README's "TP's collectives: each kind at its own speed" quotes;
costmodel.comm.kind_factors).

PLAN.json: a plan written by `planner search` / `planner predict` (its cluster's ranks are forked
here, one thread each, as the profile's ranks run). The profiler's own cost slows the step a
little; the shares are what this is for.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from costmodel.plan import PlanFile
from runtime.fork import run_forked
from runtime.train import RunConfig, run_rank


def traced_rank(pf: PlanFile, steps: int, rows: int, shapes: bool = False) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")   # FSDP's and pipelining's notices
    run_rank(pf, RunConfig(steps=1, warmup=2, quiet=True))   # warm: allocations, first-call costs
    with profile(activities=[ProfilerActivity.CPU], record_shapes=shapes) as prof:
        raw = run_rank(pf, RunConfig(steps=steps, warmup=0, quiet=True))
    if dist.get_rank() == 0:
        print(prof.key_averages(group_by_input_shape=shapes).table(sort_by="self_cpu_time_total", row_limit=rows))
        print("traced steps: " + ", ".join(f"{t * 1e3:.0f} ms" for t in raw["step_times_s"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path, help="a plan.json")
    parser.add_argument("--steps", type=int, default=2, help="traced steps (default 2)")
    parser.add_argument("--rows", type=int, default=30, help="rows of the table (default 30)")
    parser.add_argument("--shapes", action="store_true", help="a row per op and input shape (each collective's buffer)")
    args = parser.parse_args()
    if args.steps < 1 or args.rows < 1:
        parser.error("--steps and --rows must be at least 1")
    try:
        pf = PlanFile.load(args.plan)
    except (OSError, ValueError) as err:
        sys.exit(f"step_trace: {err}")
    if pf.cluster.device.kind != "cpu":
        sys.exit(f"step_trace: {args.plan} is a plan for {pf.cluster.device.name}; this traces CPU ranks")
    run_forked(pf.plan.world_size, traced_rank, pf, args.steps, args.rows, args.shapes)


if __name__ == "__main__":
    main()
