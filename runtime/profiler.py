"""Measure the machine this runs on: what `planner profile` writes into a device profile.

- GEMM throughput over the shapes transformer layers use (tokens x hidden x {hidden, 3 hidden,
  4 hidden}) and square ones, per dtype: a curve of achieved FLOP/s against FLOPs per call.
- Memory-bound kernels (elementwise add, RMS norm, softmax) over sizes: achieved bytes/s
  (read + write) against bytes moved per call.
- Attention (torch's scaled_dot_product_attention, causal) at a few sizes, as the fraction of
  the GEMM rate it reaches.
- Per-operator overhead: a one-element add, the floor under every small kernel.
- Collectives among N local ranks (gloo on CPU, NCCL on GPU): all-reduce, all-gather,
  reduce-scatter and send/recv over message sizes, fitted to the alpha-beta ring model of
  costmodel.comm (latency per step, bandwidth per rank per direction).
Each figure is the best of a few repetitions after a warm-up (the achievable rate, as a
training step that repeats the same kernels sees it).
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from costmodel.compute import interpolate

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYER_HIDDEN = (64, 128, 256, 512, 1024)
LAYER_TOKENS = (128, 512, 2048)
SQUARE = (16, 32, 64, 1536)
MEMORY_ELEMS = tuple(4**k for k in range(5, 13))          # 1 Ki .. 16 Mi elements
COLLECTIVE_BYTES = tuple(4**k for k in range(1, 12))      # 4 B .. 16 MiB


def best_s(fn: Callable[[], object], repeat: int = 3, sync: Callable[[], None] = lambda: None) -> float:
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def gemm_shapes() -> list[tuple[int, int, int]]:
    shapes = {(t, h, n * h) for h in LAYER_HIDDEN for t in LAYER_TOKENS for n in (1, 3, 4)}
    shapes |= {(s, s, s) for s in SQUARE}
    return sorted((s for s in shapes if 2 * s[0] * s[1] * s[2] <= 2e10), key=lambda s: s[0] * s[1] * s[2])


def gemm_point(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    a = torch.randn(m, k, dtype=dtype, device=device)
    b = torch.randn(k, n, dtype=dtype, device=device)
    flops = 2.0 * m * k * n
    return flops, flops / best_s(lambda: a @ b, sync=_sync(device))


def memory_points(elems: int, device: torch.device) -> list[tuple[float, float]]:
    """(bytes moved, bytes/s) for an add (read 2, write 1), an RMS norm and a softmax (read 1,
    write 1) over fp32 rows of 256."""
    x = torch.randn(elems // 256, 256, device=device)
    y = torch.randn_like(x)
    w = torch.ones(256, device=device)
    sync = _sync(device)
    b = x.numel() * 4
    return [(3.0 * b, 3 * b / best_s(lambda: x + y, sync=sync)),
            (2.0 * b, 2 * b / best_s(lambda: F.rms_norm(x, (256,), w), sync=sync)),
            (2.0 * b, 2 * b / best_s(lambda: x.softmax(-1), sync=sync))]


def op_overhead_s(device: torch.device) -> float:
    x = torch.ones(1, device=device)
    return best_s(lambda: [x + x for _ in range(1000)], repeat=5, sync=_sync(device)) / 1000


def attention_efficiency(dtype: torch.dtype, device: torch.device, gemm_rate: Callable[[float], float]) -> float:
    """Causal SDPA rate over the GEMM rate at the same FLOPs (counting the half a causal kernel
    computes), the median over a few shapes."""
    ratios = []
    for b, h, s, d in ((1, 4, 256, 64), (1, 8, 512, 64), (2, 8, 1024, 64)):
        q, k, v = (torch.randn(b, h, s, d, dtype=dtype, device=device) for _ in range(3))
        flops = 0.5 * 4.0 * b * h * s * s * d
        t = best_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), sync=_sync(device))
        ratios.append(flops / t / gemm_rate(flops))
    return float(np.median(ratios))


def collective_worker(sizes: tuple[int, ...], device: torch.device) -> dict[str, list[tuple[float, float]]] | None:
    """Run inside every rank of an initialised group: (bytes, seconds) per collective, rank 0."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in
                                                 ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    sync = _sync(device)
    for size in sizes:
        n = max(world, size // 4 // world * world)
        full = torch.ones(n, device=device)
        shard = torch.ones(n // world, device=device)
        dist.barrier()
        out["all_reduce"].append((n * 4.0, best_s(lambda: dist.all_reduce(full), 5, sync)))
        out["all_gather"].append((n * 4.0, best_s(lambda: dist.all_gather_into_tensor(full, shard), 5, sync)))
        out["reduce_scatter"].append((n * 4.0, best_s(lambda: dist.reduce_scatter_tensor(shard, full), 5, sync)))

        def ping() -> None:
            if rank == 0:
                dist.send(full, 1)
                dist.recv(full, 1)
            elif rank == 1:
                dist.recv(full, 0)
                dist.send(full, 0)
        out["p2p"].append((n * 4.0, best_s(ping, 5, sync) / 2))
    return out if rank == 0 else None


def fit_alpha_beta(samples: dict[str, list[tuple[float, float]]], world: int) -> tuple[float, float, float, float]:
    """Least squares of t = steps * alpha + volume / beta over the collectives' samples, with the
    ring model's steps and per-rank volume (costmodel.comm), relative error weighting. Returns
    (alpha_s, beta_bytes_per_s, relative rms error, point-to-point latency_s): gloo's
    send/recv has a much smaller fixed cost than its collectives, so it is kept apart (the
    smallest messages' median time)."""
    rows = []
    for kind, points in samples.items():
        if kind == "p2p":
            continue
        for num_bytes, t in points:
            steps, volume = world - 1, (world - 1) / world * num_bytes
            if kind == "all_reduce":
                steps, volume = 2 * steps, 2 * volume
            rows.append((steps / t, volume / t))   # divided by t: relative, not absolute, error
    a = np.array(rows)
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.ones(len(rows)), rcond=None)
    alpha, inv_beta = max(alpha, 1e-7), max(inv_beta, 1e-12)
    rms = float(np.sqrt(np.mean((a @ np.array([alpha, inv_beta]) - 1.0) ** 2)))
    p2p = float(np.median([t for _, t in samples["p2p"][:4]]))
    return float(alpha), float(1.0 / inv_beta), rms, p2p


def measure_rank(shapes, dtypes: list[str], elems: tuple[int, ...], sizes: tuple[int, ...],
                 device_type: str, threads: int, report) -> dict | None:
    """Everything, on every rank of an initialised group at once: each rank is one "device" of
    the node and shares cores, caches and memory bandwidth with the others, as ranks of a run
    do. A barrier before each point keeps the ranks measuring together; rank 0's figures are
    returned (and its progress reported through `report(what)`)."""
    torch.set_num_threads(threads)
    device = torch.device(device_type, dist.get_rank() if device_type == "cuda" else 0)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    lead = dist.get_rank() == 0
    out: dict = {"gemm": {}, "memory": [], "attention": {}}
    for name in dtypes:
        points = []
        for m, k, n in shapes:
            dist.barrier()
            points.append(gemm_point(m, k, n, DTYPES[name], device))
            lead and report(f"GEMM {name} {m}x{k}x{n}")
        out["gemm"][name] = sorted(points)
    for e in elems:
        dist.barrier()
        out["memory"] += memory_points(e, device)
        lead and report(f"memory-bound kernels, {e:,} elements")
    for name in dtypes:
        dist.barrier()
        curve = tuple(out["gemm"][name])   # read the way the cost model reads it
        out["attention"][name] = attention_efficiency(DTYPES[name], device, lambda f, c=curve: interpolate(c, f))
        lead and report(f"attention {name}")
    dist.barrier()
    out["overhead_s"] = op_overhead_s(device)
    lead and report("per-operator overhead")
    with warnings.catch_warnings():   # gloo's *_tensor collectives are "deprecated" in 2.13, still the API
        warnings.simplefilter("ignore", FutureWarning)
        out["collectives"] = collective_worker(sizes, device)
    lead and report(f"collectives on {dist.get_world_size()} ranks")
    return out if lead else None


def machine_description(device: torch.device) -> str:
    import platform
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name()} ({platform.node()}), torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"
