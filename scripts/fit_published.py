"""Fit each GPU chip's efficiency parameters on the published runs table (planner.measure.fit).

    python scripts/fit_published.py [RUNS.csv]             fit, print values and per-row errors
    python scripts/fit_published.py [RUNS.csv] --evaluate  the profiles' current values, no fit
    python scripts/fit_published.py --hold H100:comm_contention
                                        one parameter held at its profile's value, the rest fitted
    python scripts/fit_published.py --release H100:kernel_overhead_s
                                        one the fit keeps by default fitted too

One bounded parameter set per chip (A100 40/80 GB together, H100 SXM5 and HBM2e together; each
chip's block lists the profiles whose rows it fitted), never per row, source or model; rows'
unstated fields are filled once by the search. Copying the values into profiles/*.toml is a
deliberate, reviewed step. `benchmarks/fidelity.py` judges the result on
sources left out of the fit.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from pathlib import Path

from costmodel.hardware.profile_check import bound_at
from costmodel.inputs import UserError
from planner.measure import fit
from planner.measure.runs_table import default_runs_path, read_runs


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="?", type=Path, default=None,
                    help="runs table (default: profiles/runs/published_runs.csv)")
    ap.add_argument("--evaluate", action="store_true",
                    help="price every row with the profiles' current values; fit nothing")
    ap.add_argument("--hold", action="append", default=[], metavar="CHIP:PARAM",
                    help="keep PARAM at the profiles' value for CHIP's fit (one the whole table pins at a "
                         "bound, held inside its range; the profiles say which), e.g. H100:inter_node_comm")
    ap.add_argument("--release", action="append", default=[], metavar="CHIP:PARAM",
                    help="fit PARAM for CHIP too, one the fit keeps at the profile's value by default "
                         "(kernel_overhead_s: the profiles say what the rows give it), e.g. H100:kernel_overhead_s")
    return ap.parse_args()


def _per_chip(items: list[str], flag: str, chips) -> dict[str, set[str]]:
    """CHIP:PARAM items of a flag, by chip; a malformed one ends the script with one line."""
    out = defaultdict(set)
    for item in items:
        name, _, param = item.partition(":")
        if name not in chips or param not in fit.PARAMS:
            sys.exit(f"fit_published: {flag} {item}: give CHIP:PARAM, CHIP one of {', '.join(sorted(chips))}, "
                     f"PARAM one of {', '.join(fit.PARAMS)}")
        out[name].add(param)
    return out


def main() -> None:
    args = parse_args()
    try:
        rows = fit.fill_rows(read_runs(args.runs or default_runs_path()))
    except UserError as e:
        print(f"fit_published: {e}", file=sys.stderr)
        sys.exit(2)
    by_chip = fit.by_chip(rows)
    held, released = _per_chip(args.hold, "--hold", by_chip), _per_chip(args.release, "--release", by_chip)
    for name, group in by_chip.items():
        kept, freed = frozenset(held[name]), frozenset(released[name])
        values = None if args.evaluate else fit.fit(group, held=kept, released=freed)
        errors = [r.log_error(values, simulate=True) for r in group]
        s = fit.summary(errors)
        print(f"\n== {name}: {s['n']} rows, MAPE {s['mape_pct']:.1f}%, max |error| {s['max_abs_error_pct']:.1f}%")
        print(f"  profiles: {', '.join(sorted({r.cluster.device.name for r in group}))}")
        fitted = fit.fitted_keys(group, kept, freed)
        for k, v in (values or fit.current_values(group[0].cluster)).items():
            low, high = fit.bounds_for(group[0].cluster)[k]
            edge = ("  (held)" if k in held[name] else "  (not fitted)" if k not in fitted else
                    "  (at its bound)" if bound_at(v, low, high) else "")
            print(f"  {k} = {v:.4g}{edge}")
        for r, e in zip(group, errors):
            print(f"    {r.row['id']:42s} {100 * (math.exp(e) - 1):+6.1f}% step time")


if __name__ == "__main__":
    main()
