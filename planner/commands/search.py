"""`planner search`: its arguments, running the search with progress and a time limit, the
ranked table and why the runner-up lost (planner/cli.py prints the summary and proof line)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Any

from costmodel.inputs import UserError
from costmodel.plan import PlanFile, Recompute
from costmodel.schedules import Schedule
from costmodel.training_cost import GPU_HOUR_USD_RANGE, TOKENS_RANGE
from costmodel.units import GIB
from planner import outputs
from planner.args import (
    DEGREE,
    MAX_TOP,
    add_overwrite_arg,
    failures_from_args,
    float_in,
    int_in,
    positive_float,
    refuse_ignored,
)
from planner.commands.common import emit_json, framework_of, print_training_note, specs_from_args, write_report_dir
from planner.commands.search_output import SearchOutcome, print_search, search_json
from planner.compare import comparisons
from planner.no_plan import no_plan_reason
from planner.objective import RunGoal, keep_within, refuse_bad_combinations
from planner.search import (
    SearchOptions,
    SearchResult,
    search,
)

_YES_NO = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _yes_no(value: str) -> bool:
    return _YES_NO[value.lower()]


# --fix KEY=VALUE: the plan field it pins and how to read the value
FIXABLE = {"dp": ("dp", DEGREE), "tp": ("tp", DEGREE), "pp": ("pp", DEGREE), "cp": ("cp", DEGREE),
           "ep": ("ep", DEGREE), "etp": ("etp", DEGREE), "dp_replicate": ("dp_replicate", DEGREE),
           "vpp": ("vpp", DEGREE), "mbs": ("micro_batch_size", DEGREE), "zero": ("zero_stage", int_in(0, 3)),
           "schedule": ("schedule", Schedule), "recompute": ("recompute", Recompute),
           "sp": ("sequence_parallel", _yes_no),
           "offload": ("offload_optimizer", _yes_no),
           "fp8": ("fp8_linears", _yes_no),
           "act_offload": ("offload_activations", _yes_no)}


def _valid_values(parse: Any) -> str:
    """What a --fix key takes, where it is a name: '; one of ...' (degrees and stages say it themselves)."""
    if isinstance(parse, type) and issubclass(parse, Enum):
        return f"; one of {', '.join(str(m.value) for m in parse)}"
    return "; yes or no" if parse is _yes_no else ""


def add_search_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--top", type=int_in(1, MAX_TOP), default=5, help="how many plans to rank (default 5)")
    p.add_argument("--out", help="write the best plan with its specs to this plan.json")
    p.add_argument("--json", action="store_true", help='print {"plans", "comparisons", "search", "checkpoint"} as JSON on stdout')
    p.add_argument("--csv", help="write every plan the search found to fit to this CSV, with its price (the "
                                 "re-priced ones as simulated, `fits` false where they no longer fit)")
    p.add_argument("--report", metavar="DIR", help="write bubble, memory and ranking reports of the result to DIR: "
                                                   "index.html (one self-contained interactive page), index.md "
                                                   "and PNG/SVG figures")
    p.add_argument("--export", metavar="TARGET", choices=["torchtitan", "megatron", "deepspeed"],
                   help="also write the best plan for torchtitan, megatron or deepspeed (planner export)")
    p.add_argument("--export-out", metavar="F", help="the --export file (default: printed after the table)")
    add_overwrite_arg(p)
    add_constraint_args(p, default_time_limit_s=60.0)
    g = add_cost_args(p)
    add_limit_args(g)


def add_cost_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training cost")
    g.add_argument("--tokens", type=float_in(*TOKENS_RANGE), metavar="N",
                   help="tokens to train (e.g. 2e12): adds days, GPU-hours (and cost with --gpu-hour-usd), with "
                        "the checkpoint and failure overhead of the 'long run' line (in --json, days, gpu_hours and "
                        "cost_usd are null for a run that never ends: a failure before every checkpoint)")
    g.add_argument("--gpu-hour-usd", type=float_in(*GPU_HOUR_USD_RANGE, " USD"), metavar="P",
                   help="price of one GPU-hour in USD")
    return g


def add_limit_args(g: argparse._ArgumentGroup) -> None:
    """The limits of a training run, under any --objective (planner.objective)."""
    g.add_argument("--deadline-days", type=positive_float, metavar="X",
                   help="the run of --tokens must end within X days: plans (sweep: sizes) that miss it are left out")
    g.add_argument("--budget-usd", type=positive_float, metavar="B",
                   help="the run of --tokens at --gpu-hour-usd must cost at most B USD: plans (sweep: sizes) over "
                        "it are left out")


def refuse_price_without_tokens(args: argparse.Namespace) -> None:
    refuse_ignored(args.given, {"gpu_hour_usd"}, "--gpu-hour-usd prices the --tokens to train")


def training_cost_of(args: argparse.Namespace, model, train, cluster, est):
    """--tokens [--gpu-hour-usd]: what training them takes with this plan (None without --tokens)."""
    from costmodel.resilience import checkpoint_cost
    from costmodel.training_cost import training_cost
    if args.tokens is None:
        refuse_price_without_tokens(args)
        return None
    kept = checkpoint_cost(model, train, cluster.world_size, est.step_time_s, est.tokens_per_s, failures_from_args(args))
    return training_cost(args.tokens, cluster.world_size, kept.effective_tokens_per_s, args.gpu_hour_usd)


def add_constraint_args(p: argparse.ArgumentParser, default_time_limit_s: float, objective: bool = True) -> None:
    c = p.add_argument_group("constraints")
    c.add_argument("--max-tp", type=DEGREE, help="largest TP degree (default: devices per node)")
    c.add_argument("--fix", action="append", default=[], metavar="KEY=VALUE",
                   help=f"pin a plan field; keys: {', '.join(FIXABLE)} (repeatable). offload=yes|no: "
                        "optimizer states on the host or on the devices (default: on the devices, on the host "
                        "only when nothing fits; act_offload=yes|no likewise for the layers' saved "
                        "activations); fp8=yes|no with --dtype fp8")
    c.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="only this ZeRO stage (= --fix zero=Z)")
    c.add_argument("--schedule", choices=[s.value for s in Schedule if s.traits.closed_form],
                   help="only this pipeline schedule (ZBV and DualPipeV have no closed form to search by: they "
                        "compete as simulated variants of the best plans; price one with planner predict)")
    c.add_argument("--no-recompute", action="store_true", help="never recompute activations")
    c.add_argument("--time-limit", type=positive_float, default=default_time_limit_s, metavar="S",
                   help="stop after S seconds with the best plan found, reported as not proven optimal; an "
                        "error where none was found yet (a very large space can take seconds to list) "
                        f"(default {default_time_limit_s:g})")
    if objective:   # sweep has its own (planner.objective)
        c.add_argument("--objective", choices=["time", "memory", "cost"], default="time",
                       help="time: fastest plan; memory: least memory within 5%% of the fastest (among each "
                            "outer choice's fastest layer split); cost: the cheapest run of --tokens at "
                            "--gpu-hour-usd (both needed), which on one cluster is the fastest plan (cost = "
                            "GPUs x days x price), with --deadline-days and --budget-usd as its limits")


def parse_options(args: argparse.Namespace) -> SearchOptions:
    fixed: dict[str, Any] = {}
    for item in args.fix:
        key, _, value = item.partition("=")
        if key not in FIXABLE or not value:
            raise UserError(f"--fix {item!r}: expected KEY=VALUE with KEY one of {', '.join(FIXABLE)}")
        name, parse = FIXABLE[key]
        if name in fixed:
            raise UserError(f"--fix {key} given twice; say it once")
        try:
            fixed[name] = parse(value)
        except argparse.ArgumentTypeError as exc:
            raise UserError(f"--fix {item!r}: {exc}") from None
        except (ValueError, KeyError):
            raise UserError(f"--fix {item!r}: {value!r} is not a valid {key}{_valid_values(parse)}") from None
    for name, value in (("zero_stage", args.zero), ("schedule", args.schedule and Schedule(args.schedule))):
        if value is not None:
            if name in fixed and fixed[name] != value:
                raise UserError(f"contradictory constraints: --fix gives {name}={fixed[name]}, another flag {value}")
            fixed[name] = value
    if args.no_recompute and fixed.get("recompute", Recompute.NONE) is not Recompute.NONE:
        raise UserError(f"contradictory constraints: --no-recompute and --fix recompute={fixed['recompute']}")
    if args.max_tp and fixed.get("tp", 0) > args.max_tp:
        raise UserError(f"contradictory constraints: --fix tp={fixed['tp']} exceeds --max-tp {args.max_tp}")
    return SearchOptions(top_k=getattr(args, "top", 5), max_tp=args.max_tp, fixed=fixed, no_recompute=args.no_recompute,
                         objective="memory" if args.objective == "memory" else "time",   # cost: time's order
                         time_limit_s=args.time_limit, progress=_progress())


def _progress():
    """Progress lines on stderr once a search has run for a second, then at most one a second
    (a search that ends sooner prints nothing)."""
    start = time.perf_counter()
    last = [start]

    def say(text: str) -> None:
        now = time.perf_counter()
        if now - start >= 1.0 and now - last[0] >= 1.0:
            last[0] = now
            print(f"search [{now - start:6.1f} s] {text}", file=sys.stderr, flush=True)
    return say


def write_csv(path: str, result: SearchResult, overwrite: bool) -> None:
    import pandas as pd  # only this option needs pandas (slow to import)
    # every row every field: plan.json leaves out etp and dp_replicate at 1, a table does not; every
    # plan the search priced, those that overflow once simulated marked by `fits`
    # lists (layers per stage, mesh order) as JSON in their cells, as plan.json writes them
    rows = [{**{k: json.dumps(v) if isinstance(v, (list, tuple, dict)) else v for k, v in f.plan.to_dict().items()},
             "etp": f.plan.etp, "dp_replicate": f.plan.dp_replicate,
             "step_time_s": f.estimate.step_time_s, "tokens_per_s": f.estimate.tokens_per_s,
             "mfu": f.estimate.mfu, "max_peak_memory_gib": f.estimate.max_peak_memory_bytes / GIB,
             "bubble_fraction": f.estimate.bubble_fraction, "fits": f.estimate.fits} for f in result.evaluated]
    outputs.write_file(path, pd.DataFrame(rows).sort_values("step_time_s").to_csv(index=False), overwrite)


def check_outputs(args: argparse.Namespace) -> None:
    """Before any work: a bad --out, --csv or --report must not cost a search."""
    if not (args.out or args.csv or args.report or args.export_out):
        refuse_ignored(args.given, {"overwrite"}, "without --out, --csv, --report or --export-out nothing is written")
    if not args.export:
        refuse_ignored(args.given, {"export_out"}, "--export-out names the file of --export TARGET")
    given = [(flag, Path(p).resolve()) for flag, p in (("--out", args.out), ("--csv", args.csv),
                                                      ("--report", args.report), ("--export-out", args.export_out)) if p]
    for i, (flag, path) in enumerate(given):
        if same := [other for other, p in given[i + 1:] if p == path]:
            raise UserError(f"{flag} and {' and '.join(same)} name the same path ({path}); give each its own")
    args.out = outputs.out_file(args.out, "--out", args.overwrite, ".json")
    args.csv = outputs.out_file(args.csv, "--csv", args.overwrite, ".csv")
    args.export_out = outputs.out_file(args.export_out, "--export-out", args.overwrite)
    outputs.out_dir(args.report, "--report", args.overwrite, outputs.REPORT_FILES)


def run_search(args: argparse.Namespace, model, train, cluster) -> SearchResult:
    from planner.targets import options_for
    flag = "--export" if args.export and "framework" not in args.given else "--framework"
    options = options_for(framework_of(args), model, train, cluster, parse_options(args), flag)
    result = search(model, train, cluster, options)
    if not result.plans:
        if not result.stats.optimal:
            left = (f"{result.stats.pruned_by_reason.get('time limit', 0):,} candidates left"
                    if result.stats.enumerated else "the space was still being listed")
            raise UserError(f"no plan found within the --time-limit of {args.time_limit:g} s ({left}); raise it")
        raise UserError(no_plan_reason(model, train, cluster, options, result))
    return result


def _write_files(args: argparse.Namespace, model, train, cluster, result: SearchResult) -> None:
    """--out: the first ranked plan (after the limits of --deadline-days and --budget-usd);
    --csv: every plan the search priced."""
    if args.out:
        pf = PlanFile(plan=result.plans[0].plan, model=model, train=train, cluster=cluster)
        outputs.write_file(args.out, outputs.json_text(pf.to_dict()), args.overwrite)
        print(f"wrote {args.out}", file=sys.stderr)
    if args.csv:
        write_csv(args.csv, result, args.overwrite)
        print(f"wrote {args.csv} ({len(result.evaluated):,} plans priced)", file=sys.stderr)



def cmd_search(args: argparse.Namespace) -> int:
    check_outputs(args)
    if args.export:   # the plan searched for the framework it is exported to
        if args.framework not in (None, args.export):
            raise UserError(f"contradictory flags: --export {args.export} writes a plan for {args.export}, "
                            f"--framework {args.framework} searches for another; give one")
        args.framework = args.export
    refuse_bad_combinations(args, "search")
    if args.tokens is None:   # before the search, not after its outputs
        refuse_price_without_tokens(args)
    model, train, cluster = specs_from_args(args)
    result = run_search(args, model, train, cluster)
    print_training_note(args, model, train)
    goal, left_out = _within_limits(args, model, train, cluster, result)
    best = result.plans[0]
    cost = training_cost_of(args, model, train, cluster, best.estimate)   # refuses before anything is written
    _write_files(args, model, train, cluster, result)
    outcome = SearchOutcome(model=model, train=train, cluster=cluster, result=result, framework=framework_of(args),
                            objective=args.objective, top=args.top, failures=failures_from_args(args), goal=goal,
                            left_out=left_out, compared=comparisons(model, train, cluster, result, args.objective),
                            exported=None, cost=cost)
    if args.report:   # with --json too: stdout holds the JSON, the report goes to its directory
        write_report_dir(args.report, args.overwrite, model, train, cluster, best.plan, best.estimate,
                         runners_up=[(f.plan, f.estimate) for f in result.plans[1:]],
                         candidates=[f.estimate for f in result.evaluated], runner_up_text=outcome.runner_up_text)
    outcome = replace(outcome, exported=_export_best(args, model, train, cluster, best.plan))
    if args.json:
        emit_json(search_json(outcome))
    else:
        print_search(outcome)
    return 0


def _within_limits(args: argparse.Namespace, model, train, cluster, result: SearchResult) -> tuple[RunGoal | None, str]:
    """--tokens: the run every row is priced for, and the rows cut to those within --deadline-days
    and --budget-usd (planner.objective), with the line saying how many were left out."""
    if args.tokens is None:
        return None, ""
    goal = RunGoal(tokens=args.tokens, gpu_hour_usd=args.gpu_hour_usd, deadline_days=args.deadline_days,
                   budget_usd=args.budget_usd, failures=failures_from_args(args))
    decided = {f.plan for f in result.plans[:result.equivalent]}
    result.plans, left_out = keep_within(goal, model, train, cluster, result.plans, result.fastest)
    # the equivalent plans that are left: the first rows of those the search found alike
    result.equivalent = next((i for i, f in enumerate(result.plans) if f.plan not in decided), len(result.plans))
    return goal, left_out


def _export_best(args: argparse.Namespace, model, train, cluster, plan) -> dict | None:
    """search --export TARGET: the best plan in that framework's configuration (written to
    --export-out when given); None without --export."""
    if not args.export:
        return None
    from planner.commands.export import summary_lines, to_json
    from planner.exports import export_plan
    pf = PlanFile(plan=plan, model=model, train=train, cluster=cluster)
    result = export_plan(pf, args.export)
    if args.export_out is not None:
        outputs.write_file(args.export_out, result.text, args.overwrite)
    return {**to_json(result, pf, args.export_out), "summary": summary_lines(result, pf, args.export_out)}
