"""How steady this machine's speed is: one process per core times the same GEMM back to back for
a while and prints each second's median rate per process, then how often and how deep it fell
below its usual rate. On a machine shared with other tenants a profile measured in a slow
stretch prices every plan that much slower (runtime.profiler.second_pass, the reason it exists).

    python benchmarks/cpu_steadiness.py [--seconds 60] [--procs 2]

A second is "slow" below SLOW of the process's median second; a stretch is consecutive slow seconds.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

M, K, N = 512, 1024, 1024   # a layer-sized GEMM: ~1 GFLOP, some 10 ms on one core
SLOW = 0.9


def per_second_rates(seconds: int, queue) -> None:
    torch.set_num_threads(1)
    a, b = torch.randn(M, K), torch.randn(K, N)
    flops, start, rates, second = 2.0 * M * K * N, time.perf_counter(), [], []
    while len(rates) < seconds:
        t0 = time.perf_counter()
        a @ b
        t1 = time.perf_counter()
        second.append(flops / (t1 - t0))
        if t1 - start >= len(rates) + 1:
            rates.append(statistics.median(second))
            second = []
    queue.put(rates)


def stretches(slow: list[bool]) -> list[int]:
    """Lengths of the runs of consecutive True."""
    out, run = [], 0
    for s in slow + [False]:
        if s:
            run += 1
        elif run:
            out.append(run)
            run = 0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=60, help="how long to watch (default 60)")
    parser.add_argument("--procs", type=int, default=2, help="processes, one thread each (default 2: the ranks of a profile)")
    args = parser.parse_args()
    if args.seconds < 5 or args.procs < 1:
        parser.error("--seconds must be at least 5 and --procs at least 1")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=per_second_rates, args=(args.seconds, queue)) for _ in range(args.procs)]
    for p in procs:
        p.start()
    series = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    print("second  " + "  ".join(f"proc {i} GFLOP/s" for i in range(len(series))))
    for t, row in enumerate(zip(*series)):
        print(f"{t:6d}  " + "  ".join(f"{r / 1e9:14.1f}" for r in row))
    for i, rates in enumerate(series):
        usual = statistics.median(rates)
        slow = [r < SLOW * usual for r in rates]
        runs = stretches(slow)
        print(f"proc {i}: median {usual / 1e9:.1f} GFLOP/s, best second {max(rates) / 1e9:.1f}, worst {min(rates) / 1e9:.1f} "
              f"({min(rates) / usual:.0%} of the median); {sum(slow)} of {len(rates)} s below {SLOW:.0%}, "
              f"in {len(runs)} stretch(es), the longest {max(runs, default=0)} s")
    both = sum(all(r < SLOW * statistics.median(s) for r, s in zip(row, series)) for row in zip(*series))
    print(f"slow on every process at once: {both} s")


if __name__ == "__main__":
    main()
