"""Fit a device profile's few physical parameters to measured runs (`planner calibrate`).

Parameters: compute efficiency (a factor on the GEMM and attention rates; on a CPU whose profile
timed SDPA, attention is priced at those times and no factor moves it), memory-bound
efficiency, the per-kernel overhead training adds, and the node tier's communication bandwidth
efficiency and latency factor (the software cost of a collective, e.g. DTensor's redistribution
on CPU, scales its fixed part), and the overlap of data-parallel communication with compute
(on a CPU, where it does not hide, DP's collectives' own speed instead: CPU_COMM_PARAMS).
They are fitted by least squares on log(predicted / measured) step time over all runs
(bounded Nelder-Mead, positive parameters on a log scale), predictions recomputed by
`costmodel.estimate` with the candidate profile: no per-plan factors. The runs that recompute
also fit what recomputing a layer costs against the forward the model says it re-runs (one
factor for all dtypes, 1 in a profile; the early stop is priced apart, not by this factor:
costmodel.frameworks `recompute_early_stop`). With GPU runs that record
`torch.cuda.max_memory_reserved` beside `max_memory_allocated`, the allocator's fragmentation is
set to the median of reserved over allocated minus one (what the caching allocator holds beyond
its tensors). The fixed reserve (CUDA context, NCCL buffers) lies outside the allocator, no run
record measures it, and it keeps the profile's sourced value; CPU runs measure tensors only.
"""
from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import replace

from scipy.optimize import minimize

from costmodel.hardware import DeviceProfile
from costmodel.inputs import UserError
from costmodel.plan import Recompute
from planner.measure.run_dirs import Run, predict_with

PARAMS = ("compute", "memory", "kernel_overhead_s", "intra_node_comm", "comm_latency", "overlap")


IDENTITY = {"compute": 1.0, "memory": 1.0, "intra_node_comm": 1.0, "comm_latency": 1.0, "dp_comm": 1.0,
            "pp_stage": 1.0}


def _scaled(eff, x: dict[str, float]):
    out = replace(eff, gemm=eff.gemm * x["compute"], attention=eff.attention * x["compute"],
                  memory=eff.memory * x["memory"])
    # seconds, and recomputation's share of a forward: values, not factors
    absolute = {k: x[k] for k in ("kernel_overhead_s", "step_overhead_s", "recompute_cost") if k in x}
    return replace(out, **absolute)


def with_params(base: DeviceProfile, x: dict[str, float], dtype: str | None = None) -> DeviceProfile:
    """`base` with the factors `x` applied (a parameter missing from `x` leaves its value
    alone); per-dtype efficiencies are scaled alike. With `dtype`, only that dtype's compute
    factors (its own efficiency, made from the device's if it has none yet)."""
    x = {**IDENTITY, **x}
    if dtype is not None:
        own = dict(base.dtype_efficiency).get(dtype, base.efficiency)
        rest = tuple((d, e) for d, e in base.dtype_efficiency if d != dtype)
        return replace(base, dtype_efficiency=rest + ((dtype, _scaled(own, x)),))
    eff = replace(_scaled(base.efficiency, x), overlap=x.get("overlap", base.efficiency.overlap),
                  dp_comm=base.efficiency.dp_comm * x["dp_comm"], pp_stage=base.efficiency.pp_stage * x["pp_stage"])
    per_dtype = tuple((d, _scaled(e, x)) for d, e in base.dtype_efficiency)
    tier = base.intra_node
    intra = replace(tier, efficiency=tier.efficiency * x["intra_node_comm"],
                    latency_s=tier.latency_s * x["comm_latency"],
                    p2p_latency_s=None if tier.p2p_latency_s is None else tier.p2p_latency_s * x["comm_latency"])
    return replace(base, efficiency=eff, intra_node=intra, dtype_efficiency=per_dtype)


def log_errors(runs: list[Run], device: DeviceProfile) -> list[float]:
    return [math.log(predict_with(r, device).step_time_s / r.measured_step_s) for r in runs]


def summary(runs: list[Run], device: DeviceProfile) -> dict[str, float]:
    errors = [100 * (math.exp(e) - 1) for e in log_errors(runs, device)]
    return {"mape_pct": statistics.mean(map(abs, errors)), "max_abs_error_pct": max(map(abs, errors))}


# Physical ranges (factors on the measured or datasheet values, except the overhead in seconds
# and the overlap fraction): the fit stays where the parameters still mean what they say.
BOUNDS = {"compute": (0.05, 2.0), "memory": (0.05, 2.0), "kernel_overhead_s": (1e-8, 1e-3),
          "step_overhead_s": (1e-6, 0.05), "recompute_cost": (0.3, 1.5),
          "intra_node_comm": (0.01, 2.0), "comm_latency": (0.5, 100.0), "overlap": (0.0, 1.0),
          "dp_comm": (0.1, 20.0), "pp_stage": (0.8, 2.0)}


GRID = 17   # points per parameter of a one- or two-parameter fit's starting grid


def _peak_caps(base: DeviceProfile, dtype: str | None, limits: dict) -> dict[str, tuple[float, float]]:
    """A datasheet GPU's GEMM, attention and memory efficiencies stay at most 1 of its peak, as
    the profile reader checks (costmodel.hardware.profile_check); a measured profile's peak is
    its own best GEMM, which it may pass."""
    if base.kind != "gpu" or base.machine_key:
        return {}
    effs = [dict(base.dtype_efficiency).get(dtype, base.efficiency)] if dtype else \
        [base.efficiency, *(e for _, e in base.dtype_efficiency)]
    compute, memory = max(max(e.gemm, e.attention) for e in effs), max(e.memory for e in effs)
    return {"compute": (limits["compute"][0], min(limits["compute"][1], 1.0 / compute)),
            "memory": (limits["memory"][0], min(limits["memory"][1], 1.0 / memory))}


def fit(runs: list[Run], base: DeviceProfile, names: tuple[str, ...] = PARAMS,
        max_iter: int = 3000, dtype: str | None = None, prior_weight: float = 0.0,
        bounds: dict[str, tuple[float, float]] | None = None) -> tuple[DeviceProfile, dict[str, float]]:
    """The parameters `names` fitted to `runs` (the others left as `base` has them); with
    `dtype`, compute factors of that dtype only (`with_params`)."""
    if not runs:
        raise UserError("no runs to calibrate on")
    # positive parameters are searched on a log scale, the overlap fraction directly
    linear = {"overlap"}
    own = base.for_dtype(dtype).efficiency if dtype else base.efficiency
    start = {"compute": 1.0, "memory": 1.0, "intra_node_comm": 1.0, "comm_latency": 1.0, "dp_comm": 1.0,
             "pp_stage": 1.0,
             "overlap": min(max(base.efficiency.overlap, 0.05), 0.95),
             "kernel_overhead_s": min(max(own.kernel_overhead_s, 1e-6), 1e-3),
             "step_overhead_s": min(max(own.step_overhead_s, 1e-4), 0.05),
             "recompute_cost": min(max(own.recompute_cost, 0.3), 1.5)}
    to_z = lambda k, v: v if k in linear else math.log(v)  # noqa: E731
    limits = {**BOUNDS, **(bounds or {})}
    # a link is never faster than its own microbenchmark (efficiency <= 1, as the profile reader
    # checks): a probe fit under a loaded machine can push it past that and write a profile
    # that cannot be read back
    lo, hi = limits["intra_node_comm"]
    limits["intra_node_comm"] = (lo, min(hi, 1.0 / base.intra_node.efficiency))
    start["intra_node_comm"] = min(1.0, limits["intra_node_comm"][1])
    limits.update(_peak_caps(base, dtype, limits))
    bounds = [(to_z(k, limits[k][0]), to_z(k, limits[k][1])) for k in names]
    x0 = [to_z(k, start[k]) for k in names]

    def unpack(z) -> dict[str, float]:
        return {k: float(v) if k in linear else math.exp(v) for k, v in zip(names, z)}

    z0 = list(x0)

    def loss(z) -> float:
        # the prior: the profile's own (measured, probe-fitted) values; a factor moves only as far
        # as the runs pay for it, so a few runs cannot swing a parameter they barely inform
        prior = prior_weight * sum((a - b) ** 2 for a, b in zip(z, z0))
        return prior + sum(e * e for e in log_errors(runs, with_params(base, unpack(z), dtype)))

    if len(names) <= 2:   # one or two parameters: started from the best point of a grid over
        # their ranges, since a loss can be flat on a side (a GPU's per-kernel cost below what
        # the device's own work hides changes nothing; a per-step cost far below the kernels'
        # neither), where Nelder-Mead started there would never move; jointly, since the per-kernel
        # and per-step costs trade along a valley one coordinate at a time does not follow
        axes = [[lo + (hi - lo) * j / (GRID - 1) for j in range(GRID)] for lo, hi in bounds]
        x0 = list(min(itertools.product(*axes), key=lambda z: loss(list(z))))
    best = None
    for _ in range(3):   # Nelder-Mead restarted from its own optimum escapes a collapsed simplex
        best = minimize(loss, x0 if best is None else best.x, method="Nelder-Mead", bounds=bounds,
                        options={"xatol": 1e-3, "fatol": 1e-7, "maxiter": max_iter})
    params = unpack(best.x)
    return with_params(base, params, dtype), params


def measured_fragmentation(runs: list[Run]) -> float | None:
    """The caching allocator's reserved over allocated bytes, less one: the median over the GPU
    runs' stages that record both peaks (None without any). The fixed reserve is left alone:
    set to measured allocated minus the prediction, it would become the tensors'
    under-prediction (the context and NCCL's buffers would drop out of every budget)."""
    ratios = [reserved / allocated - 1.0 for r in runs
              if r.measured is not None and r.measured.memory_from_cuda and r.measured.peak_reserved_bytes
              for allocated, reserved in zip(r.measured.peak_memory_bytes or [], r.measured.peak_reserved_bytes)
              if allocated and reserved]
    return max(0.0, statistics.median(ratios)) if ratios else None


COMPUTE_PARAMS = ("compute", "memory", "kernel_overhead_s")
# fitted on the runs that recompute, one for every dtype (Efficiency.recompute_cost): the cache
# effect behind it is the memory system's, and a dtype's own runs rarely hold a recomputing one
# beside the rest (without one they say nothing of it)
RECOMPUTE_PARAM = "recompute_cost"
COMM_PARAMS = ("intra_node_comm", "comm_latency", "overlap")
# On a CPU, data-parallel communication does not hide: FSDP's ranks wait on gloo in their own
# thread (`python benchmarks/step_trace.py PLAN.json` on a DP plan shows the waits), and
# compute and communication share the cores. Its collectives are bucketed, megabytes each, where
# TP's are many and activation-sized: one efficiency for both lets the fit hide DP's entirely
# (overlap near 1) and price DP plans too fast. So a CPU's overlap stays 0 and DP's collectives get a
# factor of their own (Efficiency.dp_comm). A pipeline stage's work, which runs over its price
# on a CPU where a one-rank plan's does not, gets one too (Efficiency.pp_stage).
CPU_COMM_PARAMS = ("intra_node_comm", "comm_latency", "dp_comm", "pp_stage")
# the links' own factors, as every collective pays them (DP's through dp_comm on top)
LINK_PARAMS = ("intra_node_comm", "comm_latency")
CPU_OVERLAP = 0.0


def comm_params(device: DeviceProfile) -> tuple[str, ...]:
    """The communication factors a fit on `device`'s multi-rank runs finds (on a CPU, with the
    pipeline stages' factor where some runs have a pipeline: fit_by_dtype)."""
    return CPU_COMM_PARAMS if device.kind == "cpu" else COMM_PARAMS


# Weight of the prior (the profile's own values) against the runs' squared log errors, per
# parameter in log space: chosen on benchmarks/closed_loop.py's runs of an unseen model
# (`python benchmarks/closed_loop.py --out DIR --skip-profile --skip-runs --prior-weight W` prints
# the leave-one-out error for a weight). Without a prior (0) a few runs swing the factors they
# barely inform and leave-one-out suffers most; 0.1 and 0.3 are close, and 0.3, the steadier, is kept.
PRIOR_WEIGHT = 0.3


def fit_by_dtype(runs: list[Run], base: DeviceProfile, rounds: int = 2, max_iter: int = 800,
                 prior_weight: float = PRIOR_WEIGHT, bounds: dict[str, tuple[float, float]] | None = None,
                 compute_on_one_rank: bool = False,
                 compute_params: tuple[str, ...] = COMPUTE_PARAMS,
                 fit_recompute: bool = True, fit_pp_stage: bool = True,
                 links_from_tp: bool = False) -> tuple[DeviceProfile, dict[str, float]]:
    """Compute factors per compute dtype (on a CPU, bf16 runs other kernels with other per-kernel
    costs than fp32), alternating with the shared communication factors on the multi-rank runs:
    small, well-posed fits instead of one of 3 x dtypes + 3 parameters. A dtype with fewer runs
    than compute parameters gets its rate factor only. `compute_on_one_rank`: the compute factors
    from the one-rank runs alone (the profiler's probes, where one rank runs alone on the node);
    `compute_params`: which of them are fitted (the others stay as `base` has them).
    `fit_recompute`: the cost of recomputation too, one for all dtypes, on the runs that recompute.
    `fit_pp_stage`: a CPU's pipeline-stage factor among the communication factors (Efficiency.pp_stage).
    `links_from_tp`: the links' factors (LINK_PARAMS) from the runs with tensor parallelism alone,
    then the other communication factors on every multi-rank run with the links held (all of
    them jointly where fewer than two different TP steps ran).
    Returns the device and the overall factors against `base` (per dtype as NAME@DTYPE)."""
    if not runs:
        raise UserError("no runs to calibrate on")
    device = base
    if "overlap" not in comm_params(base):   # a CPU's: whatever an older profile says (CPU_COMM_PARAMS)
        device = replace(base, efficiency=replace(base.efficiency, overlap=CPU_OVERLAP))
    # fp32 first: every dtype's loss runs fp32 kernels priced at fp32's factors (cross_entropy_s)
    dtypes = sorted({str(r.pf.train.compute_dtype) for r in runs}, key=lambda d: (d != "fp32", d))
    multi = [r for r in runs if r.pf.plan.world_size > 1]
    recomputing = [r for r in runs if r.pf.plan.recompute is not Recompute.NONE]
    comm_fits = _comm_fits(multi, base, fit_pp_stage, links_from_tp)
    for _ in range(rounds):
        for d in dtypes:
            mine = [r for r in runs if str(r.pf.train.compute_dtype) == d
                    and not (compute_on_one_rank and r.pf.plan.world_size > 1)]
            if not mine:
                continue
            names = compute_params if len(mine) >= len(compute_params) else compute_params[:1]
            device, _ = fit(mine, device, names, max_iter, dtype=d, prior_weight=prior_weight,
                            bounds=_left_of_bounds(base, device, d, bounds))
        if fit_recompute and recomputing:
            device, _ = fit(recomputing, device, (RECOMPUTE_PARAM,), max_iter, prior_weight=prior_weight)
        for some, names in comm_fits:
            device, _ = fit(some, device, names, max_iter, prior_weight=prior_weight,
                            bounds=_left_of_bounds(base, device, dtypes[0], bounds))
    if (fragmentation := measured_fragmentation(runs)) is not None:
        device = replace(device, efficiency=replace(device.efficiency, allocator_fragmentation=fragmentation))
    return device, _factors(base, device, dtypes)


# the parameters fitted as factors on the device a fit starts from (the others are values)
FACTOR_PARAMS = ("compute", "memory", "intra_node_comm", "comm_latency", "dp_comm", "pp_stage")


def _left_of_bounds(base: DeviceProfile, device: DeviceProfile, dtype: str,
                    bounds: dict[str, tuple[float, float]] | None) -> dict[str, tuple[float, float]]:
    """BOUNDS (with `bounds` over them) for a fit that starts from `device`, a later round's: its
    factors multiply those of the rounds before, and the product against `base` stays in range."""
    limits, so_far = {**BOUNDS, **(bounds or {})}, _factors(base, device, [dtype])
    out = {}
    for name in FACTOR_PARAMS:
        done = so_far.get(f"{name}@{dtype}", so_far.get(name, 1.0))
        out[name] = (limits[name][0] / done, limits[name][1] / done)
    return out


def _comm_fits(multi: list[Run], base: DeviceProfile, fit_pp_stage: bool,
               links_from_tp: bool) -> list[tuple[list[Run], tuple[str, ...]]]:
    """The communication fits of a round, in order, as (runs, factors): every factor on the
    multi-rank runs, or with `links_from_tp` the links' on the TP runs first, then the rest on
    all. The stages' factor only where some runs have a pipeline (the others say nothing of it);
    the links from TP only where two different TP steps ran (two parameters; a short budget may
    run fewer): else jointly."""
    if not multi:
        return []
    staged = fit_pp_stage and any(r.pf.plan.pp > 1 for r in multi)
    names = tuple(n for n in comm_params(base) if staged or n != "pp_stage")
    tp_runs = [r for r in multi if r.pf.plan.tp > 1] if links_from_tp else []
    steps = {(r.pf.model.name, str(r.pf.train.compute_dtype), r.pf.plan.micro_batch_size) for r in tp_runs}
    if len(steps) < len(LINK_PARAMS):
        return [(multi, names)]
    rest = tuple(n for n in names if n not in LINK_PARAMS)
    return [(tp_runs, LINK_PARAMS)] + ([(multi, rest)] if rest else [])


def _factors(base: DeviceProfile, device: DeviceProfile, dtypes: list[str]) -> dict[str, float]:
    out = {}
    for d in dtypes:
        b, e = base.for_dtype(d).efficiency, device.for_dtype(d).efficiency
        out |= {f"compute@{d}": e.gemm / b.gemm, f"memory@{d}": e.memory / b.memory,
                f"kernel_overhead_s@{d}": e.kernel_overhead_s}
        if e.step_overhead_s:
            out[f"step_overhead_s@{d}"] = e.step_overhead_s
    bt, t = base.intra_node, device.intra_node
    if device.efficiency.recompute_cost != base.efficiency.recompute_cost:
        out[RECOMPUTE_PARAM] = device.efficiency.recompute_cost
    dp = {"dp_comm": device.efficiency.dp_comm / base.efficiency.dp_comm} if "dp_comm" in comm_params(device) \
        else {"overlap": device.efficiency.overlap}
    if device.efficiency.pp_stage != base.efficiency.pp_stage:   # fitted (runs with a pipeline)
        dp["pp_stage"] = device.efficiency.pp_stage / base.efficiency.pp_stage
    return out | {"intra_node_comm": t.efficiency / bt.efficiency, "comm_latency": t.latency_s / bt.latency_s, **dp}
