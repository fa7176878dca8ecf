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
    p.add_argument("--out", help="calibrated profile to write (default: NAME-calibrated.toml beside it)")
    add_overwrite_arg(p)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from planner.measure import profile_file
    from planner.measure.calibrate import (
        calibrated_profile,
        fit_by_dtype,
        load_run,
        merge_repeats,
        summary,
    )
    from reports.tables import table
    base = resolve_device(args.profile)
    base_path = Path(base.path)
    out = Path(args.out) if args.out else base_path.with_name(f"{base_path.stem}-calibrated.toml")
    if out.resolve() == base_path.resolve():
        raise UserError("--out must differ from the profile: calibration never overwrites it")
    outputs.out_file(out, "--out", args.overwrite, ".toml")
    if twice := [r for i, r in enumerate(args.runs) if Path(r).resolve() in {Path(q).resolve() for q in args.runs[:i]}]:
        raise UserError(f"{twice[0]} is given twice: one run counted as two repeats of its plan")
    runs = [load_run(Path(r)) for r in args.runs]
    for path, run in zip(args.runs, runs):   # timings of one kind of device say nothing of another's
        ran_on = run.pf.cluster.device
        if ran_on.kind != base.kind:
            raise UserError(f"{path} ran on {ran_on.name} (a {ran_on.kind}); it cannot calibrate {base.name} "
                            f"(a {base.kind}): calibrate a profile with runs measured on that device")
    loaded = [replace(r, pf=replace(r.pf, cluster=replace(r.pf.cluster, device=base))) for r in runs]
    runs = merge_repeats(loaded)
    before = summary(runs, base)
    repeats = f" of {len(runs)} plans (a plan's repeated runs by the geometric mean of their steps)" \
        if len(runs) < len(loaded) else ""
    print(f"fitting {len(loaded)} runs{repeats} ...", file=sys.stderr)
    device, params = fit_by_dtype(runs, base)
    device = replace(device, name=out.stem)
    after = summary(runs, device)
    command = "planner calibrate " + " ".join(sys.argv[2:]) if len(sys.argv) > 2 else "planner calibrate"
    try:
        profile_file.write(out, calibrated_profile(base_path, device, params, runs, before, after, command),
                           args.overwrite)
    except UserError as e:   # the fitted numbers, not the file: said as what the runs made of them
        detail = str(e).removeprefix(f"{out}: ")
        raise UserError(f"the runs fit {base.name} only with values outside their ranges ({detail}): they are "
                        "far from anything it can price; check that they ran on this machine, as their "
                        "measured.json says; nothing written") from None
    if len(runs) < MIN_RUNS:
        print(f"warning: a fit to {len(runs)} plan{'s' if len(runs) > 1 else ''} may not carry to others; "
              f"{MIN_RUNS} or more that differ (TP, PP, micro-batch) pin its factors down", file=sys.stderr)
    if after["mape_pct"] > POOR_FIT_PCT:
        print(f"warning: still {after['mape_pct']:.1f}% off on average after the fit: the profile cannot price "
              "these runs; measure again (an idle machine), or check that they ran here", file=sys.stderr)
    print(table(("step time", "before", "after"),
                [("MAPE", f"{before['mape_pct']:.1f}%", f"{after['mape_pct']:.1f}%"),
                 ("max |error|", f"{before['max_abs_error_pct']:.1f}%", f"{after['max_abs_error_pct']:.1f}%")]))
    print("fitted: " + ", ".join(f"{k} {v:.4g}" for k, v in params.items()))
    print(f"wrote {out}")
    return 0
