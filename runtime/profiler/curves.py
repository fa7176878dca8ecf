"""GEMM and memory-bound curves: achieved FLOP/s against FLOPs per call over the shapes
transformer layers use, and achieved bytes/s of a kernel mix against bytes per kernel; the
per-operator floor."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from costmodel.kernels import interpolate
from runtime.profiler.timing import (
    ACCELERATED_CHECK_FLOPS,
    ACCELERATED_RATIO,
    CALLS_PER_POINT,
    _agree,
    _over,
    _sync,
    _timed,
    best_s,
)

LAYER_HIDDEN = (64, 128, 256, 512, 1024)


LAYER_TOKENS = (128, 512, 2048)


SQUARE = (16, 32, 64, 1536)


GEMM_MAX_FLOPS = 2e10


MEMORY_ELEMS = tuple(4**k for k in range(5, 13))          # 1 Ki .. 16 Mi elements


# A GPU reaches its GEMM peak only from ~1e11-1e12 FLOPs per call (the layers of a 1-70B model:
# 4-16K tokens x 2-8K hidden), and its memory-bound rate only well beyond its L2 (50 MB on an
# H100): the curves go that far there, so the layers a plan prices are measured, not extrapolated.
# The budget still stops a curve early on a slow device.
GPU_LAYER_HIDDEN = LAYER_HIDDEN + (2048, 4096, 8192)


GPU_LAYER_TOKENS = LAYER_TOKENS + (8192,)


GPU_SQUARE = SQUARE + (4096, 8192)


GPU_GEMM_MAX_FLOPS = 2.5e12


GPU_MEMORY_ELEMS = MEMORY_ELEMS + (4**13, 4**14)          # .. 256 Mi elements (1 GiB in fp32)


def gemm_shapes(device_type: str = "cpu") -> list[tuple[int, int, int]]:
    """(tokens, hidden, out) of the layers' GEMMs and a few squares, ascending FLOPs."""
    gpu = device_type == "cuda"
    hidden, tokens, square = (GPU_LAYER_HIDDEN, GPU_LAYER_TOKENS, GPU_SQUARE) if gpu else \
        (LAYER_HIDDEN, LAYER_TOKENS, SQUARE)
    shapes = {(t, h, n * h) for h in hidden for t in tokens for n in (1, 3, 4)}
    shapes |= {(s, s, s) for s in square}
    cap = GPU_GEMM_MAX_FLOPS if gpu else GEMM_MAX_FLOPS
    return sorted((s for s in shapes if 2 * s[0] * s[1] * s[2] <= cap), key=lambda s: s[0] * s[1] * s[2])


def gemm_point(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    flops = 2.0 * m * k * n
    return flops, flops / best_s(lambda: a @ b, **_timed(device))


@dataclass(frozen=True)
class Curve:
    """A measured curve and where the budget stopped it (None: every size measured)."""
    points: tuple[tuple[float, float], ...]
    stopped_before: float | None = None
    accelerated: bool = True


def gemm_curve(shapes, dtype: torch.dtype, device: torch.device, phase_s: float, point_s: float,
               reference: tuple[tuple[float, float], ...] = (), report=lambda frac, what: None) -> Curve:
    """GEMM rates over `shapes` (ascending FLOPs) until the next point would break the budget,
    in the shapes' order (a second pass pairs its points with them: best_of).
    Against `reference` (fp32's curve), a dtype below ACCELERATED_RATIO of it
    (at ACCELERATED_CHECK_FLOPS and up) is marked not accelerated and measured with a quarter
    of the point budget from then on. A curve the budget stops before those sizes is judged at
    its largest point: unjudged, a slow dtype would be probed as a fast one (seconds per step)."""
    start, points, accelerated, judged = time.perf_counter(), [], True, False
    for i, (m, k, n) in enumerate(shapes):
        flops = 2.0 * m * k * n
        expected = CALLS_PER_POINT * flops / points[-1][1] if points else 0.0
        if _agree(_over(expected, start, phase_s, point_s)):
            if reference and points and not judged:
                accelerated = not _agree(points[-1][1] < ACCELERATED_RATIO * interpolate(reference, points[-1][0]))
            return Curve(tuple(points), flops, accelerated)
        points.append(gemm_point(m, k, n, dtype, device))
        if reference and accelerated and flops >= ACCELERATED_CHECK_FLOPS:
            judged = True
            if _agree(points[-1][1] < ACCELERATED_RATIO * interpolate(reference, flops)):
                accelerated, point_s = False, point_s / 4
        report((i + 1) / len(shapes), f"GEMM {m}x{k}x{n}")
    return Curve(tuple(points), None, accelerated)


def memory_points(elems: int, device: torch.device) -> list[tuple[float, float]]:
    """One point of the memory-bound curve: an add (read 2, write 1), an RMS norm and a softmax
    (read 1, write 1) over fp32 rows of 256, as one mix (bytes per kernel, bytes/s): their bytes
    over their seconds. A training step's memory-bound kernels are of many kinds, and on a CPU a
    softmax or a norm moves bytes at a fraction of an add's rate; a curve of the kinds' points
    apart zigzags between them (the fastest at 12 bytes per element, the slowest at 8), pricing
    one kernel at rates far apart from one micro-batch size to the next."""
    x = torch.randn(elems // 256, 256, device=device)
    y = torch.randn_like(x)
    w = torch.ones(256, device=device)
    timed = _timed(device)
    b = x.numel() * 4
    kernels = [(3.0 * b, lambda: x + y), (2.0 * b, lambda: F.rms_norm(x, (256,), w)),
               (2.0 * b, lambda: x.softmax(-1))]
    moved = sum(n for n, _ in kernels)
    seconds = sum(best_s(fn, **timed) for _, fn in kernels)
    return [(moved / len(kernels), moved / seconds)]


def memory_curve(device: torch.device, phase_s: float, point_s: float, report, count: int | None = None) -> Curve:
    """memory_points over the sizes (the first `count` of them) until the next would break the budget."""
    start, points = time.perf_counter(), []
    sizes = (GPU_MEMORY_ELEMS if device.type == "cuda" else MEMORY_ELEMS)[:count]
    for i, elems in enumerate(sizes):
        bytes_ = 7.0 * 4 * elems   # the three kernels' traffic together
        expected = CALLS_PER_POINT * bytes_ / points[-1][1] if points else 0.0
        if _agree(_over(expected, start, phase_s, point_s)):
            return Curve(tuple(points), bytes_ / 3)
        points += memory_points(elems, device)
        report((i + 1) / len(sizes), f"memory-bound kernels, {elems:,} elements")
    return Curve(tuple(points))


def op_overhead_s(device: torch.device) -> float:
    x = torch.ones(1, device=device)
    return best_s(lambda: [x + x for _ in range(1000)], repeat=5, sync=_sync(device)) / 1000
