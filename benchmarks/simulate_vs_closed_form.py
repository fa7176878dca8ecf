"""How far the closed-form pipeline (the search's surrogate) is from the event simulation when
stages are not uniform: random per-stage forward / backward / weight-gradient costs.

    python benchmarks/simulate_vs_closed_form.py [--trials 3000] [--seed 1]

Prints, per schedule, the range of simulated / closed-form pipeline time. On uniform stages the
two are equal (tests/costmodel/test_simulate.py); below 1 the simulation is faster.
"""
from __future__ import annotations

import argparse
import random
from dataclasses import replace

from costmodel.pipeline_closed_form import pipeline_time_s
from costmodel.plan import Schedule
from costmodel.pipeline_simulation import StageCost, simulate
from costmodel.rank_time import RankTimes
from planner.space import degrees_plan


def trial(rng: random.Random) -> tuple[Schedule, float]:
    s = rng.choice([Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED, Schedule.ZB_H1])
    p = rng.choice([2, 3, 4, 8])
    v = rng.choice([2, 3]) if s is Schedule.INTERLEAVED else 1
    m = p * rng.choice([1, 2, 4, 8]) if s is Schedule.INTERLEAVED else rng.choice([p, p + 1, 2 * p, 4 * p, 16])
    plan = replace(degrees_plan(dp=1, tp=1, pp=p, cp=1, num_micro_batches=m, num_layers=p * v),
                   schedule=s, vpp=v, layers_per_stage=(1,) * (p * v))
    costs = []
    for _ in range(p * v):
        f = rng.uniform(0.5, 2)
        b = f * rng.uniform(1.5, 2.5)
        costs.append(StageCost(forward_s=f, recompute_s=0, backward_s=b, backward_weight_s=b * rng.uniform(0.3, 0.6),
                               send_s=0, activation_bytes=1, transient_bytes=0))
    ranks = []
    for r in range(p):
        cs = [costs[j] for j in range(p * v) if plan.stage_rank(j) == r]
        ranks.append(RankTimes(forward_s=sum(c.forward_s for c in cs), backward_s=sum(c.backward_s for c in cs),
                               backward_weight_s=sum(c.backward_weight_s for c in cs), recompute_s=0,
                               tp_comm_s=0, cp_comm_s=0, pp_comm_s=0))
    return s, simulate(plan, costs, keep_events=False).time_s / pipeline_time_s(plan, ranks)[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    ratios: dict[str, list[float]] = {}
    for _ in range(args.trials):
        schedule, ratio = trial(rng)
        ratios.setdefault(str(schedule), []).append(ratio)
    print(f"{'schedule':<18}{'trials':>8}{'min sim/closed':>16}{'max sim/closed':>16}")
    for name, values in sorted(ratios.items()):
        print(f"{name:<18}{len(values):>8}{min(values):>16.3f}{max(values):>16.3f}")
    print(f"command: python benchmarks/simulate_vs_closed_form.py --trials {args.trials} --seed {args.seed}")


if __name__ == "__main__":
    main()
