"""Pipeline simulator speed on the issue's case: llama3-405b, pp=16, 128 micro-batches,
interleaved 1F1B with v=4 (256x8xH100, tp=8, dp=16, micro-batch 1). Target: well under 50 ms.

    python benchmarks/simulate_speed.py [--repeat 20]

Prints the median wall time of: the per-stage costs, the simulation without and with the event
timeline (the search uses the former, the reports the latter), and a whole `estimate`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from costmodel.estimate import estimate
from costmodel.hardware import parse_cluster
from costmodel.pipeline_simulation import _CACHE, _simulate, simulate
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from costmodel.stage_costs import stage_costs
from planner.space import Choice, build_plan


def median_ms(fn, repeat: int) -> float:
    fn()  # warm caches (schedule orders, kernel times) as a search would have them
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    model, cluster = resolve_model("llama3-405b"), parse_cluster("256x8xH100")
    train = TrainSpec(seq_len=8192, global_batch_size=2048)
    plan = build_plan(model, train, cluster, Choice(tp=8, pp=16, vpp=4, micro_batch_size=1))
    assert (plan.pp, plan.num_micro_batches, plan.vpp) == (16, 128, 4)
    costs = stage_costs(model, train, plan, cluster)
    ops = sum(1 for _ in simulate(plan, costs).events)
    print(f"llama3-405b {plan.short()}: {plan.num_virtual_stages} virtual stages, {ops:,} timeline events")
    print(f"stage costs           {median_ms(lambda: stage_costs(model, train, plan, cluster), args.repeat):7.1f} ms")
    # the event loop itself, not costmodel.pipeline_simulation's cache of repeated plans
    print(f"simulate (totals)     {median_ms(lambda: _simulate(plan, costs, False), args.repeat):7.1f} ms")
    print(f"simulate (timeline)   {median_ms(lambda: _simulate(plan, costs, True), args.repeat):7.1f} ms")
    print(f"whole estimate        {median_ms(lambda: (_CACHE.clear(), estimate(model, train, cluster, plan)), args.repeat):7.1f} ms")
    print("command: " + " ".join(["python benchmarks/simulate_speed.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
