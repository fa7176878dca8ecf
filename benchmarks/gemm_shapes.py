"""A linear layer's three GEMMs over a grid of shapes, measured and priced: how a GEMM's rate
falls with its reduction length K (each output tile's fixed prologue and epilogue, amortised
over K / tile-K main-loop steps), which a curve by FLOPs per call cannot tell apart from size.
Beside them, on a GPU: float8 GEMMs against bf16 (`--kind fp8`) and the fp32 loss over a large
vocabulary (`--kind loss`), the two other kernel costs the datasheet profiles assume.

    python benchmarks/gemm_shapes.py [--kind gemm|fp8|loss] [--out FILE] [--budget-s 120]
    python benchmarks/gemm_shapes.py --replay FILE --profile PROFILE     # price what was measured

For every (tokens m, in-features k, out-features n) of the grid it times, as autograd runs an
nn.Linear, the forward X[m,k]·W[n,k]ᵀ (reduces k), the input gradient dY[m,n]·W (reduces n)
and the weight gradient dYᵀ·X (reduces m), back to back after a warm-up, and records the
median rate of `--repeat` timed batches (sustained clocks, not the best call). --replay prints
each point's rate over PROFILE's GEMM shape model (costmodel.kernels.gemm.tile_efficiency) by
reduction length, flat where the model's K term is right, and the fit of that term over the
GEMMs with two or more waves of output tiles; for a float8 or loss file, the measured against
what the profile assumes (float8 at bf16's share of its peak; costmodel.kernels.cross_entropy_s).
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
FP8_GRID = {"m": (4096, 16384), "k": (1024, 2048, 4096, 8192, 16384), "n": (2048, 8192, 32768)}
LOSS_SHAPES = ((8192, 131072), (16384, 131072), (8192, 50304))   # (tokens, vocabulary)
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
    shapes = _grid(grid)
    for i, (m, k, n) in enumerate(shapes):
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
    return {"kind": "gemm", "device": name, "dtype": "bf16", "torch": torch.__version__, "points": points}


def _grid(grid: dict) -> list[tuple[int, int, int]]:
    shapes = [(m, k, n) for m in grid["m"] for k in grid["k"] for n in grid["n"] if 2.0 * m * k * n <= MAX_FLOPS]
    return sorted(shapes, key=lambda s: s[0] * s[1] * s[2])


def measure_fp8(repeat: int) -> dict:
    """Forward GEMMs of FP8_GRID: F.linear in bf16 against torch._scaled_mm of the same operands
    in float8 e4m3 (tensorwise scales of one, bf16 out), as torchao's float8 linears run it."""
    import torch

    from runtime.profiler.timing import best_s
    one, points = torch.tensor(1.0, device="cuda"), []
    for m, k, n in _grid(FP8_GRID):
        x, w = (torch.randn(r, k, device="cuda", dtype=torch.bfloat16) for r in (m, n))
        xf, wf = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        timed = [best_s(fn, repeat=repeat, sync=torch.cuda.synchronize, batch_s=BATCH_S, pick=statistics.median)
                 for fn in (lambda: torch.nn.functional.linear(x, w),
                            lambda: torch._scaled_mm(xf, wf.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))]
        points.append({"m": m, "k": k, "n": n, "bf16_s": timed[0], "fp8_s": timed[1]})
        print(f"{m}x{k}x{n}: float8 {timed[0] / timed[1]:.2f}x bf16", flush=True)
    return {"kind": "fp8", "device": torch.cuda.get_device_name(), "torch": torch.__version__, "points": points}


def measure_loss(repeat: int) -> dict:
    """F.cross_entropy forward and backward over LOSS_SHAPES' bf16 logits, through fp32
    (`.float()`, as the runtime and torchtitan run it) and in bf16, and its peak memory."""
    import torch
    points = [_loss_point(tokens, vocab, fp32, repeat) for tokens, vocab in LOSS_SHAPES for fp32 in (True, False)]
    return {"kind": "loss", "device": torch.cuda.get_device_name(), "torch": torch.__version__, "points": points}


def _loss_point(tokens: int, vocab: int, fp32: bool, repeat: int) -> dict:
    import torch

    from runtime.profiler.timing import best_s
    x = torch.randn(tokens, vocab, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, vocab, (tokens,), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    seconds = best_s(lambda: torch.nn.functional.cross_entropy(x.float() if fp32 else x, y).backward(),
                     repeat=repeat, sync=torch.cuda.synchronize, pick=statistics.median)
    print(f"{tokens} x {vocab} {'fp32' if fp32 else 'bf16'}: {1e3 * seconds:.2f} ms", flush=True)
    return {"tokens": tokens, "vocab": vocab, "fp32": fp32, "seconds": seconds,
            "peak_bytes": torch.cuda.max_memory_allocated()}


def fit_tile_setup(points: list[dict], num_sms: int, peak: float, tile: int) -> tuple[float, int, int]:
    """(share of peak, tile setup in elements of K, GEMMs fitted): least squares in log time of
    peak x share x waves x K / (K + setup) over the GEMMs with two or more waves of output tiles
    (fewer, cuBLAS splits K and a call's microseconds of launch weigh in), setup searched 0-1000;
    `tile`: the output tile edge the profile counts waves in."""
    import math

    full = [p for p in points if -(-p["m"] // tile) * -(-p["n"] // tile) >= 2 * num_sms]

    def logs(setup: int) -> list[float]:
        dev_free = [p["flop_per_s"] / (peak * _waves(p, num_sms, tile) * p["k"] / (p["k"] + setup)) for p in full]
        return [math.log(r) for r in dev_free]
    best = min(range(0, 1001), key=lambda c: statistics.pvariance(logs(c)))
    return math.exp(statistics.fmean(logs(best))), best, len(full)


def _waves(p: dict, num_sms: int, tile: int) -> float:
    tiles = -(-p["m"] // tile) * -(-p["n"] // tile)
    return tiles / (-(-tiles // num_sms) * num_sms)


def replay_fp8(results: dict, dev) -> None:
    ratios = [p["bf16_s"] / p["fp8_s"] for p in results["points"]]
    share = {d: statistics.median([2.0 * p["m"] * p["k"] * p["n"] / p[f"{d}_s"] / dev.peak_for(d)
                                   for p in results["points"]]) for d in ("bf16", "fp8")}
    long_k = [r for r, p in zip(ratios, results["points"]) if p["k"] >= 4096]
    print(f"{results['device']}: float8 {statistics.median(ratios):.2f}x bf16 (median of {len(ratios)}; "
          f"{min(ratios):.2f}-{max(ratios):.2f}x; {statistics.median(long_k):.2f}x at k >= 4096); "
          f"{share['fp8']:.3f} of {dev.name}'s fp8 peak against bf16's {share['bf16']:.3f} of its own: "
          f"{share['fp8'] / share['bf16']:.2f} of it (fp8_gemm_s assumes 1)")


def replay_loss(results: dict, dev) -> None:
    from costmodel.kernels import cross_entropy_s
    from costmodel.specs import DType, TrainSpec
    for p in results["points"]:
        train = TrainSpec(seq_len=1, global_batch_size=1, compute_dtype=DType.BF16)
        priced = 2 * cross_entropy_s(p["tokens"], p["vocab"], train, dev) if p["fp32"] else None
        line = f"  {p['tokens']} x {p['vocab']} {'from bf16 through fp32' if p['fp32'] else 'in bf16'}: " \
               f"{1e3 * p['seconds']:.2f} ms, peak {p['peak_bytes'] / (p['tokens'] * p['vocab']):.1f} bytes a logit"
        print(line + (f"; priced {1e3 * priced:.2f} ms ({100 * (priced / p['seconds'] - 1):+.0f} %)" if priced else ""))


def replay(results: dict, profile: str) -> None:
    """Each point's rate over what the profile's GEMM shape model gives it (peak x wave
    quantisation x K / (K + gemm_tile_setup_k)): the bare GEMM's share of peak the shape does
    not explain. Flat across K where the model's shape terms are right; its level is the bare
    kernel's, above a training step's fitted `gemm` (sustained clocks under load, contention)."""
    from costmodel.hardware import resolve_device
    from costmodel.kernels.gemm import tile_efficiency
    dev = resolve_device(profile)
    kind = results.get("kind", "gemm")
    if kind != "gemm":
        print(f"{results['device']}, priced with {dev.name}:")
        (replay_fp8 if kind == "fp8" else replay_loss)(results, dev)
        return
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
    share, setup, n = fit_tile_setup(results["points"], dev.num_sms, peak, dev.gemm_tile)
    print(f"fit over the {n} GEMMs with two or more waves: peak x {share:.3f} x waves x K / (K + {setup})")


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("gemm", "fp8", "loss"), default="gemm",
                    help="a linear's bf16 GEMMs (CUDA, else a small grid on this CPU); float8 against bf16 "
                         "GEMMs, or the fp32 loss (both CUDA only)")
    ap.add_argument("--out", type=Path, help="write the measured points here (JSON)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="stop measuring after this long")
    ap.add_argument("--repeat", type=int, default=5, help="timed batches per GEMM (their median)")
    ap.add_argument("--replay", type=Path, help="price the points of an earlier measurement")
    ap.add_argument("--profile", default="H100", help="profile to price with under --replay")
    args = ap.parse_args()
    if args.replay:
        replay(json.loads(args.replay.read_text()), args.profile)
        return
    if args.kind != "gemm" and not _cuda():
        sys.exit(f"gemm_shapes: --kind {args.kind} needs a CUDA device")
    results = (measure(args.budget_s, args.repeat) if args.kind == "gemm" else
               measure_fp8(args.repeat) if args.kind == "fp8" else measure_loss(args.repeat))
    if args.out:
        if args.out.exists():
            sys.exit(f"gemm_shapes: {args.out} exists; choose another --out")
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
