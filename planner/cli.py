"""The `planner` command line: the parser, dispatch to planner/commands/, and how a command ends.

A user's mistake (costmodel.inputs.UserError, argparse's errors) is one line on stderr, exit 2.
Any other exception is a bug: one line naming it a bug and the file its traceback was written
to, exit 1. An output that could not be written (a full disk, a closed standard output) is one
line naming it, exit 1. Ctrl-C and SIGTERM end with 130 and 143."""
from __future__ import annotations

import argparse
import errno
import os
import sys
import tempfile
import traceback
from pathlib import Path

from costmodel.inputs import UserError
from costmodel.machine import LocalProfileMissing
from planner import outputs, streams
from planner.args import (
    EXIT_STOPPED,
    EXIT_USAGE,
    Parser,
    Stopped,
    add_failure_args,
    add_overwrite_arg,
    given_flags,
    positive_float,
    refuse_repeated,
)
from planner.commands.common import add_framework_arg, add_plan_args, add_train_args
from planner.commands.listing import cmd_devices, cmd_models
from planner.commands.predict import EPILOG_PREDICT, cmd_predict
from planner.commands.report import cmd_report
from planner.commands.search import cmd_search
from planner.commands.validate import cmd_validate
from planner.signals import Terminated, held_while_loading, terminate_as_exception


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="planner", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Plan, predict, run, measure and calibrate parallel training of large language models.",
        epilog="start with: planner search --model llama-70b --cluster 8x8xA100 --report out/llama-70b")
    parser.add_argument("--version", action="version", version=f"planner {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    raw = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("predict", help="estimate one plan: step time ledger and memory per stage",
                       epilog=EPILOG_PREDICT, formatter_class=raw)
    add_train_args(p)
    add_framework_arg(p)
    add_plan_args(p)
    p.add_argument("--plan", help="read the plan and its specs from plan.json instead")
    p.add_argument("--out", help="write the plan with its specs to this plan.json")
    add_overwrite_arg(p)
    p.add_argument("--json", action="store_true",
                   help='print {"plan", "framework", "estimate", "error_band", "error_band_note", "checkpoint", "relaid": '
                        'the same degrees laid out faster by simulation, or null} (and "training" with --tokens) as JSON '
                        'on stdout')
    add_failure_args(p)
    from planner.commands.search import add_cost_args
    add_cost_args(p)
    p.set_defaults(parser=p, func=cmd_predict)

    p = sub.add_parser("search", help="the fastest plan that fits, exact under the cost model",
                       formatter_class=raw, epilog="""examples:
  planner search --model llama3-8b --cluster 1x8xH100
  planner search --model llama-70b --cluster 8x8xA100 --fix pp=4 --zero 1 --top 10 --out plan.json
  planner search --model llama-70b --cluster 8x8xA100 --objective memory --json
  planner search --model llama-70b --cluster 4x8xA100+4x8xH100 --report out/mixed   (a mixed cluster)""")
    add_train_args(p)
    add_framework_arg(p)
    from planner.commands.search import add_search_args
    add_search_args(p)
    add_failure_args(p)
    p.set_defaults(parser=p, func=cmd_search)

    from planner.commands.sweep import EPILOG as SWEEP_EPILOG
    from planner.commands.sweep import add_sweep_args, cmd_sweep
    p = sub.add_parser("sweep", help="the best plan per cluster size and device: days, GPU-hours and cost of a run",
                       epilog=SWEEP_EPILOG, formatter_class=raw)
    add_sweep_args(p)
    add_failure_args(p)
    p.set_defaults(parser=p, func=cmd_sweep)

    p = sub.add_parser("validate", help="predicted vs published step time for measured runs (CSV)",
                       description="tp, pp and global_batch are required; the other empty plan cells "
                                   "(micro_batch, recompute, vpp, sp, zero_stage) are filled with the "
                                   "planner's best choice (vpp = "
                                   "interleaved: the schedule stated, V not; V >= 2 is searched); "
                                   "status=OOM rows are right when the plan is predicted not to fit (judged "
                                   "at the device's limit; a run past the budget the search plans with is "
                                   "said: its speed at the allocator's edge is not priced). Each "
                                   "row is priced as its framework runs plans; a framework the model does "
                                   "not know gets generic traits, and the summary names it.")
    p.add_argument("runs", nargs="?", default=None,
                   help="table in the format of profiles/runs/published_runs.csv (default: that table)")
    p.add_argument("--json", action="store_true", help='print {"rows", "summary"} as JSON')
    p.add_argument("--time-limit", type=positive_float, default=600.0, metavar="S",
                   help="stop after S seconds in all with one line (default 600; a row with unstated "
                        "fields is searched for up to 20 s)")
    p.set_defaults(parser=p, func=cmd_validate)

    p = sub.add_parser("report", help="bubble and memory report of a plan (PNG/SVG, index.html/md)",
                       formatter_class=raw, epilog="""examples:
  planner report plan.json --out out/my-plan
  planner report plan.json --measured out/run/measured.json --out out/my-plan   (predicted beside measured)""")
    p.add_argument("plan", help="plan.json (from search --out or predict --out)")
    p.add_argument("--measured", help="measured.json from `planner run` of this plan")
    p.add_argument("--out", required=True, help="directory for the report: index.html (one self-contained "
                                                "interactive page), index.md and PNG/SVG figures")
    add_overwrite_arg(p)
    p.set_defaults(parser=p, func=cmd_report)

    from planner.commands.profile import EPILOG as PROFILE_EPILOG
    from planner.commands.profile import add_profile_args, cmd_profile
    p = sub.add_parser("profile", help="measure this machine (GEMM, memory, collectives) into a device profile",
                       epilog=PROFILE_EPILOG, formatter_class=raw)
    add_profile_args(p)
    p.set_defaults(parser=p, func=cmd_profile)

    from planner.commands.calibrate import EPILOG as CAL_EPILOG
    from planner.commands.calibrate import add_calibrate_args, cmd_calibrate
    p = sub.add_parser("calibrate", help="fit a profile's efficiencies to measured runs (writes a new profile)",
                       epilog=CAL_EPILOG, formatter_class=raw)
    add_calibrate_args(p)
    p.set_defaults(parser=p, func=cmd_calibrate)

    from planner.commands.export import EPILOG as EXPORT_EPILOG
    from planner.commands.export import add_export_args, cmd_export
    p = sub.add_parser("export", help="a plan as torchtitan, Megatron-LM or DeepSpeed take it (nearest plan where "
                                      "they cannot say it)", epilog=EXPORT_EPILOG, formatter_class=raw)
    add_export_args(p)
    p.set_defaults(parser=p, func=cmd_export)

    from planner.commands.run import cmd_run
    from planner.commands.run_args import EPILOG as RUN_EPILOG
    from planner.commands.run_args import add_run_args
    p = sub.add_parser("run", help="execute a plan with torch.distributed, measure it, compare with the estimate",
                       epilog=RUN_EPILOG, formatter_class=raw)
    add_run_args(p)
    p.set_defaults(parser=p, func=cmd_run)

    for name, func, text in (("models", cmd_models, "list the known models"),
                             ("devices", cmd_devices, "list the known device profiles")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--json", action="store_true", help=f"print {{\"{name}\": [...]}} as JSON, every field of each")
        p.set_defaults(parser=p, func=func)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("planner")
    except PackageNotFoundError:   # run from a source tree that was never installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    """The command's exit code; 1 where it would be 0 but its standard error could not be written
    (closed or full: what it had to say is lost, planner.streams.QuietStderr)."""
    with streams.quiet_stderr() as stderr:
        code = _main(list(sys.argv[1:] if argv is None else argv))
    return 1 if code == 0 and stderr.failed else code


def _main(argv: list[str]) -> int:
    who = f"planner {argv[0]}" if argv and not argv[0].startswith("-") else "planner"
    try:
        with terminate_as_exception():
            with held_while_loading():
                parser = build_parser()
            with streams.guarded_stdout():
                try:
                    args, extra = parser.parse_known_args(argv)
                    if extra:   # said by the subcommand, whose --help lists what it takes
                        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
                except SystemExit as exc:   # --help (0) or a usage error, already printed (2)
                    return _flushed(who, exc.code if isinstance(exc.code, int) else EXIT_USAGE)
                except outputs.WriteFailed as exc:   # --help into a closed or full standard output
                    return write_failed(who, exc)
                return _flushed(who, _dispatch(args, argv))
    except KeyboardInterrupt as exc:
        return _interrupted(who, exc, "interrupted", 130)
    except Terminated as exc:
        return _interrupted(who, exc, "terminated", 143)


def _interrupted(who: str, exc: BaseException, what: str, code: int) -> int:
    try:   # what was printed before the signal; a failing standard output must not end it a second time
        if sys.stdout is not None:
            sys.stdout.flush()
    except OSError:
        streams.silence_stdout()
    notes = "; ".join(getattr(exc, "__notes__", []))
    print(f"{who}: {what}" + (f"; {notes}" if notes else ""), file=sys.stderr)
    return code


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        args.given = given_flags(args.parser, argv[1:])
        refuse_repeated(args.parser, args.given)
        try:
            return args.func(args)
        except LocalProfileMissing as missing:
            # `local` is this machine: measured on first use, cached, then the command again
            print(f"planner {args.command}: {missing.reason}; measuring this machine once "
                  f"(about a minute, cached in {missing.path})", file=sys.stderr)
            from planner.commands.profile import measure_local
            measure_local()
            return args.func(args)
    except argparse.ArgumentError as exc:
        print(f"planner {args.command}: error: {exc} (see planner {args.command} --help)", file=sys.stderr)
        return EXIT_USAGE
    except UserError as exc:
        print(f"planner {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Stopped as exc:
        notes = "".join(f"; {n}" for n in getattr(exc, "__notes__", []))
        print(f"planner {args.command}: stopped: {exc}{notes}", file=sys.stderr)
        return EXIT_STOPPED
    except outputs.WriteFailed as exc:
        return write_failed(f"planner {args.command}", exc)
    except OSError as exc:
        if exc.errno in PATH_ERRNOS and exc.filename:   # a path the user gave that the system cannot take
            print(f"planner {args.command}: error: {exc.filename}: {exc.strerror}", file=sys.stderr)
            return EXIT_USAGE
        return report_bug(f"planner {args.command}", exc)
    except Exception as exc:   # anything else is ours to fix, never the user's mistake
        return report_bug(f"planner {args.command}", exc)


EXIT_WRITE = 1
# what a path given on the command line can make the system refuse, wherever the command first
# touches it: a name over the file system's limit, a symbolic link loop
PATH_ERRNOS = (errno.ENAMETOOLONG, errno.ELOOP)


def _flushed(who: str, code: int) -> int:
    """`code`, once what the command printed has reached standard output (a pipe or a file holds
    it in a buffer until here)."""
    try:
        sys.stdout.flush()
    except outputs.WriteFailed as exc:
        return write_failed(who, exc)
    return code


def write_failed(who: str, exc: outputs.WriteFailed) -> int:
    """One line naming what could not be written and why, exit 1; a reader that stopped reading
    standard output (`| head -1`) ends the command quietly, as other tools do."""
    if exc.where == streams.STDOUT:
        streams.silence_stdout()
        if exc.errno == errno.EPIPE:
            return 0
    print(f"{who}: error: {exc}", file=sys.stderr)
    return EXIT_WRITE


EXIT_BUG = 1


def report_bug(who: str, exc: BaseException) -> int:
    """One line naming `exc` a bug, where it was raised and the file its traceback went to."""
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
    text = "".join(traceback.format_exception(exc))
    try:
        fd, path = tempfile.mkstemp(prefix="planner-bug-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"{who} {' '.join(sys.argv[1:])}\n\n{text}")
        saved = f"traceback in {path}"
    except OSError as write_error:
        saved = f"the traceback could not be written ({write_error.strerror})"
    print(f"{who}: internal error, a bug in the planner (not in your input): {type(exc).__name__}: {exc}{where}; "
          f"{saved}; please report it", file=sys.stderr)
    return EXIT_BUG


if __name__ == "__main__":   # `python -m planner.cli`, as `python -m planner` runs
    from planner.__main__ import entry
    sys.exit(entry())
