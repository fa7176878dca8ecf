"""`planner profile`: measure this machine and write a device profile (runtime.profiler does
the measuring, planner.probes the training-step probes and their fit; this module drives them
under a time budget, shows progress with an ETA and writes the TOML)."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from costmodel import machine
from costmodel.cluster import load_profile

EPILOG = """examples:
  planner profile                     measure this machine into the cache: --cluster 1x2xlocal uses it
                                      (the first use of `local` runs this by itself)
  planner profile --quick             about half the time, coarser curves
  planner profile --out mybox.toml --nproc 4 --thorough

Budget: about 45 s on a CPU (at most 60 s on a 2-core one) and 90 s on a GPU by default; each
curve grows its sizes only while one point stays under a per-point budget and extrapolates
beyond (holding the largest measured rate, said in the profile). A dtype the hardware does not
accelerate (e.g. bf16 on a CPU without AMX) is measured at small sizes only and marked.
After the microbenchmarks, small training steps (two-layer probe model; one rank, recompute,
DP, TP, PP; per dtype) measure what a step adds (per-kernel overhead, collectives inside
FSDP/DTensor, overlap); those factors are fitted and written under [efficiency], the raw
microbenchmark figures stay under [measured]."""


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None,
                   help=f"profile to write (default: this machine's cached `local` profile, {machine.local_profile_path()})")
    p.add_argument("--nproc", type=int, default=None,
                   help="local ranks measured together (default 2, or 1 on a machine with one GPU)")
    p.add_argument("--name", help="device name in the profile (default: the file name; `local` for the cache)")
    speed = p.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_true", help="about half the default budget")
    speed.add_argument("--thorough", action="store_true", help="a few minutes: larger sizes, more probes' steps")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")


# Phase weights of the progress bar: the budget's shares (runtime.profiler.PHASE_SHARES) and the fit.
class Progress:
    """A bar over the budget's phases with elapsed time and an ETA, on stderr."""

    def __init__(self, weights: dict[str, float]) -> None:
        # plain data only: ranks started by spawn (CUDA) receive a pickled copy
        self.weights, self.start = weights, time.perf_counter()
        self.done: dict[str, float] = {}
        self._last: str | None = None

    def report(self, phase: str, fraction: float, what: str) -> None:
        self.done[phase] = max(self.done.get(phase, 0.0), min(1.0, fraction))
        total = sum(self.weights.values())
        frac = sum(self.weights.get(k, 0.0) * v for k, v in self.done.items()) / total
        elapsed = time.perf_counter() - self.start
        eta = f"ETA {elapsed * (1 - frac) / frac:4.0f} s" if frac > 0.02 else "ETA    ? s"
        filled = int(30 * frac)
        if not sys.stderr.isatty():   # a log, not a terminal: one line per phase
            if phase != self._last:
                self._last = phase
                sys.stderr.write(f"[planner profile] {elapsed:5.1f} s  {phase}\n")
            return
        sys.stderr.write(f"\r[{'#' * filled}{' ' * (30 - filled)}] {elapsed:5.1f} s  {eta}  {what:<44.44}")
        sys.stderr.flush()

    def close(self) -> None:
        if sys.stderr.isatty():
            sys.stderr.write("\n")
        sys.stderr.flush()


@dataclass(frozen=True)
class Setup:
    out: Path
    name: str
    mode: str
    nproc: int
    device_type: str
    threads: int
    command: str


def _setup(args: argparse.Namespace) -> Setup:
    import torch
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    nproc = args.nproc if args.nproc is not None else (min(2, gpus) if cuda else 2)
    if nproc < 1:
        raise ValueError("--nproc must be at least 1")
    if cuda and gpus < nproc:
        raise ValueError(f"--nproc {nproc}: this machine has {gpus} GPU(s)")
    if not cuda and nproc < 2:
        raise ValueError("--nproc must be at least 2 on a CPU (collectives and two-rank probes need two ranks)")
    cached = args.out is None
    out = machine.local_profile_path() if cached else Path(args.out)
    if out.suffix != ".toml":
        raise ValueError(f"--out {out}: a profile is a .toml file")
    if out.exists() and not cached and not args.force:
        raise ValueError(f"--out {out} exists; pass --force to replace it")
    mode = "quick" if args.quick else "thorough" if args.thorough else "default"
    flags = " --quick" if args.quick else " --thorough" if args.thorough else ""
    command = f"planner profile{'' if cached else f' --out {out}'} --nproc {nproc}{flags}"
    return Setup(out=out, name=args.name or ("local" if cached else out.stem), mode=mode, nproc=nproc,
                 device_type="cuda" if cuda else "cpu",
                 threads=1 if cuda else max(1, (os.cpu_count() or 1) // nproc), command=command)


def cmd_profile(args: argparse.Namespace) -> int:
    setup = _setup(args)
    replaced = setup.out.exists()
    profile_machine(setup)
    print(("replaced " if replaced else "wrote ") + f"{setup.out}; use --cluster 1x{setup.nproc}x"
          + ("local" if args.out is None else str(setup.out)))
    return 0


def measure_local(quick: bool = False) -> Path:
    """Measure this machine into the `local` cache (the first use of `--cluster ...xlocal`)."""
    args = argparse.Namespace(out=None, nproc=None, name=None, quick=quick, thorough=False, force=False)
    setup = _setup(args)
    profile_machine(setup)
    return setup.out


def profile_machine(setup: Setup) -> None:
    """Microbenchmarks, then probes and their fit, then the TOML (written to a temporary file
    and renamed, so an interrupted profile never leaves a half-written one)."""
    from planner import probes
    from runtime import profiler as prof
    from runtime.fork import run_forked
    budget = prof.BUDGETS[(setup.mode, setup.device_type)]
    dtypes = list(prof.DTYPES)
    weights = {**{f"gemm {d}": prof.PHASE_SHARES["gemm"] / len(dtypes) for d in dtypes},
               **{k: v for k, v in prof.PHASE_SHARES.items() if k not in ("gemm", "probes")},
               # one-rank probes are half of them (runtime: run_forked per world size)
               **({"probes 1": prof.PHASE_SHARES["probes"] * 0.5,
                   f"probes {setup.nproc}": prof.PHASE_SHARES["probes"] * 0.5} if setup.nproc > 1
                  else {"probes 1": prof.PHASE_SHARES["probes"]}), "fit": 0.08}
    progress = Progress(weights)
    start = time.perf_counter()
    try:
        micro = run_forked(setup.nproc, prof.measure_rank, dtypes, setup.device_type, setup.threads, budget,
                           progress.report, device_type=setup.device_type)[0]
        base_text = profile_toml(setup, micro, None)
        with tempfile.TemporaryDirectory() as tmp:
            base_path = Path(tmp) / "base.toml"
            base_path.write_text(base_text)
            base = load_profile(base_path)
        for phase in weights:   # the ranks reported on their own copies of the bar
            if not phase.startswith(("probes", "fit")):
                progress.report(phase, 1.0, "microbenchmarks done")
        accelerated = {d: micro["gemm"][d].accelerated for d in dtypes}
        measured = []
        for ranks in sorted({1, setup.nproc}):
            phase = f"probes {ranks}"
            plans = probes.probe_plans(base, accelerated, ranks)
            raws = run_forked(ranks, prof.probe_rank, plans, setup.threads,
                              budget.phase_s("probes") * weights[phase] / prof.PHASE_SHARES["probes"],
                              partial(progress.report, phase), device_type=setup.device_type)[0]
            progress.report(phase, 1.0, f"{len(plans)} probe plans on {ranks} rank(s)")
            measured += probes.results(plans, raws)
        progress.report("fit", 0.0, f"fitting {len(measured)} probe steps")
        fitted = probes.fit_probes(measured, base)
        progress.report("fit", 1.0, f"done in {time.perf_counter() - start:.0f} s")
    finally:
        progress.close()
    text = profile_toml(setup, micro, (measured, *fitted), elapsed_s=time.perf_counter() - start)
    setup.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = setup.out.with_suffix(".toml.partial")
    tmp_out.write_text(text)
    tmp_out.replace(setup.out)
    _summary(setup, micro, measured, fitted)


def _summary(setup: Setup, micro: dict, measured, fitted) -> None:
    device, _, before, after = fitted
    gemm = micro["gemm"]
    rates = ", ".join(f"{d} {max(r for _, r in c.points) / 1e9:,.1f}" + ("" if c.accelerated else " (not accelerated)")
                      for d, c in gemm.items())
    print(f"GEMM up to {rates} GFLOP/s; memory-bound up to "
          f"{max(r for _, r in micro['memory'].points) / 1e9:.1f} GB/s; {len(measured)} probe steps: "
          f"step-time error {before['mape_pct']:.0f}% on the microbenchmarks alone -> {after['mape_pct']:.1f}% "
          "fitted (per-kernel overhead " + ", ".join(f"{d} {e.kernel_overhead_s * 1e6:.0f} us"
                                                     for d, e in device.dtype_efficiency)
          + f"; collectives at {device.intra_node.efficiency:.2f} of their microbenchmark bandwidth, "
          f"overlap {device.efficiency.overlap:.2f})", file=sys.stderr)


def _pairs(points) -> str:
    return "[" + ", ".join(f"[{x:.6g}, {y:.6g}]" for x, y in points) + "]"


def _monotone_by_size(points) -> list[tuple[float, float]]:
    """One rate per size (the best kernel kind there), sorted: what interpolation needs."""
    best: dict[float, float] = {}
    for size, rate in points:
        best[size] = max(rate, best.get(size, 0.0))
    return sorted(best.items())


def profile_toml(setup: Setup, micro: dict, probed, elapsed_s: float = 0.0) -> str:
    """The profile text. Without `probed` (the probes' results and fit) it is the base the probes
    are predicted with: efficiencies 1, no per-kernel cost."""
    from runtime import profiler as prof
    date = time.strftime("%Y-%m-%d")
    ident = machine.identity()
    desc = machine.describe(ident)
    how = f"measured {date} by `{setup.command}` on {desc}, {setup.threads} thread(s) per rank"
    gemm, memory = micro["gemm"], _monotone_by_size(micro["memory"].points)
    samples = micro.get("collectives")
    cpu = setup.device_type == "cpu"
    if samples:
        alpha, beta, rms, p2p = prof.fit_alpha_beta(samples, setup.nproc)
        net_how = (f"alpha-beta ring fit over {sum(len(v) for k, v in samples.items() if k != 'p2p')} collective "
                   f"samples on {setup.nproc} ranks (rms {100 * rms:.0f}%)")
    else:   # one GPU: no peer to measure; single-device plans never use the network
        alpha, beta, rms, p2p = 1e-5, 1e10, 0.0, 1e-5
        net_how = "not measured (one device, no peer): a placeholder that single-device plans never use"
    device, params, before, after = (None, {}, None, None) if probed is None else probed[1:]
    eff = device.efficiency if device else None
    tier = device.intra_node if device else None
    fitted = f"fitted to {len(probed[0])} probe training steps (see [probes])" if probed else ""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 2**34
    mem_bytes = ram // setup.nproc if cpu else _cuda_memory()
    peaks = ", ".join(f"{k} = {max(r for _, r in c.points):.6g}" for k, c in gemm.items())
    lines = [
        f"# Device profile of this machine: {how}, {elapsed_s:.0f} s.",
        "# Peaks are the best measured rates; the curves under [measured] are what the cost model uses.",
        f"# All {setup.nproc} ranks measured at once (each shares cores, caches and memory bandwidth with the",
        "# others, as the ranks of a run do); rank 0's figures are written. [efficiency] holds what",
        "# training steps add to the microbenchmarks, fitted to the probes at the end of this file.",
        "",
        "[device]",
        f'name = "{setup.name}"',
        f'kind = "{"cpu" if cpu else "gpu"}"',
        "aliases = []",
        f"peak_flops_per_s = {{ {peaks} }}  # measured: best GEMM rate of the curves below",
        f"memory_bytes = {int(mem_bytes)}  # " + (f"this machine's RAM / {setup.nproc} ranks (a choice)" if cpu
                                                 else "device memory (torch.cuda.get_device_properties)"),
        f"memory_bandwidth_bytes_per_s = {max(r for _, r in memory):.6g}  # measured: best memory-bound kernel rate",
        "",
        "[[network]]",
        'scope = "node"',
        f'name = "{"gloo" if cpu else "nccl"}-local"',
        f"bandwidth_bytes_per_s = {beta:.6g}  # measured: {net_how}",
        f"latency_s = {tier.latency_s if tier else alpha:.6g}  # " + (
            f"probes: the measured {alpha:.3g} s per ring step x {params.get('comm_latency', 1.0):.3g}" if tier
            else "measured: same fit, per ring step"),
        f"p2p_latency_s = {tier.p2p_latency_s if tier else p2p:.6g}  # " + (
            f"probes: the measured {p2p:.3g} s x {params.get('comm_latency', 1.0):.3g}" if tier
            else "measured: send/recv of the smallest messages (median)"),
        "",
        "[[network]]",
        'scope = "cluster"',
        'name = "unmeasured"',
        f"bandwidth_bytes_per_s = {beta:.6g}  # no second machine measured: the node figure stands in",
        f"latency_s = {alpha:.6g}  # no second machine measured: the node figure stands in",
        "",
        "[efficiency]",
        *(_fitted_efficiency(eff, tier, micro, fitted) if eff else _base_efficiency(micro)),
        "reserved_memory_bytes = 268435456  # assumed: interpreter + torch runtime, ~256 MiB",
        f'source = "{how}"',
        "",
        *(_dtype_tables(device, micro, fitted) if device else []),
        "[measured]",
        f'date = "{date}"',
        f'command = "{setup.command}"',
        f'machine = "{desc}"',
        f'machine_key = "{machine.machine_key(ident)}"  # costmodel.machine: processor, cores, torch, GPU',
        f"threads_per_rank = {setup.threads}  # `planner run` gives each CPU rank this many threads",
        *[f"gemm_{k} = {_pairs(c.points)}  # [FLOPs per call, FLOP/s]" for k, c in gemm.items()],
        *[f"# gemm_{k}: the budget stopped before {c.stopped_before:.3g} FLOPs per call; larger GEMMs are "
          "priced at the largest measured rate (extrapolated)" for k, c in gemm.items() if c.stopped_before],
        *[f"# gemm_{k}: NOT ACCELERATED here (below {prof.ACCELERATED_RATIO} of fp32's rate at equal FLOPs); "
          "measured at small sizes only" for k, c in gemm.items() if not c.accelerated],
        f"memory_bound = {_pairs(memory)}  # [bytes moved per call, bytes/s]",
        *([f"# memory_bound: the budget stopped before {micro['memory'].stopped_before:.3g} bytes per call; "
           "larger kernels are priced at the largest measured rate"] if micro["memory"].stopped_before else []),
        f"attention_efficiency = {{ {', '.join(f'{k} = {v:.4g}' for k, v in micro['attention'].items())} }}"
        "  # causal SDPA rate / GEMM rate at equal FLOPs",
        f"op_overhead_s = {micro['overhead_s']:.4g}  # a one-element add, the bare dispatch cost",
        f"collective_alpha_s = {alpha:.6g}  # the microbenchmark fit, before the probes",
        f"collective_p2p_latency_s = {p2p:.6g}",
        *[f"collective_{k} = {_pairs(v)}  # [bytes, seconds]" for k, v in (samples or {}).items()],
        "",
        *(_probes_section(probed) if probed else []),
    ]
    return "\n".join(lines)


def _base_efficiency(micro: dict) -> list[str]:
    attention = micro["attention"]
    return ["gemm = 1.0  # the measured GEMM curve already is the achieved rate",
            f"attention = {attention[next(iter(attention))]:.4g}  # measured: causal SDPA rate / GEMM rate",
            "memory = 1.0  # the measured memory-bound curve already is the achieved rate",
            "kernel_overhead_s = 0.0",
            "intra_node_comm = 1.0  # the fit above is the achieved rate",
            "inter_node_comm = 1.0",
            "overlap = 0.5"]


def _fitted_efficiency(eff, tier, micro: dict, fitted: str) -> list[str]:
    attention = micro["attention"]
    first = next(iter(attention))
    return [f"gemm = {eff.gemm:.4g}  # {fitted}: training's share of the measured GEMM curve",
            f"attention = {eff.attention:.4g}  # measured causal SDPA / GEMM ({attention[first]:.3g}, {first}) x the "
            "same factor",
            f"memory = {eff.memory:.4g}  # {fitted}: share of the measured memory-bound curve",
            f"kernel_overhead_s = {eff.kernel_overhead_s:.4g}  # {fitted}: eager work per kernel "
            f"(autograd, modules, hooks; bare operator {micro['overhead_s']:.2g} s)",
            f"intra_node_comm = {tier.efficiency:.4g}  # {fitted}: collectives inside FSDP / DTensor / pipelining "
            "over the microbenchmark fit",
            "inter_node_comm = 1.0",
            f"overlap = {eff.overlap:.4g}  # {fitted}: share of data-parallel communication hidden by compute"]


def _dtype_tables(device, micro: dict, fitted: str) -> list[str]:
    out = []
    for dtype, eff in device.dtype_efficiency:
        out += [f"[efficiency.{dtype}]  # {fitted}, the one-rank probes in {dtype}",
                f"gemm = {eff.gemm:.4g}",
                f"attention = {eff.attention / eff.gemm * micro['attention'][dtype] / next(iter(micro['attention'].values())):.4g}"
                f"  # measured causal SDPA / GEMM in {dtype} ({micro['attention'][dtype]:.3g}) x the gemm factor",
                f"memory = {eff.memory:.4g}",
                f"kernel_overhead_s = {eff.kernel_overhead_s:.4g}",
                ""]
    return out


def _probes_section(probed) -> list[str]:
    measured, device, params, before, after = probed
    from planner.calibrate import Run, predict_with
    lines = ["[probes]",
             f"# step-time MAPE of the probes: {before['mape_pct']:.1f}% with the microbenchmarks alone, "
             f"{after['mape_pct']:.1f}% fitted (max {after['max_abs_error_pct']:.1f}%)",
             "fitted_factors = { " + ", ".join(f"{k} = {v:.4g}" for k, v in params.items()) + " }",
             "steps = ["]
    for p in measured:
        run = Run(path=Path("probe"), pf=p.pf, measured_step_s=p.step_time_s)
        predicted = predict_with(run, device).step_time_s
        lines.append(f'  {{ plan = "{p.pf.model.name} {p.pf.train.compute_dtype} {p.pf.plan.short()}", '
                     f"measured_s = {p.step_time_s:.5g}, predicted_s = {predicted:.5g} }},")
    return lines + ["]", ""]


def _cuda_memory() -> int:
    import torch
    return torch.cuda.get_device_properties(0).total_memory
