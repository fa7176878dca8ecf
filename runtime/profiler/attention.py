"""Attention: on a GPU the fraction of the GEMM rate torch's flash SDPA reaches; on a CPU its
forward and backward timed per head at the runtime's shapes, with and without dropout."""
from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from costmodel.hardware import sdpa_key
from costmodel.kernels import FLASH_BACKWARD_FACTOR, flash_tile_efficiency, interpolate, sdpa_head_s
from runtime.model import DROPOUT_P
from runtime.profiler.timing import CALLS_PER_POINT, DTYPES, _agree, _over, _timed, best_s


def backward_s(forward_and_backward_s: float, forward_s: float) -> float:
    """A backward's time from best-of timings of the forward with it and alone, floored at a
    tenth of the forward (two best-of timings can cross)."""
    return max(forward_and_backward_s - forward_s, 0.1 * forward_s)


# (batch, heads, sequence, head dim) as GPU plans run them: FlashAttention's share of the GEMM
# rate grows with the sequence and head dim (FA2 paper, fig. 4), so the small shapes alone
# would misprice a 2-8K sequence
GPU_ATTENTION_SHAPES = ((2, 16, 1024, 128), (1, 16, 2048, 128), (1, 16, 4096, 128), (1, 32, 8192, 128))


# (batch, heads, sequence, head dim) of a CPU's SDPA points: each sequence at two head dims (the
# time per pair is not proportional to the dim, costmodel.kernels.sdpa_head_s), from debug-tiny's
# 32 to a 1k sequence; batch x heads large enough that a call's own cost is a small part of it
CPU_SDPA_SHAPES = tuple((b, h, s, d) for b, h, s in ((8, 4, 32), (2, 4, 128), (1, 4, 256), (1, 8, 512), (2, 8, 1024))
                        for d in (16, 64))


# the two shortest sequences are measured whatever the budget: the pricing's least, a per-pair time
# that moves with the sequence and with the head dim
SDPA_ALWAYS_SEQ = sorted({s for _, _, s, _ in CPU_SDPA_SHAPES})[1]


def sdpa_curves(name: str, device: torch.device, phase_s: float, point_s: float,
                shapes: tuple[tuple[int, int, int, int], ...] | None = None) -> dict[str, list]:
    """On a CPU, causal SDPA as the runtime calls it, timed outright rather than priced from the
    GEMM curve: its backward takes more than the 2.5x its forward that FlashAttention's FLOP
    count says, bf16's runs no faster than fp32's where its GEMMs do (at a short sequence and
    head dim 16 its backward is several times slower), and with dropout torch runs its math path,
    several times the flash kernel's forward.
    Per sequence the budget allows (the two shortest always), every head dim of it, without
    dropout and with the runtime's, the forward alone and the backward (forward + backward less
    the forward): (sequence, head dim, seconds per head), keyed costmodel.hardware.sdpa_key."""
    keys = {(drop, back): sdpa_key(name, drop, back) for drop in (False, True) for back in (False, True)}
    out: dict[str, list] = {k: [] for k in keys.values()}
    start = time.perf_counter()
    by_seq: dict[int, list[tuple[int, int, int, int]]] = {}
    for shape in CPU_SDPA_SHAPES if shapes is None else shapes:
        by_seq.setdefault(shape[2], []).append(shape)
    for s, group in by_seq.items():
        # a sequence whole or not at all (a lone head dim would price the other in proportion);
        # at the times just measured: each pass's best_s calls the forward alone, then with the
        # backward, CALLS_PER_POINT times each. Every rank agrees on the shapes and the verdict.
        if s > SDPA_ALWAYS_SEQ:
            expected = CALLS_PER_POINT * sum((2 if "forward" in k else 1) * b * h * sdpa_head_s(tuple(sorted(v)), s, d)
                                             for k, v in out.items() for b, h, _, d in group)
            if _agree(_over(expected, start, phase_s, point_s * len(out) * len(group))):
                break
        for b, h, _, d in group:
            _sdpa_point(name, device, (b, h, s, d), out, keys)
    return out


def _sdpa_point(name: str, device: torch.device, shape: tuple[int, int, int, int], out: dict, keys: dict) -> None:
    """One shape's four points (forward, backward; without dropout and with) appended to `out`."""
    b, h, s, d = shape
    q, k, v = (torch.randn(b, h, s, d, dtype=DTYPES[name], device=device, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, s, d, dtype=DTYPES[name], device=device)
    for drop in (False, True):
        p = DROPOUT_P if drop else 0.0
        fwd = best_s(lambda: F.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(), dropout_p=p,
                                                            is_causal=True))
        both = best_s(lambda: torch.autograd.grad(
            F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True), (q, k, v), grad))
        out[keys[drop, False]].append((s, d, fwd / (b * h)))
        out[keys[drop, True]].append((s, d, backward_s(both, fwd) / (b * h)))


def sdpa_gemm_ratio(forward: list[tuple[float, float, float]], gemm: tuple[tuple[float, float], ...]) -> float:
    """attention_efficiency's figure from a CPU's forward SDPA points: what [efficiency] attention
    still holds there, though the pricing reads the points. Per point past the always-measured
    sequences' shortest (whose calls are mostly their own cost), a causal call's half of its
    4·b·h·s²·d FLOPs over its time against the GEMM rate at those FLOPs (b·h of the shape the
    point was timed at, CPU_SDPA_SHAPES); the median over them."""
    heads = {(s, d): b * h for b, h, s, d in CPU_SDPA_SHAPES}
    longer = [p for p in forward if p[0] >= SDPA_ALWAYS_SEQ] or forward
    return float(np.median([2.0 * s * s * d / t / interpolate(gemm, 2.0 * heads[s, d] * s * s * d)
                            for s, d, t in longer]))


def attention_efficiency(dtype: torch.dtype, device: torch.device, gemm: tuple[tuple[float, float], ...],
                         phase_s: float, point_s: float) -> tuple[float, float]:
    """On a GPU: (the causal SDPA forward's rate over the GEMM rate at the same FLOPs, counting
    the half a causal kernel computes; its backward's rate over the forward's, the backward
    counted as FLASH_BACKWARD_FACTOR forwards), each the median over the shapes the budget allows
    (the smallest always). Each shape's forward ratio is divided by the flash kernel's tile
    efficiency at its length (costmodel.kernels.flash_tile_efficiency), which the pricing applies
    per plan: the profile holds a long sequence's ratio, as the datasheet profiles do, and the
    backward's as [efficiency] attention_backward_ratio (at most 1). (A CPU's SDPA is timed
    outright: sdpa_curves.)"""
    start, ratios, backward = time.perf_counter(), [], []
    for b, h, s, d in GPU_ATTENTION_SHAPES:
        tile = flash_tile_efficiency(s)
        flops = 0.5 * 4.0 * b * h * s * s * d
        # the forward alone, then with its backward (about 1 + 1 + FLASH_BACKWARD_FACTOR forwards)
        expected = (CALLS_PER_POINT * (2 + FLASH_BACKWARD_FACTOR) * flops
                    / (interpolate(gemm, flops) * min(ratios) * tile)) if ratios else 0.0
        if _agree(_over(expected, start, phase_s, point_s)):
            break
        q, k, v = (torch.randn(b, h, s, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)
        with torch.no_grad():
            forward = best_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), **_timed(device))
        both = best_s(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                                  (q, k, v), grad), **_timed(device))
        ratios.append(flops / forward / interpolate(gemm, flops) / tile)
        backward.append(FLASH_BACKWARD_FACTOR * forward / backward_s(both, forward))
    return float(np.median(ratios)), min(1.0, float(np.median(backward)))
