"""What one gloo all-reduce costs between ranks that compute in between, as a training step's FSDP
units meet: two processes on this machine's cores, one thread each (as `planner run` gives a CPU
rank), each loop a stretch of matmuls and then an all-reduce of a small layer's gradient.

    python benchmarks/gloo_rendezvous.py [--elements 50000] [--compute-ms 0 0.5 2 5] [--calls 60]

Prints, per compute stretch, the all-reduce's median, mean and 90th percentile over the calls
after the first ten. With no compute between the calls it is the microbenchmark the profile fits
(runtime.profiler's collectives); with compute, each call is also a rendezvous of the two ranks,
and what a rank waits there for the other (and for gloo's threads to be woken on cores the other
rank keeps busy) is paid once a call whatever the bytes: why the runtime's FSDP units take a
bucket's layers (costmodel.params.fsdp_unit_layers).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from runtime.fork import run_forked

WARM_CALLS = 10


def rank_loop(elements: int, compute_ms: list[float], calls: int) -> dict[float, list[float]]:
    torch.set_num_threads(1)
    grad, a, w = torch.ones(elements), torch.randn(128, 64), torch.randn(64, 256)
    out = {}
    for stretch in compute_ms:
        waits = []
        for _ in range(calls):
            start = time.perf_counter()
            while (time.perf_counter() - start) * 1e3 < stretch:
                a @ w
            t0 = time.perf_counter()
            dist.all_reduce(grad)
            waits.append(time.perf_counter() - t0)
        out[stretch] = waits[WARM_CALLS:]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=50_000, help="fp32 elements a call (default: debug-tiny's layer)")
    parser.add_argument("--compute-ms", type=float, nargs="+", default=[0.0, 0.5, 2.0, 5.0])
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args()
    if args.calls <= WARM_CALLS:
        parser.error(f"--calls must be above the {WARM_CALLS} warm-up calls")
    result = run_forked(2, rank_loop, args.elements, args.compute_ms, args.calls)[0]
    print(f"all-reduce of {args.elements} fp32 elements on 2 gloo ranks, one thread each, "
          f"{args.calls - WARM_CALLS} calls after {WARM_CALLS}")
    print(f"{'compute between':>16s} {'median ms':>10s} {'mean ms':>8s} {'p90 ms':>7s}")
    for stretch, waits in result.items():
        ordered = sorted(waits)
        p90 = ordered[int(0.9 * len(ordered))]
        print(f"{stretch:13.1f} ms {statistics.median(waits) * 1e3:10.3f} {statistics.mean(waits) * 1e3:8.3f} "
              f"{p90 * 1e3:7.3f}")
    print("command: python benchmarks/gloo_rendezvous.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()))


if __name__ == "__main__":
    main()
