"""Do a CPU's ranks slow each other's GEMMs, or does waiting slow the GEMM after it? The question
behind a pipeline's stages running their layers' GEMMs further over their price than one rank
runs the same shapes (README, "What a pipeline adds, measured again"). Prints GFLOP/s of a
layer-shaped GEMM ([M, K] x [K, N] fp32, one thread):

- alone on core 0, then one loop per core at once (each pinned), with the weights cycling through
  W MB of matrices so that, past the caches, they come from memory as a training step's do;
- one loop that sleeps between bursts of GEMMs (its rate counted while it computes), as a
  pipeline stage waits for its neighbour.

    python benchmarks/gemm_neighbours.py [--seconds 4] [--weights-mb 2,24,96] [--sleeps-ms 0,5,0,20,0,1]

Each figure is one process's run of --seconds; the machine's own moment moves them, by 60-90
GFLOP/s within a minute on a 2-core EPYC (2026-11-28 12:00; benchmarks/cpu_steadiness.py), so the
default sleeps alternate with none and a difference is a finding only when it holds across repeats.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import torch

M, K, N = 256, 384, 1024   # a projection of the closed loops' hidden Llama at 256 tokens
BURST = 5                  # GEMMs between two sleeps


def _weights(weights_mb: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    count = max(1, int(weights_mb * 1e6 // (K * N * 4)))
    return [torch.randn(M, K) for _ in range(count)], [torch.randn(K, N) for _ in range(count)]


def gemm_rate(core: int | None, seconds: float, weights_mb: float, sleep_ms: float, out) -> None:
    """GFLOP/s while computing, on `core` (None: wherever the OS puts it), put in `out`."""
    if core is not None:
        os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    acts, ws = _weights(weights_mb)
    busy_s, n, end = 0.0, 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        for _ in range(BURST):
            acts[n % len(ws)] @ ws[n % len(ws)]
            n += 1
        busy_s += time.perf_counter() - start
        if sleep_ms:
            time.sleep(sleep_ms / 1e3)
    out.put((core, 2 * M * K * N * n / busy_s / 1e9))


def rates(cores: list[int | None], seconds: float, weights_mb: float, sleep_ms: float = 0.0) -> list[float]:
    """One loop per entry of `cores`, all at once, each in a process of its own (forked, as
    runtime.fork starts a profile's ranks)."""
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=gemm_rate, args=(c, seconds, weights_mb, sleep_ms, out)) for c in cores]
    for p in procs:
        p.start()
    got = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return [r for _, r in sorted(got, key=lambda cr: -1 if cr[0] is None else cr[0])]


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of numbers") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: no negative values")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=4.0, help="each loop's run (default 4)")
    parser.add_argument("--weights-mb", type=_floats, default=[2.0, 24.0, 96.0],
                        help="the weights' working sets to cycle through, MB (default 2,24,96)")
    parser.add_argument("--sleeps-ms", type=_floats, default=[0.0, 5.0, 0.0, 20.0, 0.0, 1.0],
                        help=f"sleeps between bursts of {BURST} GEMMs, ms, in this order (default 0,5,0,20,0,1)")
    args = parser.parse_args()
    if args.seconds <= 0:
        parser.error("--seconds must be positive")
    cores = sorted(os.sched_getaffinity(0))
    print(f"[{M}, {K}] x [{K}, {N}] fp32, one thread a loop, {args.seconds:g} s each; cores {cores}", flush=True)
    for mb in args.weights_mb:
        alone = rates([cores[0]], args.seconds, mb)[0]
        together = rates(cores, args.seconds, mb) if len(cores) > 1 else []
        print(f"weights {mb:g} MB: alone {alone:.1f} GFLOP/s; one per core at once "
              + (", ".join(f"{r:.1f}" for r in together) if together else "(one core: none)"), flush=True)
    for sleep_ms in args.sleeps_ms:
        rate = rates([cores[0]], args.seconds, args.weights_mb[0], sleep_ms)[0]
        print(f"sleep {sleep_ms:g} ms every {BURST} GEMMs: {rate:.1f} GFLOP/s while computing", flush=True)


if __name__ == "__main__":
    main()
