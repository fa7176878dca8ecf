"""`planner sweep`: the best plan per cluster size and device, days, GPU-hours and cost of
training N tokens there, the cheapest size that meets a deadline, and the scaling curve."""
from __future__ import annotations

import argparse
import csv
import io
import sys
import time
from dataclasses import replace
from pathlib import Path

from costmodel.inputs import UserError
from costmodel.training_cost import GPU_HOUR_USD_RANGE, TOKENS_RANGE
from planner import outputs
from planner.args import (
    DEGREE,
    add_overwrite_arg,
    failures_from_args,
    float_in,
    number_list,
    positive_float,
    refuse_ignored,
)
from planner.commands.common import (
    add_framework_arg,
    add_train_args,
    emit_json,
    framework_of,
    print_node_note,
    specs_from_args,
)
from planner.commands.search import add_constraint_args, parse_options
from planner.no_plan import CONTRADICTORY
from planner.objective import refuse_bad_combinations
from planner.sweep import KNEE_EFFICIENCY, SweepResult, SweepSpec, sweep

EPILOG = f"""examples:
  planner sweep --model llama-70b --device A100 --nodes 4,8,16,32 --tokens 2e12 --gpu-hour-usd 2
  planner sweep --model llama3-8b --device A100,H100 --nodes 1,2,4,8 --tokens 1e12 --gpu-hour-usd 1.5,2.5 \\
      --deadline-days 30 --plot sweep.png --csv sweep.csv
  planner sweep --model mixtral-8x7b --device H100 --nodes 8,16,32 --tokens 1e12 --framework megatron --json

Each size is searched as `planner search` searches one cluster (proven optimal unless the sweep's
--time-limit runs out: a size not reached is said so). Days include the checkpoint writes and the
work lost to failures (the 'long run' line of search). The answer, among the sizes that meet
--deadline-days and --budget-usd: --objective cost (the default), the cheapest size (by cost with
--gpu-hour-usd, else by GPU-hours; an explicit --objective cost needs the price); --objective time,
the size that ends soonest (e.g. the fastest within a budget). Each size's plan is its fastest
(on one cluster the cheapest run is the fastest plan). The knee of a device's
curve is its largest size that keeps {100 * KNEE_EFFICIENCY:.0f}% of the smallest size's tokens/s per GPU."""


def add_sweep_args(p: argparse.ArgumentParser) -> None:
    add_train_args(p, cluster=False)
    add_framework_arg(p)
    g = p.add_argument_group("sizes and cost")
    g.add_argument("--device", required=True, metavar="D[,D2...]",
                   help="device profiles to size, e.g. A100 or A100,H100 (see `planner devices`)")
    g.add_argument("--nodes", required=True, type=number_list(DEGREE), metavar="N[,N2...]",
                   help="node counts to try, e.g. 4,8,16,32")
    g.add_argument("--gpus-per-node", type=DEGREE, default=8, help="devices per node (default 8)")
    g.add_argument("--tokens", required=True, type=float_in(*TOKENS_RANGE), metavar="N",
                   help="tokens to train, e.g. 2e12 (in --json, days, gpu_hours and cost_usd are null for a run that "
                        "never ends: a failure before every checkpoint)")
    g.add_argument("--gpu-hour-usd", type=number_list(float_in(*GPU_HOUR_USD_RANGE, " USD")), metavar="P[,P2...]",
                   help="price of a GPU-hour in USD: one, or one per --device")
    g.add_argument("--deadline-days", type=positive_float, metavar="X",
                   help="the run must end within X days: sizes that miss it are left out")
    g.add_argument("--budget-usd", type=positive_float, metavar="B",
                   help="the run must cost at most B USD at --gpu-hour-usd: sizes over it are left out")
    g.add_argument("--objective", choices=["cost", "time"], default="cost",
                   help="cost: the cheapest size within the limits (default); time: the size that ends soonest "
                        "within them (with --budget-usd: the fastest run the budget buys)")
    p.add_argument("--json", action="store_true",
                   help='print {"rows": [{"num_gpus", "device", "plan", "step_time_s", "tokens_per_s", "mfu", '
                        '"days", "gpu_hours", "cost_usd", ...}], "best", "knee_gpus", ...} on stdout')
    p.add_argument("--csv", metavar="F", help="write the rows to this CSV")
    p.add_argument("--plot", metavar="F", help="draw the scaling curve (tokens/s per GPU and cost against GPUs, "
                                               "knee marked) to F (.png or .svg)")
    p.add_argument("--report", metavar="DIR", help="write the sweep as a report directory: index.html (one "
                                                   "self-contained page: the scaling curve with hover, the sizes "
                                                   "sortable), index.md and the curve as PNG and SVG")
    add_overwrite_arg(p)
    add_constraint_args(p, default_time_limit_s=120.0, objective=False)


def cmd_sweep(args: argparse.Namespace) -> int:
    if not args.model:
        raise UserError("sweep needs --model (a name from `planner models`, or a Hugging Face config.json)")
    if args.cluster:
        raise UserError("sweep sizes clusters from --device, --nodes and --gpus-per-node; leave out --cluster")
    if args.group_link is not None:
        raise UserError("--group-link joins the groups of a mixed cluster; a sweep sizes uniform clusters")
    if not (args.csv or args.plot or args.report):
        refuse_ignored(args.given, {"overwrite"}, "without --csv, --plot or --report nothing is written")
    args.csv = outputs.out_file(args.csv, "--csv", args.overwrite, ".csv")
    if args.plot and Path(args.plot).suffix.lower() not in (".png", ".svg"):
        raise UserError(f"--plot {args.plot}: the picture is written as .png or .svg; name the file so")
    args.plot = outputs.out_file(args.plot, "--plot", args.overwrite)
    args.report = outputs.out_dir(args.report, "--report", args.overwrite, outputs.REPORT_FILES)
    refuse_bad_combinations(args, "sweep")
    spec = SweepSpec(devices=tuple(d.strip() for d in args.device.split(",") if d.strip()),
                     nodes=tuple(args.nodes), gpus_per_node=args.gpus_per_node, tokens=args.tokens,
                     gpu_hour_usd=tuple(args.gpu_hour_usd or ()), deadline_days=args.deadline_days,
                     budget_usd=args.budget_usd, objective=args.objective,
                     framework=framework_of(args), failures=failures_from_args(args), time_limit_s=args.time_limit)

    _one_profile_each(spec.devices)

    noted = []   # the sizes share their nodes: a note once

    def specs(name: str):
        args.cluster = name
        try:
            found = specs_from_args(args, note=False)
            if not noted and print_node_note(args, found[2]):
                noted.append(name)
            return found
        finally:
            args.cluster = None

    options = replace(parse_options(args), progress=None)   # one line per size, not per search
    start = time.perf_counter()
    result = sweep(spec, specs, options, progress=lambda text: print(f"sweep {text}", file=sys.stderr, flush=True))
    if result.rows and all(row.reason.startswith(CONTRADICTORY) for row in result.rows):   # the pins, not a size
        raise UserError(result.rows[-1].reason + " (at every size; nothing written)")
    if args.csv:
        outputs.write_file(args.csv, to_csv(result), args.overwrite)
    if args.plot:
        from reports.scaling import draw_scaling
        outputs.write_file(args.plot, draw_scaling(result, args.plot.suffix.lstrip(".").lower()), args.overwrite)
    if args.report:
        from reports.sweep_report import write_sweep_report
        with outputs.staged_dir(args.report, args.overwrite, outputs.REPORT_FILES,
                                 outputs.REPORT_FIGURES) as staging:
            write_sweep_report(result, staging)
    _show(args, result, time.perf_counter() - start)
    if result.best is None:
        raise UserError(result.why_none)
    return 0


def _show(args: argparse.Namespace, result: SweepResult, wall_s: float) -> None:
    """The sizes as --json or the table, shown whether or not one meets the limits."""
    if args.json:
        emit_json(result.to_dict())
        return
    print("\n".join(table_lines(result)))
    print(f"{len(result.rows)} size{'s' if len(result.rows) != 1 else ''} in {wall_s:.1f} s" + "".join(f"; wrote {p}" for p in (args.csv, args.plot) if p)
          + (f"; wrote {args.report}/index.html" if args.report else ""))


COLUMNS = ("device", "num_gpus", "plan_label", "step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "mfu",
           "scaling_efficiency", "days", "gpu_hours", "cost_usd", "proven_optimal", "reason")


def to_csv(result: SweepResult) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in result.rows:
        writer.writerow({k: ("" if v is None else v) for k, v in row.to_dict().items()})
    return buffer.getvalue()


def table_lines(result: SweepResult) -> list[str]:
    from reports.tables import table as render
    table = []
    for row in result.rows:
        d = row.to_dict()
        mark = (("*" if row is result.best else "x" if result.outside(row) else "")
                + (" knee" if result.knees.get(row.device) == row.num_gpus else ""))
        if row.found is None:
            table.append([mark, row.device, f"{row.num_gpus:,}", row.reason, "", "", "", "", "", "", ""])
            continue
        table.append([mark, row.device, f"{row.num_gpus:,}", d["plan_label"], f"{d['step_time_s']:.3f}",
                      f"{d['tokens_per_s_per_gpu']:,.0f}", f"{100 * d['mfu']:.1f}",
                      f"{100 * d['scaling_efficiency']:.0f}%", f"{d['days']:,.1f}", f"{d['gpu_hours']:,.0f}",
                      "" if d["cost_usd"] is None else f"{d['cost_usd']:,.0f}"])
    lines = [render(["", "device", "GPUs", "plan", "step s", "tokens/s/GPU", "MFU %", "scaling", "days",
                     "GPU-hours", "cost $"], table)]
    if result.best is not None:
        b = result.best
        assert b.cost is not None
        within = result.limits()
        lines.append(f"* {'fastest' if result.objective == 'time' else 'cheapest'}"
                     f"{'' if not within else f' within {within}'}: "
                     f"{b.num_gpus:,} {b.device}, {b.cost.days:,.1f} days, {b.cost.gpu_hours:,.0f} GPU-hours"
                     + ("" if b.cost.cost_usd is None else f", ${b.cost.cost_usd:,.0f}"))
    if any(r.found is not None and r.found.plan.fp8_linears for r in result.rows):
        lines.append("MFU % against each device's bf16 peak, float8 linears included (the float8 peak is twice it)")
    if any(result.outside(r) for r in result.rows):
        lines.append(f"x: outside {result.limits()} (past the deadline or over the budget)")
    lines.append(f"knee: the largest size that keeps {100 * KNEE_EFFICIENCY:.0f}% of the smallest size's tokens/s "
                 f"per GPU" + "".join(f"; {dev} {gpus:,} GPUs" for dev, gpus in result.knees.items()))
    if any(not r.proven for r in result.rows if r.found is not None):
        lines.append("some sizes were not proven optimal within the --time-limit (proven_optimal in --json)")
    return lines


def _one_profile_each(devices: tuple[str, ...]) -> None:
    """Rows, scaling and knees are kept per profile name: two entries of --device that resolve to
    one name (aliases of one profile, or a copy that kept its [device] name) would share them."""
    from costmodel.hardware.profile_io import resolve_device
    seen: dict[str, str] = {}
    for device in devices:
        name = resolve_device(device).name
        if name in seen:
            raise UserError(f"--device {seen[name]} and {device} are both the profile {name!r}: give each "
                            "device once, and a copied profile its own [device] name")
        seen[name] = device
