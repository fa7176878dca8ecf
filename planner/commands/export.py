"""`planner export plan.json --to torchtitan|megatron|deepspeed [--out F]` and `search --export`:
the plan in another framework's configuration, what that framework cannot say (and the nearest
plan it runs instead), and that plan's predicted cost as the framework runs it."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from costmodel.check import check_structure
from costmodel.inputs import UserError
from costmodel.plan import PlanFile
from costmodel.units import GIB
from planner import outputs
from planner.args import add_overwrite_arg, refuse_ignored
from planner.commands.common import load_plan
from planner.exports import TARGETS, Export, export_plan
from planner.targets import name_for

EPILOG = """examples:
  planner export plan.json --to torchtitan --out job.toml
  planner export plan.json --to megatron --out run_megatron.sh
  planner export plan.json --to deepspeed --out ds_config.json
  planner search --model llama3-8b --cluster 1x8xH100 --export torchtitan --export-out job.toml

Each target gets the plan as it can say it: where it cannot (a schedule it lacks, per-rank
recomputation, an uneven split, a ZeRO stage, context parallelism...), the export says so line by
line and writes the nearest plan that target runs, priced as that framework runs it (its traits
in costmodel/frameworks.py). A plan with no runnable nearest plan is refused in one line.
A plan searched for the target (`planner search --framework T`, or `--export T`) is written as
it is: the search held only plans T runs."""


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan.json (from search --out or predict --out)")
    p.add_argument("--to", required=True, choices=list(TARGETS), help="the framework whose configuration to write")
    p.add_argument("--out", help="write the configuration here (default: print it on stdout, the summary on stderr)")
    p.add_argument("--json", action="store_true",
                   help='print {"target", "plan", "differences", "launch", "estimate", "planned", "file"} as JSON, '
                        'and "text", the exported file\'s contents, without --out')
    add_overwrite_arg(p)


def cmd_export(args: argparse.Namespace) -> int:
    if not args.out:
        refuse_ignored(args.given, {"overwrite"}, "without --out nothing is written")
    out = outputs.out_file(args.out, "--out", args.overwrite)
    pf = load_plan(Path(args.plan), "export")
    if problems := check_structure(pf.model, pf.train, pf.cluster, pf.plan):
        raise UserError(f"{args.plan} is not a valid plan: " + "; ".join(problems))
    if pf.cluster.is_mixed:   # their configurations know neither groups nor which node holds which stage
        raise UserError(f"{args.plan}: a plan for the mixed cluster {pf.cluster.name} has no {args.to} form "
                         f"(its configurations assume one device kind and do not place stages on groups); "
                         f"run it with `planner run {args.plan} --print-launch`")
    result = export_plan(pf, args.to)
    emit(result, pf, out, args.json, args.overwrite)
    return 0


def emit(result: Export, pf: PlanFile, out: Path | None, as_json: bool, overwrite: bool) -> None:
    """Write the file (or print it), then the summary: on stdout with a file or --json, else on
    stderr so that stdout holds the configuration alone."""
    if out is not None:
        outputs.write_file(out, result.text, overwrite)
    if as_json:
        sys.stdout.write(outputs.json_text(to_json(result, pf, out)))
        return
    if out is None:
        sys.stdout.write(result.text)
    print("\n".join(summary_lines(result, pf, out)), file=sys.stdout if out is not None else sys.stderr)


def to_json(result: Export, pf: PlanFile, out: Path | None) -> dict[str, Any]:
    doc = {"target": result.target, "plan": result.plan.to_dict(), "differences": list(result.differences),
           "launch": result.launch, "estimate": result.estimate.to_dict(), "planned": result.planned.to_dict(),
           "file": None if out is None else str(out)}
    if out is None:
        doc["text"] = result.text
    return doc


def summary_lines(result: Export, pf: PlanFile, out: Path | None) -> list[str]:
    est, planned = result.estimate, result.planned
    lines = [f"{result.target}: {result.plan.short()}"
             + ("" if result.plan == pf.plan else f"   (the plan: {pf.plan.short()})")]
    if result.differences:
        lines += [f"  - {d}" for d in result.differences]
    else:
        lines.append(f"  {result.target} says the plan as it is")
    change = 100 * (est.step_time_s / planned.step_time_s - 1)
    lines.append(f"predicted as {result.target} runs it: {est.step_time_s:.3f} s per step, "
                 f"{est.tokens_per_s:,.0f} tokens/s, MFU {100 * est.mfu:.1f}%, peak "
                 f"{max(est.peak_memory_bytes) / GIB:.1f} of {est.memory_capacity_bytes / GIB:.1f} GiB"
                 + ("" if planned is est else
                    f"; the plan as priced for {name_for(pf.cluster.framework)}: {planned.step_time_s:.3f} s "
                    f"({change:+.1f}% for the export)"))
    lines.append(f"launch: {result.launch}")
    if result.plan != pf.plan:
        lines.append(f"the plan was made for {name_for(pf.cluster.framework)}, so this is the plan nearest to it, "
                     f"not {result.target}'s own best: `planner search ... --framework {result.target}` "
                     f"(or --export {result.target}) searches what {result.target} runs")
    if out is not None:
        lines.append(f"wrote {out}")
    return lines
