"""`planner profile`: measure this machine and write a device profile (runtime.profiler does
the measuring; this module drives it, shows progress and writes the TOML)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from costmodel.cluster import profile_dir

EPILOG = """examples:
  planner profile                              (writes profiles/local.toml; then --cluster 1x2xlocal)
  planner profile --out profiles/mybox.toml --nproc 4

Every measured number is written with the date, the command and the machine. GEMM and
memory-bound rates are curves over sizes that the cost model interpolates; collectives are
fitted to its alpha-beta ring model."""


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="profile to write (default profiles/local.toml)")
    p.add_argument("--nproc", type=int, default=2,
                   help="local ranks for the collectives, and the threads-per-rank split (default 2)")
    p.add_argument("--name", help="device name in the profile (default: the file name)")


class Progress:
    def __init__(self, total: int) -> None:
        self.total, self.done, self.start = total, 0, time.perf_counter()

    def step(self, what: str) -> None:
        self.done += 1
        filled = int(30 * self.done / self.total)
        sys.stderr.write(f"\r[{'#' * filled}{' ' * (30 - filled)}] {self.done}/{self.total} "
                         f"{time.perf_counter() - self.start:5.1f} s  {what:<40.40}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def cmd_profile(args: argparse.Namespace) -> int:
    import torch

    from runtime import profiler as prof
    from runtime.fork import run_forked
    out = Path(args.out or "profiles/local.toml")
    if out.suffix != ".toml":
        raise ValueError(f"--out {out}: a profile is a .toml file")
    if args.nproc < 2:
        raise ValueError("--nproc must be at least 2 (collectives need two ranks)")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.device_count() < args.nproc:
        raise ValueError(f"--nproc {args.nproc}: this machine has {torch.cuda.device_count()} GPUs")
    threads = max(1, (os.cpu_count() or 1) // args.nproc)   # each rank's share of the cores
    shapes = prof.gemm_shapes()
    dtypes = list(prof.DTYPES)
    progress = Progress(len(shapes) * len(dtypes) + len(prof.MEMORY_ELEMS) + len(dtypes) + 2)
    result = run_forked(args.nproc, prof.measure_rank, shapes, dtypes, prof.MEMORY_ELEMS,
                        prof.COLLECTIVE_BYTES, device.type, threads, progress.step)[0]
    progress.close()
    gemm, attention, overhead_s = result["gemm"], result["attention"], result["overhead_s"]
    memory, samples = _monotone_by_size(result["memory"]), result["collectives"]
    alpha, beta, rms, p2p = prof.fit_alpha_beta(samples, args.nproc)
    text = _toml(args, out, device, threads, gemm, memory, attention, overhead_s, samples, alpha, beta, rms, p2p,
                 prof.machine_description(device))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    name = args.name or out.stem
    print(f"wrote {out}: GEMM up to {max(r for _, r in gemm[dtypes[0]]) / 1e9:,.1f} GFLOP/s ({dtypes[0]}), "
          f"memory-bound up to {max(r for _, r in memory) / 1e9:.1f} GB/s, collectives alpha "
          f"{alpha * 1e6:.0f} us beta {beta / 1e9:.2f} GB/s (fit rms {100 * rms:.0f}%); use --cluster 1x{args.nproc}x{name}"
          + ("" if out.parent.resolve() == profile_dir().resolve() else f" or 1x{args.nproc}x{out}"))
    return 0


def _monotone_by_size(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """One rate per size (the best kernel kind there), sorted: what interpolation needs."""
    best: dict[float, float] = {}
    for size, rate in points:
        best[size] = max(rate, best.get(size, 0.0))
    return sorted(best.items())


def _pairs(points) -> str:
    return "[" + ", ".join(f"[{x:.6g}, {y:.6g}]" for x, y in points) + "]"


def _toml(args, out, device, threads, gemm, memory, attention, overhead_s, samples, alpha, beta, rms, p2p,
          machine) -> str:
    date = time.strftime("%Y-%m-%d")
    command = f"planner profile --out {out} --nproc {args.nproc}"
    how = f"measured {date} by `{command}` on {machine}, {threads} thread(s) per rank"
    name = args.name or out.stem
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 2**34
    mem_bytes = (torch_cuda_memory() if device.type == "cuda" else ram // args.nproc)
    peaks = ", ".join(f"{k} = {max(r for _, r in v):.6g}" for k, v in gemm.items())
    lines = [
        f"# Device profile of this machine: {how}.",
        "# Peaks are the best measured rates; the curves under [measured] are what the cost model uses.",
        f"# All {args.nproc} ranks measured at once (each shares cores, caches and memory bandwidth with the",
        "# others, as the ranks of a run do); rank 0's figures are written.",
        "",
        "[device]",
        f'name = "{name}"',
        f'kind = "{"gpu" if device.type == "cuda" else "cpu"}"',
        "aliases = []",
        f"peak_flops_per_s = {{ {peaks} }}  # measured: best GEMM rate of the curves below",
        f"memory_bytes = {int(mem_bytes)}  # " + ("device memory (torch.cuda)" if device.type == "cuda"
                                                 else f"this machine's RAM / {args.nproc} ranks (a choice)"),
        f"memory_bandwidth_bytes_per_s = {max(r for _, r in memory):.6g}  # measured: best memory-bound kernel rate",
        "",
        "[[network]]",
        'scope = "node"',
        f'name = "{"nccl" if device.type == "cuda" else "gloo"}-local"',
        f"bandwidth_bytes_per_s = {beta:.6g}  # measured: alpha-beta ring fit over "
        f"{sum(len(v) for k, v in samples.items() if k != 'p2p')} collective samples on {args.nproc} "
        f"ranks (rms {100 * rms:.0f}%)",
        f"latency_s = {alpha:.6g}  # measured: same fit, per ring step",
        f"p2p_latency_s = {p2p:.6g}  # measured: send/recv of the smallest messages (median)",
        "",
        "[[network]]",
        'scope = "cluster"',
        'name = "unmeasured"',
        f"bandwidth_bytes_per_s = {beta:.6g}  # no second machine measured: the node figure stands in",
        f"latency_s = {alpha:.6g}  # no second machine measured: the node figure stands in",
        "",
        "[efficiency]",
        "gemm = 1.0  # the measured GEMM curve already is the achieved rate",
        f"attention = {attention[next(iter(attention))]:.4g}  # measured: causal SDPA rate / GEMM rate at equal FLOPs",
        "memory = 1.0  # the measured memory-bound curve already is the achieved rate",
        f"kernel_overhead_s = 0.0  # the curves include each call's cost (bare operator: {overhead_s:.3g} s); "
        "`planner calibrate` fits what training adds (autograd, modules, hooks)",
        "intra_node_comm = 1.0  # the fit above is the achieved rate",
        "inter_node_comm = 1.0",
        "reserved_memory_bytes = 268435456  # assumed: interpreter + torch runtime, ~256 MiB",
        f'source = "{how}"',
        "",
        "[measured]",
        f'date = "{date}"',
        f'command = "{command}"',
        f'machine = "{machine}"',
        f"threads_per_rank = {threads}  # `planner run` gives each CPU rank this many threads",
        *[f"gemm_{k} = {_pairs(v)}  # [FLOPs per call, FLOP/s]" for k, v in gemm.items()],
        f"memory_bound = {_pairs(memory)}  # [bytes moved per call, bytes/s]",
        *[f"collective_{k} = {_pairs(v)}  # [bytes, seconds]" for k, v in samples.items()],
        "",
    ]
    return "\n".join(lines)


def torch_cuda_memory() -> int:
    import torch
    return torch.cuda.get_device_properties(0).total_memory
