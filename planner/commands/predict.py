"""`planner predict`: one plan's step-time ledger and memory per stage."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from costmodel.check import check_memory, check_structure
from costmodel.estimate import estimate
from costmodel.fidelity import error_band, long_sequence_note
from costmodel.inputs import UserError
from costmodel.plan import PlanFile
from planner import outputs
from planner.args import failures_from_args, refuse_ignored
from planner.commands.common import (
    choice_from_args,
    emit_json,
    framework_of,
    load_plan,
    print_training_note,
    specs_from_args,
)
from planner.commands.search import training_cost_of
from planner.relayout import hint_line, layout_hint
from planner.search_options import SearchOptions
from planner.space import build_plan
from planner.targets import default_zero_stage, has_sequence_parallel, name_for, options_for, refuse_unless_runs

# predict --plan takes all of these from the file
# what --plan leaves a flag to say: where the plan file goes, the output's form, and the run it is
# priced for (its tokens, price and failures); every other flag sets a spec or the plan
WITH_PLAN_FILE = {"plan", "out", "overwrite", "json", "tokens", "gpu_hour_usd", "device_mtbf_hours",
                  "storage_mb_s_per_device"}


EPILOG_PREDICT = """examples:
  planner predict --model llama-70b --cluster 8x8xA100 --tp 8 --pp 4 --zero 1 --recompute selective --mbs 1
  planner predict --model llama3-8b --cluster 1x8xH100 --tp 2 --json
  planner predict --plan plan.json            (the specs recorded in the plan file)

exit status: 0 when the plan fits; 2 for a bad flag or file, and for a plan that does not fit
(its figures are printed first, the reason last, and no --out file is written)
"""


def cmd_predict(args: argparse.Namespace) -> int:
    if not args.out:
        refuse_ignored(args.given, {"overwrite"}, "without --out nothing is written")
    out = outputs.out_file(args.out, "--out", args.overwrite, ".json")
    if args.plan == "":
        raise UserError("--plan is empty")
    if args.plan:
        refuse_ignored(args.given, set(args.given) - WITH_PLAN_FILE, "--plan takes the model, cluster, training and plan "
                       "from the file (leave out --plan to give them as flags)")
        pf = load_plan(Path(args.plan), "predict")
        model, train, cluster, plan = pf.model, pf.train, pf.cluster, pf.plan
    else:
        model, train, cluster = specs_from_args(args)
        if not cluster.is_mixed:
            refuse_ignored(args.given, {"group_order", "group_mbs"},
                           f"it is for a mixed cluster (groups joined by +), and {args.cluster} has one group")
        name = framework_of(args)
        choice = choice_from_args(args, default_zero_stage(name, args.pp),
                                  has_sequence_parallel(name, model, train, cluster))
        plan = build_plan(model, train, cluster, choice)
    problems = check_structure(model, train, cluster, plan)
    if problems:
        raise UserError((f"{args.plan} is not a valid plan: " if args.plan else "invalid plan: ") + "; ".join(problems))
    refuse_unless_runs(name_for(cluster.framework), model, train, cluster, plan)
    est = estimate(model, train, cluster, plan)
    if not args.plan:
        print_training_note(args, model, train)
    cost = training_cost_of(args, model, train, cluster, est)
    over = check_memory(model, train, cluster, plan)
    if out and not over:   # a plan that does not fit is an error: no plan file is written for it
        pf = PlanFile(plan=plan, model=model, train=train, cluster=cluster)
        outputs.write_file(out, outputs.json_text(pf.to_dict()), args.overwrite)
        print(f"wrote {out}", file=sys.stderr)
    # a faster layout of the same degrees, where the descent finds one (planner.relayout)
    hint = None if over else layout_hint(model, train, cluster, options_for(
        name_for(cluster.framework), model, train, cluster, SearchOptions()), plan, est)
    if args.json:
        from costmodel.resilience import checkpoint_cost
        emit_json({"plan": plan.to_dict(), "framework": name_for(cluster.framework), "estimate": est.to_dict(),
                   "relaid": None if hint is None else {"plan": hint.plan.to_dict(), "estimate": hint.estimate.to_dict()},
                   "error_band": error_band(cluster)[0], "error_band_note": long_sequence_note(train.seq_len, cluster),
                    "checkpoint": checkpoint_cost(model, train, cluster.world_size, est.step_time_s,
                                                  est.tokens_per_s, failures_from_args(args)).to_dict(),
                   **({} if cost is None else {"training": cost.to_dict()})})
    else:
        from reports.tables import ledger_table, memory_table, summary_lines
        print(summary_lines(model, train, cluster, plan, est, failures_from_args(args)))
        if hint is not None:
            print(hint_line(plan, est, hint))
        if cost is not None:
            from costmodel.training_cost import summary_line
            print(summary_line(cost))
        print()
        print(ledger_table(est))
        print()
        print(memory_table(est))
    if over:
        raise UserError("plan does not fit: " + "; ".join(over) + (f" ({out} not written)" if out else ""))
    return 0
