"""`planner report`: the bubble and memory report of a plan, beside a measured run if given."""
from __future__ import annotations

import argparse
from pathlib import Path

from costmodel.check import check_structure
from costmodel.estimate import estimate
from costmodel.inputs import UserError
from costmodel.measured import MeasuredRun
from costmodel.plan import PlanFile
from planner import outputs
from planner.commands.common import write_report_dir


def cmd_report(args: argparse.Namespace) -> int:
    outputs.out_dir(args.out, "--out", args.overwrite, outputs.REPORT_FILES)
    pf = PlanFile.load(Path(args.plan))
    problems = check_structure(pf.model, pf.train, pf.cluster, pf.plan)
    if problems:
        raise UserError(f"{args.plan} is not a valid plan: " + "; ".join(problems))
    measured = None
    if args.measured:
        measured = MeasuredRun.load(Path(args.measured))
        if measured.plan != pf.plan.to_dict():
            raise UserError(f"{args.measured} was measured for another plan ({measured.plan})")
    est = estimate(pf.model, pf.train, pf.cluster, pf.plan)
    write_report_dir(args.out, args.overwrite, pf.model, pf.train, pf.cluster, pf.plan, est, measured=measured)
    return 0
