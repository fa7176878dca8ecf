"""Where one search spends its time, and how CP-SAT's attempts fare on its split models.

    python benchmarks/search_profile.py --model llama-70b --cluster 8x8xA100
    python benchmarks/search_profile.py --row sc21_t1_530 --top 10 --time-limit-s 60   # a published run
    python benchmarks/search_profile.py --row sc21_t1_530 --top 10 --only-attempt 2     # defaults alone

Prints the search's phases (candidates and their first bounds; memory checks; the pipeline
floor; the rest of each examination, CP-SAT included; re-pricing by simulation), then per CP-SAT
attempt (planner.partition.ATTEMPTS) how many models it was run on, how many it settled (optimal
or infeasible), its wall time and the largest deterministic time it used. The figures quoted in
planner/partition.py and the README's speed section come from this script.
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from costmodel.cluster import parse_cluster
from costmodel.registry import default_recipe, resolve_model
from costmodel.specs import TrainSpec
from ortools.sat.python import cp_model
from planner import partition, search
from planner.validate import read_runs, row_specs


def specs(args):
    if args.row:
        rows = {row["id"]: row for row in read_runs(Path(args.runs))}
        return row_specs(rows[args.row])
    model = resolve_model(args.model)
    seq, batch = default_recipe(model)
    return model, TrainSpec(seq_len=seq, global_batch_size=batch), parse_cluster(args.cluster)


def timed(table: dict, name: str, fn):
    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            table[name] += time.perf_counter() - start
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-70b")
    parser.add_argument("--cluster", default="8x8xA100")
    parser.add_argument("--row", help="a published run's id instead of --model/--cluster")
    parser.add_argument("--runs", default="profiles/runs/published_runs.csv")
    parser.add_argument("--time-limit-s", type=float, default=60.0)
    parser.add_argument("--top", type=int, default=5, help="plans ranked (plan_quality.py ranks 10)")
    parser.add_argument("--only-attempt", type=int, metavar="N",
                        help="run every split model with attempt N's parameters alone, unbudgeted "
                             "(to compare the attempts planner.partition.ATTEMPTS chains)")
    args = parser.parse_args()
    model, train, cluster = specs(args)
    if args.only_attempt is not None:
        partition.ATTEMPTS = [(partition.ATTEMPTS[args.only_attempt][0], None)]

    phases: dict[str, float] = defaultdict(float)
    search._branch_and_bound = timed(phases, "branch and bound", search._branch_and_bound)
    search._memory_entry = timed(phases, "  memory checks", search._memory_entry)
    search.SharedModels.pipeline_floor_s = timed(phases, "  pipeline floors", search.SharedModels.pipeline_floor_s)
    search._examine = timed(phases, "  examinations (floor, shapes, CP-SAT)", search._examine)
    search._result = timed(phases, "  re-pricing and ranking", search._result)

    attempts: dict[int, list] = defaultdict(list)  # attempt -> [(wall s, deterministic time, settled)]
    solve = partition._solve

    def recorded(cm, **kwargs):
        index = next(i for i, (params, budget) in enumerate(partition.ATTEMPTS)
                     if budget == kwargs.get("deterministic_limit") and all(kwargs.get(k) == v for k, v in params.items()))
        start = time.perf_counter()
        solver, status = solve(cm, **kwargs)
        attempts[index].append((time.perf_counter() - start, solver.response_proto.deterministic_time,
                                status in (cp_model.OPTIMAL, cp_model.INFEASIBLE)))
        return solver, status
    partition._solve = recorded

    start = time.perf_counter()
    result = search.search(model, train, cluster, search.SearchOptions(top_k=args.top, time_limit_s=args.time_limit_s))
    total = time.perf_counter() - start
    print(f"{model.name} on {cluster.name}: {total:.2f} s, {result.stats.num_candidates:,} candidates, "
          f"{result.stats.num_solved} solved, optimal {result.stats.optimal}")
    print(f"  candidates and first bounds          {total - phases['branch and bound']:6.2f} s")
    for name, seconds in phases.items():
        print(f"{name:40} {seconds:6.2f} s")
    print("CP-SAT attempt  parameters                                   runs  settled   wall s  max wall s  "
          "max det. time")
    for index, (params, budget) in enumerate(partition.ATTEMPTS):
        runs = attempts.get(index, [])
        shown = ", ".join(f"{k}={v}" for k, v in params.items()) or "defaults"
        print(f"{index:>14}  {shown + (f' (budget {budget})' if budget else ''):43} {len(runs):5} "
              f"{sum(s for _, _, s in runs):8} {sum(w for w, _, _ in runs):8.2f} "
              f"{max((w for w, _, _ in runs), default=0.0):11.2f} {max((d for _, d, _ in runs), default=0.0):14.3f}")


if __name__ == "__main__":
    main()
