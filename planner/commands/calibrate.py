"""`planner calibrate RUN_DIRS... --profile P --out Q`: fit the profile to measured runs."""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from costmodel.hardware import resolve_device
from costmodel.inputs import UserError
from planner import outputs
from planner.args import add_overwrite_arg

EPILOG = """examples:
  planner calibrate runs/* --profile local --out mine-calibrated.toml

`--profile local` is this machine's cached profile (`planner profile`). The calibrated profile is
a new file, never the original; then plan with --cluster 1x2xmine-calibrated.toml."""


POOR_FIT_PCT = 15.0   # a fit still this far off, on average, is no calibration to trust
MIN_RUNS = 3          # fewer runs than this leave most factors at their priors


def add_calibrate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", help="run directories written by `planner run --out`")
    p.add_argument("--profile", required=True, help="the profile to calibrate (name or .toml path)")
    p.add_argument("--out", help="calibrated profile to write (default: NAME-calibrated.toml beside it; for a "
                                 "shipped profile, in the current directory)")
    add_overwrite_arg(p)


def _default_out(base_path: Path) -> Path:
    """NAME-calibrated.toml beside the profile, or in the current directory for a shipped one
    (the installed package's directory is no place for a user's file)."""
    from costmodel.hardware.profile_io import profile_dir
    name = f"{base_path.stem}-calibrated.toml"
    return Path(name) if base_path.parent.resolve() == profile_dir().resolve() else base_path.with_name(name)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from planner.measure.calibrate import fit_by_dtype, summary
    from planner.measure.calibrated_profile import calibrated_profile
    from planner.measure.run_dirs import merge_repeats
    from reports.tables import table
    base = resolve_device(args.profile)
    base_path = Path(base.path)
    out = Path(args.out) if args.out else _default_out(base_path)
    if out.resolve() == base_path.resolve():
        raise UserError("--out must differ from the profile: calibration never overwrites it")
    # without --out the default path is named as such: the user never typed it
    outputs.out_file(out, "--out" if args.out else "the default --out (NAME-calibrated.toml beside the profile)",
                     args.overwrite, ".toml")
    loaded = _load_runs(args.runs, base)
    runs = merge_repeats(loaded)
    before = summary(runs, base)
    repeats = f" of {len(runs)} plans (a plan's repeated runs by the geometric mean of their steps)" \
        if len(runs) < len(loaded) else ""
    print(f"fitting {len(loaded)} runs{repeats} ...", file=sys.stderr)
    device, params = fit_by_dtype(runs, base)
    device = replace(device, name=out.stem)
    after = summary(runs, device)
    command = "planner calibrate " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "planner calibrate"
    _write(out, calibrated_profile(base_path, device, params, runs, before, after, command), base.name,
           args.overwrite)
    _warn_of_a_weak_fit(len(runs), after["mape_pct"])
    print(table(("step time", "before", "after"),
                [("MAPE", f"{before['mape_pct']:.1f}%", f"{after['mape_pct']:.1f}%"),
                 ("max |error|", f"{before['max_abs_error_pct']:.1f}%", f"{after['max_abs_error_pct']:.1f}%")]))
    print("fitted: " + ", ".join(f"{k} {v:.4g}" for k, v in params.items()))
    print(f"wrote {out}")
    return 0


def _load_runs(paths: list[str], base):
    """The run directories, once each, measured on the profile's kind of device, read under it."""
    from planner.measure.run_dirs import load_run
    if twice := [r for i, r in enumerate(paths) if Path(r).resolve() in {Path(q).resolve() for q in paths[:i]}]:
        raise UserError(f"{twice[0]} is given twice: one run counted as two repeats of its plan")
    # read under the profile being calibrated: the profile a run's plan.json names is a path on
    # the machine and in the directory it ran from, and its figures are the ones being replaced
    runs = [load_run(Path(r), device=Path(base.path), kind=base.kind) for r in paths]
    for run in runs:
        if run.measured.warmup_steps:
            continue
        if run.compiled:   # its first timed step compiled every layer: seconds to minutes, no step's cost
            raise UserError(f"{run.path}: a compiled run without a warm-up step timed the layers' compilation in "
                            "its first step; calibrate on a run from step 0 with --warmup 1 or more")
        print(f"warning: {run.path} ran no warm-up step: its first timed step carries the start-up costs, which "
              "bias the fit slow (calibrate on a run from step 0 with --warmup 1 or more: a resumed run takes "
              "none)", file=sys.stderr)
    return runs


def _write(out: Path, doc, base_name: str, overwrite: bool) -> None:
    """The calibrated profile, once the reader takes it: fitted values outside their ranges are
    the runs' doing (said so, not as a fault of the file being written)."""
    from planner.measure import profile_file
    try:
        profile_file.checked(out, doc)
    except UserError as e:
        detail = str(e).removeprefix(f"{out}: ")
        raise UserError(f"the runs fit {base_name} only with values outside their ranges ({detail}): they are "
                        "far from anything it can price; check that they ran on this machine, as their "
                        "measured.json says; nothing written") from None
    profile_file.write(out, doc, overwrite)


def _warn_of_a_weak_fit(num_plans: int, after_mape_pct: float) -> None:
    if num_plans < MIN_RUNS:
        print(f"warning: a fit to {num_plans} plan{'s' if num_plans > 1 else ''} may not carry to others; "
              f"{MIN_RUNS} or more that differ (TP, PP, micro-batch) pin its factors down", file=sys.stderr)
    if after_mape_pct > POOR_FIT_PCT:
        print(f"warning: still {after_mape_pct:.1f}% off on average after the fit: the profile cannot price "
              "these runs; measure again (an idle machine), or check that they ran here", file=sys.stderr)
