"""Plan quality: for every published run, search the same model, cluster, sequence length and
global batch, and compare the chosen plan with the published configuration (empty cells filled as
`planner validate` fills them), both priced by the cost model.

    python benchmarks/plan_quality.py [RUNS.csv] [--time-limit-s 20] [--ids ID ...] [--fix KEY=VALUE ...]

Prints, per row: predicted tokens/s of the published configuration and of the fastest plan, both
priced as our runtime would run them unless --as-published (its framework traits and memory margins: the gain is the
plan's, not another framework's kernels), the gain of the fastest and of the chosen plan (the
most robust within the model's error band), the published configuration's rank among the
search's top plans (">K" when it is not among them), and whether the search was proven optimal.
A published configuration is marked `*` where it does not fit under our memory margins and `†`
where our runtime cannot run it as published (costmodel.check.check_plan, e.g. float8 linears
with tensor parallelism): the search does not offer such a plan, so it may be priced faster. The
fastest plan must never be predicted slower than a published one that our runtime runs and fits.

`--as-published` prices both as the row's own framework runs them (its traits, the search's
memory budget) and searches the space that framework runs (`planner search --framework`: the row's
Megatron-LM or Megatron-Core as megatron, Megatron-DeepSpeed as deepspeed, torchtitan); rows of a
framework with no export target are skipped. Each row then prints the fastest plan against the
measured step, and the end lists the rows where the search claims more than 15 % over the
measured run: where a gain is the model's optimism until a run says otherwise.

`--fix` searches with a field fixed (`planner search --fix`'s fields; VALUE `published`: the row's
own configuration's value), to tell which choice a gain rests on, e.g. `--fix cp=1` or
`--fix tp=published`. `--ids`: only these rows. With either, each row also prints the fastest
plan's step time against the published run's measured one, and both runs' MFU and HFU (the
recomputed forward counted) over the dtype's dense peak.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from costmodel.check import check_plan
from costmodel.estimate import Estimate, estimate
from costmodel.hardware import parse_cluster
from planner.measure.fill import best_plan_for_row
from planner.measure.runs_table import metric_step_time_s, read_runs, row_specs
from planner.measure.validate import as_searched
from planner.search import SearchOptions, search
from planner.targets import options_for

TOP_K = 10
# the export target whose space a row's framework runs (--as-published)
TARGET_OF = {"megatron-core": "megatron", "megatron-lm": "megatron", "torchtitan": "torchtitan",
             "deepspeed": "deepspeed", "megatron-deepspeed": "deepspeed"}
CLAIM_FLAGGED = 0.15   # a predicted gain over the measured run this large is listed at the end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="?", default="profiles/runs/published_runs.csv")
    parser.add_argument("--time-limit-s", type=float, default=20.0)
    parser.add_argument("--ids", nargs="+", default=None, help="only these rows")
    parser.add_argument("--fix", nargs="+", default=[], metavar="KEY=VALUE",
                        help="fields fixed in the search (VALUE `published`: the row's own)")
    parser.add_argument("--as-published", action="store_true",
                        help="price and search as the row's own framework runs plans")
    args = parser.parse_args()
    fixes = dict(f.split("=", 1) for f in args.fix)
    print(f"{'id':28} {'published tok/s':>15} {'fastest tok/s':>12} {'gain':>6} {'chosen':>7} {'rank':>5} "
          f"{'proven':>6}  chosen plan (the most robust within the error band)")
    worse = unrunnable = 0
    flagged: list[str] = []
    for row in read_runs(Path(args.runs)):
        if args.ids is not None and row["id"] not in args.ids:
            continue
        target = TARGET_OF.get(row["framework"].strip().lower())
        if args.as_published and target is None:
            print(f"{row['id']:28} skipped: {row['framework']} has no export target")
            continue
        model, train, published_cluster = row_specs(row)
        plan, _, _ = best_plan_for_row(row, model, train, published_cluster)
        fixed = {k: getattr(plan, k) if v == "published" else int(v) for k, v in fixes.items()}
        options = SearchOptions(top_k=TOP_K, time_limit_s=args.time_limit_s, fixed=fixed)
        if args.as_published:
            cluster = as_searched(row, published_cluster)
            options = options_for(target, model, train, cluster, options)
        else:   # both priced as our runtime would run them, with the same memory margins: the gain
            # is the planner's, not another framework's kernels or overlap
            cluster = parse_cluster(f"{published_cluster.num_nodes}x{published_cluster.devices_per_node}x{row['gpu']}")
        published = estimate(model, train, cluster, plan)
        result = search(model, train, cluster, options)
        if not result.plans:
            print(f"{row['id']:28} {published.tokens_per_s:15,.0f} {'-':>12}  search found nothing")
            continue
        best = result.fastest.estimate
        chosen = result.plans[0]
        faster = [f for f in result.plans if f.estimate.step_time_s < published.step_time_s * (1 - 1e-9)]
        rank = f"{len(faster) + 1}" if len(faster) < TOP_K else f">{TOP_K}"
        runs = not check_plan(model, train, cluster, plan, memory=False)
        marks = ("" if published.fits else "*") + ("" if runs else "†")
        unrunnable += not runs
        worse += published.fits and runs and best.step_time_s > published.step_time_s * (1 + 1e-9)
        print(f"{row['id']:28} {published.tokens_per_s:15,.0f}{marks} "
              f"{best.tokens_per_s:12,.0f} {best.tokens_per_s / published.tokens_per_s - 1:+6.1%} "
              f"{chosen.estimate.tokens_per_s / published.tokens_per_s - 1:+7.1%} {rank:>5} "
              f"{str(result.stats.optimal):>6}  {chosen.plan.short()}")
        if (fixes or args.ids is not None or args.as_published) and row["metric_name"].strip() != "status":
            measured_s = metric_step_time_s(row, float(row["metric_value"]))
            if measured_s > best.step_time_s * (1 + CLAIM_FLAGGED):
                flagged.append(f"{row['id']} ({measured_s / best.step_time_s - 1:+.0%}: "
                               f"{result.fastest.plan.short()} against {plan.short()})")
            print(f"{'':28} fixed {fixed}: fastest {result.fastest.plan.short()}, {best.step_time_s:.2f} s "
                  f"against {measured_s:.2f} s measured ({measured_s / best.step_time_s - 1:+.1%}); "
                  f"{_utilizations(best, best.step_time_s)} against the measured run's "
                  # the FLOPs the published run executed: its own framework's (what its recomputation runs)
                  f"{_utilizations(estimate(model, train, published_cluster, plan), measured_s)}")
    print(f"\nfastest plan predicted slower than the published one: {worse} rows of those our runtime runs and fits "
          "(* : the published configuration does not fit under our memory margins; † : our runtime cannot run it "
          f"as published, {unrunnable} rows)")
    if args.as_published:
        print(f"\nthe search claims more than {CLAIM_FLAGGED:.0%} over the measured run: {len(flagged)} rows")
        print("".join(f"  {line}\n" for line in flagged), end="")
    print("command: " + " ".join(["python benchmarks/plan_quality.py", *sys.argv[1:]]))


def _utilizations(est: Estimate, step_s: float) -> str:
    """MFU and HFU (the recomputed forward counted) of the estimated plan had it taken `step_s`:
    what a gain claims of the hardware, beside what the published run reached."""
    scale = est.step_time_s / step_s
    return f"MFU {est.mfu * scale:.3f} / HFU {est.hfu * scale:.3f}"


if __name__ == "__main__":
    main()
