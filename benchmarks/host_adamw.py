"""The optimizer step of offloaded states on this machine's CPU: torch's AdamW over fp32
parameters, fused kernel against foreach (why runtime.train steps offloaded states with the
fused one, and what costmodel.compute.host_optimizer_step_s counts: 28 bytes per parameter).

    python benchmarks/host_adamw.py [--params 50000000] [--repeat 5]

Prints, per kernel, the median step time, nanoseconds per parameter and the bandwidth it
implies at 28 bytes per parameter (read master, gradient and both moments; write master and
both moments).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

BYTES_PER_PARAM = 28


def step_s(params: int, fused: bool, repeat: int) -> float:
    p = torch.nn.Parameter(torch.randn(params))
    p.grad = torch.randn(params)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True) if fused else torch.optim.AdamW([p], lr=1e-3, foreach=True)
    for _ in range(2):   # the moments are allocated on the first step
        opt.step()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"AdamW over {args.params:,} fp32 parameters, {torch.get_num_threads()} threads")
    for name, fused in (("fused", True), ("foreach", False)):
        s = step_s(args.params, fused, args.repeat)
        print(f"{name:8s} {1e3 * s:8.1f} ms  {1e9 * s / args.params:6.2f} ns/param  "
              f"{BYTES_PER_PARAM * args.params / s / 1e9:6.1f} GB/s at {BYTES_PER_PARAM} B/param")


if __name__ == "__main__":
    main()
