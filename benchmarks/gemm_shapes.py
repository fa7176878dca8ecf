"""A linear layer's three GEMMs over a grid of shapes, measured and priced: how a GEMM's rate
falls with its reduction length K (each output tile's fixed prologue and epilogue, amortised
over K / tile-K main-loop steps), which a curve by FLOPs per call cannot tell apart from size.

    python benchmarks/gemm_shapes.py [--out FILE] [--budget-s 120]      # measure (CUDA, else CPU)
    python benchmarks/gemm_shapes.py --replay FILE --profile PROFILE     # price what was measured

For every (tokens m, in-features k, out-features n) of the grid it times, as autograd runs an
nn.Linear, the forward X[m,k]·W[n,k]ᵀ (reduces k), the input gradient dY[m,n]·W (reduces n)
and the weight gradient dYᵀ·X (reduces m), back to back after a warm-up, and records the
median rate of `--repeat` timed batches (sustained clocks, not the best call). --replay prints
each point's rate over PROFILE's GEMM shape model (costmodel.kernels.gemm.tile_efficiency) by
reduction length: flat where the model's K term is right.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

GPU_GRID = {"m": (2048, 4096, 8192, 16384), "k": (1024, 2048, 4096, 8192, 16384),
            "n": (1024, 2048, 4096, 8192, 16384, 32768)}
CPU_GRID = {"m": (256, 512), "k": (128, 256, 512), "n": (256, 512)}
MAX_FLOPS = 4e12     # skip the grid's largest corner: seconds per point for nothing new
BATCH_S = 0.02       # each timed batch runs calls back to back for about this long (at most 64)


def _layouts(m: int, k: int, n: int, dtype, device):
    """(name, (out rows, reduction, out cols), call) for the forward and the two gradients."""
    import torch
    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device)
    dy = torch.randn(m, n, dtype=dtype, device=device)
    return [("forward", (m, k, n), lambda: torch.nn.functional.linear(x, w)),
            ("input_grad", (m, n, k), lambda: dy @ w),
            ("weight_grad", (n, m, k), lambda: dy.t() @ x)]


def measure(budget_s: float, repeat: int) -> dict:
    import torch

    from runtime.profiler.timing import best_s
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    grid = GPU_GRID if cuda else CPU_GRID
    points, start = [], time.perf_counter()
    shapes = [(m, k, n) for m in grid["m"] for k in grid["k"] for n in grid["n"] if 2.0 * m * k * n <= MAX_FLOPS]
    for i, (m, k, n) in enumerate(sorted(shapes, key=lambda s: s[0] * s[1] * s[2])):
        if time.perf_counter() - start > budget_s:
            print(f"budget of {budget_s:.0f} s spent after {i} of {len(shapes)} shapes", file=sys.stderr)
            break
        for name, (rows, red, cols), fn in _layouts(m, k, n, torch.bfloat16, device):
            s = best_s(fn, repeat=repeat, sync=sync, batch_s=BATCH_S, pick=statistics.median)
            points.append({"layout": name, "m": rows, "k": red, "n": cols, "seconds": s,
                           "flop_per_s": 2.0 * rows * red * cols / s})
        print(f"{m}x{k}x{n}: " + ", ".join(f"{p['layout']} {p['flop_per_s'] / 1e12:.0f}" for p in points[-3:])
              + " TFLOP/s", flush=True)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    return {"device": name, "dtype": "bf16", "torch": torch.__version__, "points": points}


def replay(results: dict, profile: str) -> None:
    """Each point's rate over what the profile's GEMM shape model gives it (peak x wave
    quantisation x K / (K + gemm_tile_setup_k)): the bare GEMM's share of peak the shape does
    not explain. Flat across K where the model's shape terms are right; its level is the bare
    kernel's, above a training step's fitted `gemm` (sustained clocks under load, contention)."""
    from costmodel.hardware import resolve_device
    from costmodel.kernels.gemm import tile_efficiency
    dev = resolve_device(profile)
    peak = dev.peak_for("bf16")
    by_k: dict[int, list[float]] = {}
    for p in results["points"]:
        by_k.setdefault(p["k"], []).append(p["flop_per_s"] / (peak * tile_efficiency(p["m"], p["k"], p["n"], dev)))
    print(f"{results['device']}: measured rate / (peak x the shape model of {dev.name}, gemm_tile_setup_k "
          f"{dev.gemm_tile_setup_k}), median and range of the {len(results['points'])} GEMMs by reduction length k")
    for k in sorted(by_k):
        r = by_k[k]
        print(f"  k={k:<6} {statistics.median(r):.3f}  ({min(r):.3f}-{max(r):.3f}, {len(r)} GEMMs)")
    flat = [statistics.median(by_k[k]) for k in sorted(by_k)]
    print(f"spread of the medians over k: {max(flat) / min(flat) - 1:+.1%} (0: the shape model explains K)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="write the measured points here (JSON)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="stop measuring after this long")
    ap.add_argument("--repeat", type=int, default=5, help="timed batches per GEMM (their median)")
    ap.add_argument("--replay", type=Path, help="price the points of an earlier measurement")
    ap.add_argument("--profile", default="H100", help="profile to price with under --replay")
    args = ap.parse_args()
    if args.replay:
        replay(json.loads(args.replay.read_text()), args.profile)
        return
    results = measure(args.budget_s, args.repeat)
    if args.out:
        if args.out.exists():
            sys.exit(f"gemm_shapes: {args.out} exists; choose another --out")
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
