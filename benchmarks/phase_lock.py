"""Phase lock of interleaved 1F1B: the event simulator's steady period per micro-batch against
the two closed forms, on synthetic pipelines (the mechanism planner.relayout mends).

    python benchmarks/phase_lock.py

Every virtual stage costs 1 (forward 1/3, backward 2/3, no sends) but the last rank's: its last
stage is heavy (an output head, a loss, MTP modules), its others sometimes lighter (the search's
split balances rank totals by giving that rank fewer layers). Printed per case: the rank form
max_r sum_c t_rc the search's closed form uses, the phase form sum_c max_r t_rc, and the
simulated period (the step's growth per micro-batch between 16·pp and 32·pp micro-batches).
Then the same over stages jittered by up to 20 % each, where the rank form stays within a few per
cent and the phase form does not. A heavy stage costs the period more than its rank's total says,
and a rank's light stages give back only a fraction of a stage: neither form is the period.
"""
from __future__ import annotations

import random
from dataclasses import replace
from functools import lru_cache

from costmodel.pipeline_simulation import StageCost, simulate
from costmodel.plan import Plan
from costmodel.schedules import Schedule
from planner.space import Choice, build_plan
from planner.specs import build_specs

# (pp, vpp, the last rank's stage costs)
CASES = [(pp, v, last) for pp, v in ((2, 2), (4, 2), (4, 3), (8, 4))
         for last in ([1.0] * (v - 1) + [2.0], [0.5] + [1.0] * (v - 2) + [2.0], [0.5] * (v - 1) + [2.5],
                      [0.25] * (v - 1) + [1.75])]


def period_s(pp: int, vpp: int, stage_s: list[float]) -> float:
    """The simulated step's growth per micro-batch, `stage_s` per virtual stage in pipeline order
    (stage j on rank j % pp)."""
    def step_s(m: int) -> float:
        plan = replace(_interleaved(), pp=pp, vpp=vpp, num_micro_batches=m, layers_per_stage=(1,) * (pp * vpp),
                       recompute_num_layers=(0,) * pp, dp=1)
        costs = [StageCost(forward_s=t / 3, recompute_s=0.0, backward_s=2 * t / 3, backward_weight_s=t / 3,
                           send_s=0.0, activation_bytes=0.0, transient_bytes=0.0) for t in stage_s]
        return simulate(plan, costs, keep_events=False).time_s
    return (step_s(32 * pp) - step_s(16 * pp)) / (16 * pp)


@lru_cache(maxsize=1)
def _interleaved() -> Plan:
    """An interleaved plan whose degrees, micro-batches and stages each case replaces."""
    model, train, cluster = build_specs("llama-70b", "8x8xH100", seq_len=4096, global_batch=64)
    return build_plan(model, train, cluster, Choice(tp=8, pp=2, vpp=2, schedule=Schedule.INTERLEAVED))


def forms(pp: int, vpp: int, stage_s: list[float]) -> tuple[float, float]:
    """(rank form, phase form) of per-stage costs in pipeline order."""
    rows = [[stage_s[c * pp + r] for c in range(vpp)] for r in range(pp)]
    return max(map(sum, rows)), sum(max(rows[r][c] for r in range(pp)) for c in range(vpp))


def main() -> None:
    print(f"{'pp':>3} {'v':>2}  {'last rank':<24} {'rank form':>9} {'phase form':>10} {'simulated':>9}")
    for pp, v, last in CASES:
        stage_s = [1.0] * (pp * v)
        for c, t in enumerate(last):
            stage_s[c * pp + pp - 1] = t
        rank, phase = forms(pp, v, stage_s)
        print(f"{pp:>3} {v:>2}  {str(last):<24} {rank:>9.3f} {phase:>10.3f} {period_s(pp, v, stage_s):>9.3f}")
    rng, worst_rank, worst_phase = random.Random(1), 0.0, 0.0
    for _ in range(12):
        pp, v = rng.choice([(4, 2), (4, 3), (8, 4)])
        stage_s = [rng.uniform(0.8, 1.2) for _ in range(pp * v)]
        rank, phase = forms(pp, v, stage_s)
        simulated = period_s(pp, v, stage_s)
        worst_rank, worst_phase = max(worst_rank, abs(rank / simulated - 1)), max(worst_phase, abs(phase / simulated - 1))
    print(f"every stage jittered by up to 20 % (12 pipelines): largest |error| of the rank form "
          f"{100 * worst_rank:.1f} %, of the phase form {100 * worst_phase:.1f} %")


if __name__ == "__main__":
    main()
