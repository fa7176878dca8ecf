"""The cost model against published runs, in sample and on sources it was not fitted on.

    python benchmarks/fidelity.py [RUNS.csv] [--fit]

Prints, per row, the error of `planner validate` with the profiles as shipped (in sample: the
profiles were fitted on this table) and the error when the row's whole source is left out of
the fit (`planner.measure.fit.leave_one_source_out`), then what the table covers (its measured
rows, those on 256 or more GPUs and those on H100-class devices: the H100 chip's fit, which the
H800, H200 and Blackwell parts borrow), both summaries, and the predicted
memory against the rows that state what they used, and the values of a fit on the whole
table that sit at a bound of their published range (a mechanism missing: the profiles then
hold those values inside it, each saying so), and the rows on 1,024 or more GPUs predicted by a
fit on the smaller runs alone (`leave_scale_out`: the model carried to the scale a planner is used
for), and the measured rows priced as a framework the model does not know
(planner.measure.unknown_framework: what stating the framework is worth). Last, for each family
of rows that differ only in their micro-batch count, a micro-batch's cost and what a step adds
once, measured and predicted (planner.measure.step_split). `--fit` also prints the
per-chip values a fit on the whole table gives (what profiles/*.toml hold, copied by hand).
About two minutes on a 2-core machine.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from planner.measure import fit
from planner.measure.runs_table import default_runs_path, read_runs
from planner.measure.step_split import step_splits
from planner.measure.unknown_framework import price_as_unknown, summary_line
from planner.measure.validate import step_time_error_pct, summarize, validate_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="?", default=None)
    parser.add_argument("--fit", action="store_true", help="print the whole-table fit per chip")
    args = parser.parse_args()
    path = Path(args.runs) if args.runs else default_runs_path()
    start = time.perf_counter()
    rows = read_runs(path)
    results = [validate_row(r) for r in rows]
    in_sample = summarize(results, rows)
    filled = fit.fill_rows(rows)
    loso = dict((r.row["id"], e) for r, e in fit.leave_one_source_out(
        filled, progress=lambda msg: print(msg, file=sys.stderr)))
    print(f"{'id':42} {'source':28} {'in-sample':>9} {'left out':>9}")
    for res, row in zip(results, rows):
        if res.error_pct is None:
            continue
        left = 100 * (math.exp(loso[row["id"]]) - 1)
        print(f"{row['id']:42} {row['source'][:28]:28} {step_time_error_pct(row, res.error_pct):+8.1f}% {left:+8.1f}%")
    held = fit.summary(list(loso.values()))
    measured, large, hopper, dies = fit.coverage(filled)
    print(f"\ntable: {measured} measured rows, {large} on 256 or more GPUs, {hopper} on H100-class devices "
          f"(the H100 chip's fit: {dies})")
    stepped = [step_time_error_pct(row, res.error_pct) for res, row in zip(results, rows) if res.error_pct is not None]
    print("\nerrors are of step time: + predicted too slow, - too fast")
    print(f"in sample (profiles as shipped): rows {in_sample['n']}  MAPE {in_sample['mape_pct']:.1f}%  "
          f"max |error| {in_sample['max_abs_error_pct']:.1f}% (of the published metric)  Spearman {in_sample['spearman']:.3f}  "
          f"status rows {in_sample['num_status_correct']}/{in_sample['num_status_rows']} correct  "
          f"measured rows predicted to fit {sum(r.fits for r in results if r.error_pct is not None)}/{in_sample['n']}")
    print(f"in sample, of step time: MAPE {sum(map(abs, stepped)) / len(stepped):.1f}%  "
          f"max |error| {max(map(abs, stepped)):.1f}%")
    print(f"leave one source out ({len({r.source for r in filled})} sources): rows {held['n']}  "
          f"MAPE {held['mape_pct']:.1f}%  max |error| {held['max_abs_error_pct']:.1f}% (of step time)")
    out = fit.scale_out_summary(filled)
    seen = out["in_sample"]
    print(f"fit on the runs below {fit.SCALE_OUT_GPUS:,} GPUs alone, the {out['n']} on {fit.SCALE_OUT_GPUS:,} or more "
          f"predicted: MAPE {out['mape_pct']:.1f}%  max |error| {out['max_abs_error_pct']:.1f}%  "
          f"mean {out['mean_error_pct']:+.1f}% (of step time; in sample: {seen['mape_pct']:.1f}%, "
          f"{seen['max_abs_error_pct']:.1f}%, {seen['mean_error_pct']:+.1f}%)")
    if in_sample["past_budget_ids"]:
        past = [(res.id, step_time_error_pct(row, res.error_pct)) for res, row in zip(results, rows)
                if res.past_budget is not None and res.error_pct is not None]
        print("fitting the device but past the budget the planner plans with (allocator's edge, unpriced): "
              + ", ".join(f"{rid} {err:+.1f}%" for rid, err in past))
    if in_sample["memory_rows"]:
        memory = [(row["id"], res.memory_error_pct) for res, row in zip(results, rows) if res.memory_error_pct is not None]
        print(f"memory, predicted allocator reservation against the {in_sample['memory_rows']} rows stating one and "
              f"every cell that sets it: MAPE {in_sample['memory_mape_pct']:.1f}%  mean "
              f"{in_sample['memory_mean_error_pct']:+.1f}% (- predicted too small): "
              + ", ".join(f"{i} {e:+.0f}%" for i, e in memory))
    print(summary_line(price_as_unknown(rows)))
    problems = in_sample["profile_problems"]
    print(f"fitted values outside their published ranges or at a bound: {len(problems)}"
          + "".join(f"\n  {p}" for p in problems))
    fitted = fit.fit_by_chip(filled)
    pinned = fit.at_bounds(filled, fitted)
    print(f"the whole table's fit at a bound of a published range (shipped values held inside): {len(pinned)}"
          + "".join(f"\n  {p}" for p in pinned))
    splits = step_splits(rows, results)
    print(f"\nfamilies at two or more micro-batch counts m (least squares t = a·m + b; errors + predicted too slow): {len(splits)}")
    for f in splits:
        print(f"  {f.label}: m {', '.join(map(str, f.micro_batches))}: a {f.measured_per_micro_batch_s:.4f} s measured, "
              f"{f.per_micro_batch_error_pct:+.1f}%; b {f.measured_per_step_s:.3f} s measured, "
              f"{f.per_step_error_s:+.3f} s")
    if args.fit:
        for name, values in fitted.items():
            print(f"fit on the whole table, {name}: " + ", ".join(f"{k} = {v:.4g}" for k, v in values.items()))
    print(f"({time.perf_counter() - start:.0f} s: python benchmarks/fidelity.py{' --fit' if args.fit else ''})")


if __name__ == "__main__":
    main()
