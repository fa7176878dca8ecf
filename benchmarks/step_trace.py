"""Where a plan's training step spends its time, op by op: torch.profiler over timed steps of
`planner run`'s own step (runtime.train.run_rank) on the plan's ranks, on this CPU, one rank's
table (--rank, default 0) sorted by self time (FSDP's collectives show as
FSDP::post_backward_reduce and FSDP::all_gather, their self time the rank's wait on gloo and its
bucket copies).

    python benchmarks/step_trace.py PLAN.json [--steps 2] [--rows 30] [--shapes] [--rank R]

--shapes: the table's rows per op and input shape (the shapes are always recorded: the GEMMs'
price needs them, at a little profiler overhead per op), so each collective's wait shows per
buffer (each kind of collective at its own speed: costmodel.comm.kind_factors).

After the table, the traced rank's self time per part of the step (the optimizer's step, FSDP's
hooks, collectives' waits, GEMMs, SDPA, the rest), its GEMMs beside their price at the profile's
curve (in all and per shape), and the plan's predicted ledger: where a prediction falls short,
which part is unpriced.
Only the timed steps are traced (the build and WARM_STEPS warm-up steps run first, untraced).

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
from torch.profiler import ProfilerActivity, profile, schedule

from costmodel.estimate import estimate
from costmodel.kernels import gemm_s
from costmodel.plan import PlanFile
from runtime.fork import run_forked
from runtime.layer_ops import op_kind
from runtime.train import TIMED_STEP, RunConfig, run_rank

WARM_STEPS = 2   # untraced steps first: allocations, first calls, the optimizer's lazy states


def traced_steps(pf: PlanFile, steps: int):
    """(the profiler, rank 0's raw figures) of `steps` timed steps on this rank. The model's
    build and the warm-up steps run untraced (a trace around the whole run would put the first
    optimizer step's state allocation and the initialisation's draws in the table)."""
    when = schedule(wait=WARM_STEPS - 1, warmup=1, active=steps, repeat=1)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, schedule=when) as prof:
        raw = run_rank(pf, RunConfig(steps=steps, warmup=WARM_STEPS, quiet=True, after_step=lambda _: prof.step()))
    return prof, raw


def traced_rank(pf: PlanFile, steps: int, rows: int, shapes: bool = False, rank: int = 0) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")   # FSDP's and pipelining's notices
    prof, raw = traced_steps(pf, steps)
    if dist.get_rank() == rank:
        print(f"rank {rank}, {steps} traced step(s):")
        print(prof.key_averages(group_by_input_shape=shapes).table(sort_by="self_cpu_time_total", row_limit=rows))
        print(parts_table(prof.events(), pf, steps), flush=True)
    dist.barrier()   # rank 0 holds the step times (runtime.train): printed after the tables
    if dist.get_rank() == 0:
        print("traced steps: " + ", ".join(f"{t * 1e3:.0f} ms" for t in raw["step_times_s"])
              + f"; predicted {estimate(pf.model, pf.train, pf.cluster, pf.plan).step_time_s * 1e3:.0f} ms", flush=True)


GEMM_INPUTS = {"aten::mm": 0, "aten::addmm": 1}   # a priced GEMM and where its [M, K], [K, N] inputs start
LOSS_PREFIXES = ("aten::_log_softmax", "aten::nll_loss")
KIND_PARTS = {"gemm": "GEMMs", "sdpa": "SDPA"}   # runtime.layer_ops.op_kind's kinds named here
GEMM_SHAPE_ROWS = 12   # the parts table's GEMM shapes, most traced time first


def part_of(event) -> str | None:
    """The part of the step an op's self time belongs to: what it runs under (the optimizer's
    step, an FSDP hook, a collective or send / receive), else its kind of kernel; None outside
    the step's timed work (runtime.train.TIMED_STEP: the batch's draw, the loop's barrier and
    the all-reduces of its figures)."""
    chain, up = [event.name], event.cpu_parent
    while up is not None:
        chain.append(up.name)
        up = up.cpu_parent
    if TIMED_STEP not in chain:
        return None
    if any(n.startswith("Optimizer.step") for n in chain):
        return "optimizer step"
    if any(n.startswith("FSDP::") for n in chain):
        return "FSDP hooks (casts, copies, collectives)"
    if any(n.startswith("c10d::") for n in chain):
        return "collectives and send/recv (waits)"
    if event.name.startswith("aten::") and (kind := op_kind(event.name.removeprefix("aten::"))) in KIND_PARTS:
        return KIND_PARTS[kind]   # the kinds as the profile's layer timing counts them
    if event.name.startswith(LOSS_PREFIXES):
        return "loss (log-softmax, NLL)"
    if event.name.startswith("aten::"):
        return "other aten ops (memory-bound kernels)"
    if event.name == TIMED_STEP:
        # the step's time outside every recorded op: Python, and waits the profiler does not
        # record (a pipeline's wait on its send / receive happens here)
        return "outside ops (Python, unrecorded waits)"
    return "autograd nodes, hooks (own time)"


def gemm_dims(event) -> list | None:
    """A traced GEMM's [[M, K], [K, N]] inputs, None where they are not a plain product."""
    first = GEMM_INPUTS.get(event.name)
    dims = event.input_shapes[first:first + 2] if first is not None and event.input_shapes else []
    if len(dims) != 2 or len(dims[0]) != 2 or len(dims[1]) != 2 or dims[0][1] != dims[1][0]:
        return None
    return dims


def gemm_priced_s(event, pf: PlanFile) -> float | None:
    """A traced GEMM at the profile's curve and factor (costmodel.kernels.gemm_s), None where its
    shapes are not a plain [M, K] x [K, N]."""
    if (dims := gemm_dims(event)) is None:
        return None
    (m, k), (_, n) = dims
    return gemm_s(m, k, n, pf.cluster.device, pf.train)


def gemm_shape_lines(by_shape: dict[str, list], steps: int, rows: int = GEMM_SHAPE_ROWS) -> list[str]:
    """The plain GEMMs per shape, most traced time first: calls, traced and priced ms per step. The
    same shape runs in several plans (a layer's projections at one micro-batch size), so a shape
    that runs further over its price in one plan than in another is the plan's doing, not the curve's."""
    out = [f"{'  GEMM shape':36s} {'calls':>6s} {'traced ms':>10s} {'priced ms':>10s}"]
    ranked = sorted(by_shape.items(), key=lambda kv: -kv[1][1])
    for shape, (calls, t_s, p_s) in ranked[:rows]:
        out.append(f"  {shape:34s} {calls / steps:6.0f} {t_s / steps * 1e3:10.1f} {p_s / steps * 1e3:10.1f}"
                   f" ({100 * (t_s / p_s - 1):+.1f} %)")
    if rest := ranked[rows:]:
        out.append(f"  ... {len(rest)} more shapes, {sum(r[1] for _, r in rest) / steps * 1e3:.1f} ms traced")
    return out


def parts_table(events, pf: PlanFile, steps: int) -> str:
    """Self time per part (part_of) per traced step, the GEMMs beside their price; then the
    cost model's ledger of the plan's critical rank (costmodel.estimate) to set against it."""
    traced_s, gemm_priced_total_s, gemm_traced_s = {}, 0.0, 0.0
    by_shape: dict[str, list] = {}   # "[M, K] x [K, N]": [calls, traced s, priced s]
    for ev in events:
        if (part := part_of(ev)) is None:
            continue
        traced_s[part] = traced_s.get(part, 0.0) + ev.self_cpu_time_total * 1e-6
        if part == "GEMMs" and (priced := gemm_priced_s(ev, pf)) is not None:
            gemm_priced_total_s += priced
            gemm_traced_s += ev.self_cpu_time_total * 1e-6
            row = by_shape.setdefault(" x ".join(map(str, gemm_dims(ev))), [0, 0.0, 0.0])
            row[0] += 1
            row[1] += ev.self_cpu_time_total * 1e-6
            row[2] += priced
    lines = ["part of the traced rank's step                 ms per step", "-" * 58]
    for part, part_s in sorted(traced_s.items(), key=lambda kv: -kv[1]):
        lines.append(f"{part:45s} {part_s / steps * 1e3:10.1f}")
    lines.append(f"{'the timed step (self time of its ops)':45s} {sum(traced_s.values()) / steps * 1e3:10.1f}")
    if gemm_traced_s:
        lines.append(f"GEMMs of plain shapes: {gemm_traced_s / steps * 1e3:.1f} ms traced, "
                     f"{gemm_priced_total_s / steps * 1e3:.1f} priced "
                     f"({100 * (gemm_traced_s / gemm_priced_total_s - 1):+.1f} %)")
        lines += gemm_shape_lines(by_shape, steps)
    ledger = estimate(pf.model, pf.train, pf.cluster, pf.plan).time_breakdown_s
    lines.append("predicted ledger (critical rank): " + ", ".join(
        f"{k} {v * 1e3:.1f}" for k, v in ledger.items() if v > 0) + " ms")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path, help="a plan.json")
    parser.add_argument("--steps", type=int, default=2, help="traced steps (default 2)")
    parser.add_argument("--rows", type=int, default=30, help="rows of the table (default 30)")
    parser.add_argument("--shapes", action="store_true", help="a row per op and input shape (each collective's buffer)")
    parser.add_argument("--rank", type=int, default=0,
                        help="whose table to print (default 0; a pipeline's last stage is the last rank)")
    args = parser.parse_args()
    if args.steps < 1 or args.rows < 1:
        parser.error("--steps and --rows must be at least 1")
    try:
        pf = PlanFile.load(args.plan)
    except (OSError, ValueError) as err:
        sys.exit(f"step_trace: {err}")
    if pf.cluster.device.kind != "cpu":
        sys.exit(f"step_trace: {args.plan} is a plan for {pf.cluster.device.name}; this traces CPU ranks")
    if not 0 <= args.rank < pf.plan.world_size:
        sys.exit(f"step_trace: --rank {args.rank}: {args.plan} runs ranks 0 to {pf.plan.world_size - 1}")
    run_forked(pf.plan.world_size, traced_rank, pf, args.steps, args.rows, args.shapes, args.rank)
    print("command: " + " ".join(["python benchmarks/step_trace.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
