"""`planner profile`: measure this machine and write a device profile (runtime.profiler does
the measuring, planner.measure.probes the training-step probes and their fit; this module drives them
under a time budget, shows progress with an ETA and writes the TOML)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from costmodel import machine
from costmodel.hardware import DeviceProfile
from costmodel.inputs import UserError
from planner import outputs
from planner.args import DEGREE, add_overwrite_arg, positive_float, refuse_ignored
from planner.measure import profile_file
from planner.measure.profile_doc import Setup, measured_profile

EPILOG = """examples:
  planner profile                     measure this machine into the cache: --cluster 1x2xlocal uses it
                                      (the first use of `local` runs this by itself)
  planner profile --quick             30 s instead of 45 s on a CPU: coarser curves, fewer probes
  planner profile --out mybox.toml --nproc 4 --thorough

Budget: about 45 s on a CPU (at most 60 s on a 2-core one) and 90 s on a GPU by default; each
curve grows its sizes only while one point stays under a per-point budget and extrapolates
beyond (holding the largest measured rate, said in the profile). A dtype the hardware does not
accelerate (e.g. bf16 on a CPU without AMX) is measured at small sizes only and marked.
After the microbenchmarks, small training steps (two-layer probe model; one rank, recompute,
DP, TP, PP; per dtype) measure what a step adds (per-kernel overhead, collectives inside
FSDP/DTensor, on a GPU the overlap, on a CPU DP's collectives' own speed); those factors are fitted and written under [efficiency], the raw
microbenchmark figures stay under [measured]."""


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None,
                   help="profile to write (default: this machine's cached `local` profile, "
                        f"{machine.cache_dir() / 'profiles'}/local-KEY.toml, KEY a hash of the processor, core "
                        "count, torch build and GPU model, which a new measurement replaces: --overwrite is for "
                        "an --out file)")
    p.add_argument("--nproc", type=DEGREE, default=None,
                   help="local ranks measured together (default 2, or 1 on a machine with one GPU)")
    p.add_argument("--name", help="device name in the profile: letters, digits, '.', '_', '-', not a shipped "
                                  "device's name or alias (default: the file name; `local` for the cache)")
    speed = p.add_mutually_exclusive_group()
    speed.add_argument("--quick", action="store_true", help="a shorter budget (30 s on a CPU, 45 s on a GPU)")
    speed.add_argument("--thorough", action="store_true", help="larger sizes, within up to 240 s on a CPU, 400 s on a GPU "
                                                                "(less where every size is measured sooner)")
    p.add_argument("--budget-s", type=positive_float, default=None,
                   help=f"the time the command may take, start-up included, instead of the mode's (default "
                        f"45 s on a CPU, 90 s on a GPU); at least {MIN_BUDGET_S:.0f} s: start-up takes seconds and "
                        f"the fit keeps {FIT_RESERVE_S:.0f}. A shorter budget measures fewer sizes and probes")
    add_overwrite_arg(p)


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
        eta = f"{elapsed * (1 - frac) / frac:4.0f}" if frac > 0.02 else "   ?"
        filled = int(30 * frac)
        if not sys.stderr.isatty():   # a log, not a terminal: one line per phase
            if phase != self._last:
                self._last = phase
                sys.stderr.write(f"[planner profile] {elapsed:5.1f} s, ETA {eta.strip()} s: {phase}\n")
            return
        sys.stderr.write(f"\r[{'#' * filled}{' ' * (30 - filled)}] {elapsed:5.1f} s  ETA {eta} s  {what:<44.44}")
        sys.stderr.flush()

    def caught_up(self, phases: list[str], what: str) -> None:
        """`phases` done (forked ranks showed them on their own copies of the bar): the bar is
        redrawn on a terminal; a log, which has their lines already, gets none."""
        for phase in phases:
            self.done[phase] = 1.0
        self._last = phases[-1] if phases else self._last
        if phases:
            self.report(phases[-1], 1.0, what)

    def close(self) -> None:
        if sys.stderr.isatty():
            sys.stderr.write("\n")
        sys.stderr.flush()


def _check_own_name(name: str, given: str, cached: bool) -> None:
    """A measured profile's [device] name is written into plans, tables and sweeps beside the
    shipped ones: a name of its own (a shipped device's name or alias would label this machine's
    figures as that GPU's, and resolve to the shipped profile), of letters, digits, '.', '_', '-'."""
    from costmodel.hardware.profile_io import known_profiles
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name) or not re.search(r"[A-Za-z0-9]", name):
        raise UserError(f"{given} {name!r}: a device name is letters, digits, '.', '_' and '-', with a letter or digit")
    if name.lower() == machine.LOCAL and not cached:
        raise UserError(f"{given} {name!r} is the cached profile's (`local`); give --name another")
    for shipped in known_profiles().values():
        if name.lower() in (n.lower() for n in (shipped.name, *shipped.aliases)):
            raise UserError(f"{given} {name!r} names the shipped device {shipped.name}; give this machine's "
                            "profile a name of its own (--name)")


def _setup(args: argparse.Namespace) -> Setup:
    import torch
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    nproc = args.nproc if args.nproc is not None else (min(2, gpus) if cuda else 2)
    if nproc < 1:
        raise UserError("--nproc must be at least 1")
    if cuda and gpus < nproc:
        raise UserError(f"--nproc {nproc}: this machine has {gpus} GPU(s)")
    if not cuda and nproc < 2:
        raise UserError("--nproc must be at least 2 on a CPU (collectives and two-rank probes need two ranks)")
    if not cuda and nproc > (cores := os.cpu_count() or 1):   # ranks sharing a core time each other, not the machine
        raise UserError(f"--nproc {nproc}: this machine has {cores} CPU cores; measure with at most one rank per core")
    cached = args.out is None
    if cached:
        refuse_ignored(getattr(args, "given", {}), {"overwrite"},
                       "the cached profile is replaced whenever it is measured; --overwrite is for --out")
    out = machine.local_profile_path() if cached else outputs.out_file(args.out, "--out", args.overwrite, ".toml")
    if cached and (problem := outputs.writable_dir_problem(out.parent)):   # before a minute of measuring
        raise UserError(f"the profile cache {out.parent}: {problem} (set PLANNER_CACHE_DIR, or pass --out)")
    mode = "quick" if args.quick else "thorough" if args.thorough else "default"
    budget_s = getattr(args, "budget_s", None)
    if budget_s is not None and budget_s < MIN_BUDGET_S:
        raise UserError(f"--budget-s {budget_s:g}: at least {MIN_BUDGET_S:.0f} s (start-up takes seconds and "
                         f"the probes' fit keeps {FIT_RESERVE_S:.0f})")
    flags = (" --quick" if args.quick else " --thorough" if args.thorough else "") + \
        (f" --budget-s {budget_s:g}" if budget_s is not None else "")
    command = f"planner profile{'' if cached else f' --out {out}'} --nproc {nproc}{flags}"
    name = args.name or ("local" if cached else out.stem)
    _check_own_name(name, "--name" if args.name else "the name from --out's file name", cached)
    return Setup(out=out, name=name, mode=mode, nproc=nproc,
                 device_type="cuda" if cuda else "cpu",
                 threads=1 if cuda else max(1, (os.cpu_count() or 1) // nproc), command=command,
                 budget_s=budget_s, overwrite=cached or args.overwrite)


def cmd_profile(args: argparse.Namespace) -> int:
    setup = _setup(args)
    replaced = setup.out.exists()
    profile_machine(setup)
    print(("replaced " if replaced else "wrote ") + f"{setup.out}; use --cluster 1x{setup.nproc}x"
          + ("local" if args.out is None else str(setup.out)))
    return 0


# What the fit of the probes needs at most, kept out of the probes' share of the total.
FIT_RESERVE_S = 6.0
GROUP_START_S = 1.0   # a forked group's start (fork, gloo's group), in no phase's share
MIN_BUDGET_S = 20.0   # --budget-s: below it start-up and the fit's reserve leave the measurements next to nothing


def _base_profile(setup: Setup, micro: dict) -> DeviceProfile:
    """The microbenchmarks' profile, as the probes' plans and fit start from it."""
    with tempfile.TemporaryDirectory() as tmp:
        return profile_file.write(Path(tmp) / "base.toml", measured_profile(setup, micro))


def _left_s(end_s: float) -> float:
    return max(0.0, end_s - time.perf_counter())


def _probe_budget_s(end_s: float, ranks: int, nproc: int, second_pass_s: float = 0.0) -> float:
    """What the microbenchmarks left of the budget (ending at `end_s`, perf_counter) less the
    fit's reserve, half the CPU's second pass's limit (it measures the points the first pass
    measured, so it mostly takes about half its limit) and the start of each forked group still
    to run, split between the one-rank and the N-rank probes; 0 when nothing is left (each group
    still measures its first probe)."""
    share = 0.5 if ranks == 1 and nproc > 1 else 1.0
    starts = (2 if ranks == 1 and nproc > 1 else 1) + (second_pass_s > 0)   # forked groups still to start
    return max(0.0, _left_s(end_s) - FIT_RESERVE_S - second_pass_s / 2 - starts * GROUP_START_S) * share


def measure_local() -> Path:
    """Measure this machine into the `local` cache (the first use of `--cluster ...xlocal`)."""
    args = argparse.Namespace(out=None, nproc=None, name=None, quick=False, thorough=False, overwrite=False)
    setup = _setup(args)
    profile_machine(setup)
    return setup.out


def profile_machine(setup: Setup) -> None:
    """Microbenchmarks, then probes, then (on a CPU) the curves' second pass, then the probes'
    fit on the final curves, then the TOML (written to a temporary file and renamed, so an
    interrupted profile never leaves a half-written one)."""
    from planner.measure import probes
    from runtime import profiler as prof
    from runtime.fork import run_forked
    budget = prof.BUDGETS[(setup.mode, setup.device_type)]
    end_s = setup.started_s + (setup.budget_s or budget.total_s)
    # the microbenchmarks' shares are of what start-up (importing torch: seconds) left
    budget = dataclasses.replace(budget, total_s=_left_s(end_s))
    dtypes = list(prof.DTYPES)
    weights = {**{f"gemm {d}": prof.PHASE_SHARES["gemm"] / len(dtypes) for d in dtypes},
               **{k: v for k, v in prof.PHASE_SHARES.items() if k not in ("gemm", "probes")},
               # one-rank probes are half of them (runtime: run_forked per world size)
               **({"probes 1": prof.PHASE_SHARES["probes"] * 0.5,
                   f"probes {setup.nproc}": prof.PHASE_SHARES["probes"] * 0.5} if setup.nproc > 1
                  else {"probes 1": prof.PHASE_SHARES["probes"]}), "fit": 0.08,
               # a CPU measures its curves twice (runtime.profiler.second_pass_rank, after the probes):
               # the second pass takes about half the first's time, a quarter of the curves' share
               **({"second pass": sum(prof.PHASE_SHARES[k] for k in prof.CURVE_PHASES) / 4}
                  if setup.device_type == "cpu" else {})}
    progress = Progress(weights)
    start = setup.started_s
    try:
        micro = run_forked(setup.nproc, prof.measure_rank, dtypes, setup.device_type, setup.threads, budget,
                           progress.report, probes.LAYER_PROBE, device_type=setup.device_type)[0]
        second_pass_s = micro.pop("second_pass_limit_s", 0.0)
        base = _base_profile(setup, micro)
        # the ranks reported on their own copies of the bar
        progress.caught_up([p for p in weights if not p.startswith(("probes", "fit", "second pass"))],
                           "microbenchmarks done")
        accelerated = {d: micro["gemm"][d].accelerated for d in dtypes}
        measured, skipped = [], []
        for ranks in sorted({1, setup.nproc}):
            phase = f"probes {ranks}"
            plans = probes.probe_plans(base, accelerated, ranks)
            raws = run_forked(ranks, prof.probe_rank, plans, setup.threads,
                              _probe_budget_s(end_s, ranks, setup.nproc, second_pass_s),
                              partial(progress.report, phase), device_type=setup.device_type)[0]
            progress.caught_up([phase], f"{len(plans)} probe plans on {ranks} rank(s)")
            measured += probes.results(plans, raws)
            skipped += [probes.probe_name(pf) for pf, raw in zip(plans, raws) if raw is None]
        if setup.device_type == "cpu":
            micro = _second_pass(setup, micro, min(second_pass_s, _left_s(end_s) - FIT_RESERVE_S),
                                 second_pass_s, budget.point_s, progress)
            base = _base_profile(setup, micro)
        progress.report("fit", 0.0, f"fitting {len(measured)} probe steps")
        fitted = probes.fit_probes(measured, base, micro.get("layer_ops"))
        progress.report("fit", 1.0, f"done in {time.perf_counter() - start:.0f} s")
    finally:
        progress.close()
    profile_file.write(setup.out, measured_profile(setup, micro, (measured, *fitted),
                                                   elapsed_s=time.perf_counter() - start, skipped=skipped),
                       setup.overwrite)
    _summary(setup, micro, measured, fitted, skipped)


def _second_pass(setup: Setup, micro: dict, limit_s: float, planned_s: float, point_s: float, progress) -> dict:
    """A CPU's curves measured again within `limit_s` where the probes left at least a quarter of
    the `planned_s` reserved for it (it has parts measured whatever its limit: seconds), else the
    first pass's, sorted."""
    from planner.measure import probes
    from runtime import profiler as prof
    from runtime.fork import run_forked
    if planned_s <= 0 or limit_s < planned_s / 4:
        progress.report("second pass", 1.0, "no time left for a second pass")
        return {**micro, "gemm": prof.sorted_gemm(micro["gemm"])}
    micro = run_forked(setup.nproc, prof.second_pass_rank, micro, setup.threads, point_s, limit_s,
                       partial(progress.report, "second pass"), probes.LAYER_PROBE)[0]
    progress.report("second pass", 1.0, "curves measured again")
    return micro


def _summary(setup: Setup, micro: dict, measured, fitted, skipped: list[str]) -> None:
    device, _, before, after = fitted
    gemm = micro["gemm"]
    rates = ", ".join(f"{d} {max(r for _, r in c.points) / 1e9:,.1f}" + ("" if c.accelerated else " (not accelerated)")
                      for d, c in gemm.items())
    print(f"GEMM up to {rates} GFLOP/s; memory-bound up to "
          f"{max(r for _, r in micro['memory'].points) / 1e9:.1f} GB/s; {len(measured)} probe steps"
          + (f" ({len(skipped)} more the budget left no time for)" if skipped else "") + ": "
          f"step-time error {before['mape_pct']:.0f}% on the microbenchmarks alone -> {after['mape_pct']:.1f}% "
          "fitted (per-kernel overhead " + ", ".join(f"{d} {e.kernel_overhead_s * 1e6:.0f} us"
                                                     for d, e in device.dtype_efficiency)
          + f"; collectives at {device.intra_node.efficiency:.2f} of their microbenchmark bandwidth, "
          + (f"overlap {device.efficiency.overlap:.2f})" if setup.device_type == "cuda" else
             f"DP's at {device.efficiency.dp_comm:.2f}x that, not hidden)"), file=sys.stderr)
