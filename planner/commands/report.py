"""`planner report`: the bubble and memory report of a plan, beside a measured run if given."""
from __future__ import annotations

import argparse
from pathlib import Path

from costmodel.check import check_structure
from costmodel.estimate import estimate
from costmodel.inputs import UserError, read_json_object
from costmodel.measured import MeasuredRun
from costmodel.plan import PLAN_FORMAT_VERSION, PlanFile
from planner import outputs
from planner.commands.common import load_plan, write_report_dir
from runtime.measure import priced_as_run


def cmd_report(args: argparse.Namespace) -> int:
    outputs.out_dir(args.out, "--out", args.overwrite, outputs.REPORT_FILES)
    pf = load_plan(Path(args.plan), "report")
    problems = check_structure(pf.model, pf.train, pf.cluster, pf.plan)
    if problems:
        raise UserError(f"{args.plan} is not a valid plan: " + "; ".join(problems))
    measured = None
    if args.measured:
        measured = MeasuredRun.load(Path(args.measured))
        if measured.plan != pf.plan.to_dict():
            raise UserError(f"{args.measured} was measured for another plan than {args.plan}: "
                            + _differences(measured.plan, pf.plan.to_dict()))
        _same_model_and_training(Path(args.measured), args.plan, pf)
    if measured is not None:   # a compiled run is compared with the compiled layers' estimate
        pf = priced_as_run(pf, measured.compiled)
    est = estimate(pf.model, pf.train, pf.cluster, pf.plan)
    write_report_dir(args.out, args.overwrite, pf.model, pf.train, pf.cluster, pf.plan, est, measured=measured)
    return 0


def _same_model_and_training(measured: Path, plan_path: str, pf: PlanFile) -> None:
    """A run's measured.json records its plan and its model's name; the plan.json `planner run`
    wrote beside it holds the model and training it ran: another width or sequence under the
    same name is refused too. (Its device is the report's: the run's may name another machine's path.)"""
    beside = measured.parent / "plan.json"
    if not beside.is_file():
        return
    data = read_json_object(beside, "plan file")
    if data.get("version") != PLAN_FORMAT_VERSION:   # a run of an older planner: its plan file is not read
        return
    if isinstance(data.get("cluster"), dict):
        data["cluster"] = pf.cluster.to_dict()
    ran = PlanFile.from_dict(data, str(beside))
    for what, theirs, ours in (("model", ran.model.to_dict(), pf.model.to_dict()),
                               ("training", ran.train.to_dict(), pf.train.to_dict())):
        if theirs != ours:
            raise UserError(f"{measured} was measured for another {what} than {plan_path} ({beside}): "
                            + _differences(theirs, ours))


def _differences(measured: dict, planned: dict, shown: int = 4) -> str:
    """The plan fields a measured run and a plan disagree on, the run's value first."""
    names = [k for k in dict.fromkeys([*planned, *measured]) if measured.get(k) != planned.get(k)]
    said = [f"{k} {measured.get(k)!r} there, {planned.get(k)!r} here" for k in names[:shown]]
    return "; ".join(said) + (f" (and {len(names) - shown} more fields)" if len(names) > shown else "")
