"""What each rank of `planner profile` runs: the microbenchmarks in order under the budget, the
collectives among the ranks, the probe layer's kernels, the probes' training steps, and on a CPU
a second pass that keeps the faster of two measurements."""
from __future__ import annotations

import time
import warnings
from dataclasses import replace

import torch
import torch.distributed as dist

from costmodel.hardware import sdpa_key
from costmodel.specs import LayerProbe
from runtime.layer_ops import layer_op_seconds
from runtime.profiler.attention import CPU_SDPA_SHAPES, attention_efficiency, sdpa_curves, sdpa_gemm_ratio
from runtime.profiler.curves import Curve, gemm_curve, gemm_shapes, memory_curve, op_overhead_s
from runtime.profiler.per_param import dropout_s_per_element, gelu_s_per_element, per_unit_costs
from runtime.profiler.timing import (
    CURVE_PHASES,
    DTYPES,
    PROBE_STEPS,
    PROBE_WARMUP,
    Budget,
    _agree,
    _device,
    _over,
    _sync,
    best_s,
)

COLLECTIVE_BYTES = tuple(4**k for k in range(1, 12))      # 4 B .. 16 MiB


def collective_worker(sizes: tuple[int, ...], device: torch.device, phase_s: float = float("inf"),
                      point_s: float = float("inf")) -> dict[str, list[tuple[float, float]]] | None:
    """Run inside every rank of an initialised group: (bytes, seconds) per collective, rank 0."""
    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in
                                                 ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    sync = _sync(device)
    start = time.perf_counter()
    for size in sizes:
        n = max(world, size // 4 // world * world)
        last = [t for v in out.values() for _, t in v[-1:]]
        # 6 calls per collective kind (best of 5 after one), times the growth of the message
        expected = 6 * sum(last) * 4 if last else 0.0
        if _agree(_over(expected, start, phase_s, point_s)):
            break
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


def measure_rank(dtypes: list[str], device_type: str, threads: int, budget: Budget, report,
                 layer: LayerProbe | None = None) -> dict | None:
    """Every microbenchmark, on every rank of an initialised group at once: each rank is one
    "device" of the node and shares cores, caches and memory bandwidth with the others, as ranks
    of a run do. A barrier before each phase keeps the ranks measuring together; rank 0's figures
    are returned (and its progress reported through `report(phase, fraction, what)`). On a CPU
    they are a first pass: its GEMM points in the shapes' order and `second_pass_limit_s`, for the
    caller to hand to second_pass_rank (or, where nothing is left for one, sorted and no limit).
    `layer`: on a CPU, the layer whose kernels are timed in training (layer_ops)."""
    torch.set_num_threads(threads)
    device = _device(device_type)
    lead = dist.get_rank() == 0
    say = (lambda phase: (lambda frac, what: report(phase, frac, what))) if lead else \
        (lambda phase: (lambda frac, what: None))
    # a GPU's attention ratios are a long sequence's (attention_efficiency)
    out: dict = {"gemm": {}, "attention": {}, "attention_long_sequence": device.type == "cuda"}
    if device.type == "cuda":   # its SDPA backward's rate over the forward's (attention_efficiency)
        out["attention_backward"] = {}
    shapes, fp32, spent_s = gemm_shapes(device.type), (), 0.0
    curves_start = time.perf_counter()
    for i, name in enumerate(dtypes):
        dist.barrier()
        # an even share of what is left of the GEMM phase for each dtype still to measure
        share_s = (budget.phase_s("gemm") - spent_s) / (len(dtypes) - i)
        t0 = time.perf_counter()
        curve = gemm_curve(shapes, DTYPES[name], device, share_s, budget.point_s, fp32, say(f"gemm {name}"))
        spent_s += time.perf_counter() - t0
        out["gemm"][name] = curve
        fp32 = tuple(sorted(curve.points)) if name == "fp32" else fp32   # interpolate's order
    dist.barrier()
    out["memory"] = memory_curve(device, budget.phase_s("memory"), budget.point_s, say("memory"))
    out["sdpa"] = {}
    for name in dtypes:
        dist.barrier()
        share_s, gemm = budget.phase_s("attention") / len(dtypes), tuple(sorted(out["gemm"][name].points))
        if device.type == "cuda":
            out["attention"][name], out["attention_backward"][name] = attention_efficiency(
                DTYPES[name], device, gemm, share_s, budget.point_s)
        else:
            curves = sdpa_curves(name, device, share_s, budget.point_s)
            out["sdpa"].update(curves)
            out["attention"][name] = sdpa_gemm_ratio(curves[sdpa_key(name, False, False)], gemm)
        say("attention")(1.0, f"attention {name}")
    if device.type == "cpu" and layer is not None:
        out["layer_ops"] = layer_ops(layer, out["gemm"], say("attention"))
    first_pass_s = time.perf_counter() - curves_start   # the curves' time: what a second pass may take again
    dist.barrier()
    out.update(per_unit_costs(device, dtypes, budget.phase_s("units")))
    say("units")(1.0, "per-parameter and per-element costs")
    if dist.get_world_size() > 1:
        with warnings.catch_warnings():   # gloo's *_tensor collectives are "deprecated" in 2.13, still the API
            warnings.simplefilter("ignore", FutureWarning)
            out["collectives"] = collective_worker(COLLECTIVE_BYTES, device, budget.phase_s("collectives"),
                                                   budget.point_s)
        say("collectives")(1.0, f"collectives on {dist.get_world_size()} ranks")
    # a CPU's second pass (second_pass_rank, after the probes) draws on what the first left of
    # the curves' shares of the budget; until then the GEMM points stay in the shapes' order, by
    # which best_of pairs the passes' points
    limit_s = min(SECOND_PASS_SLACK * first_pass_s, sum(budget.phase_s(k) for k in CURVE_PHASES) - first_pass_s)
    if device.type == "cpu" and limit_s > 0:
        out["second_pass_limit_s"] = limit_s
    else:
        out["gemm"] = sorted_gemm(out["gemm"])
    return out if lead else None


def layer_ops(layer: LayerProbe, gemm: dict[str, Curve], report) -> dict[str, dict]:
    """The probe layer's kernels timed by kind in each measured dtype, on every rank at once
    (the curves are measured so; a fraction of a second a dtype)."""
    out = {}
    for name, curve in gemm.items():
        dist.barrier()
        model = layer.model if curve.accelerated else layer.small
        seconds = layer_op_seconds(model, DTYPES[name], layer.micro_batch_size, layer.seq_len)
        out[name] = {"model": model.name, "micro_batch_size": layer.micro_batch_size, "seq_len": layer.seq_len,
                     **{f"{k}_s": v for k, v in seconds.items()}}
        report(1.0, f"layer kernels {name}")
    return out


def faster_layer_ops(first: dict[str, dict], second: dict[str, dict]) -> dict[str, dict]:
    """Two passes' layer_ops, each kind at the faster pass (as best_of keeps each curve point)."""
    return {name: {k: min(v, second[name][k]) if k.endswith("_s") else v for k, v in ops.items()}
            for name, ops in first.items()}


def sorted_gemm(gemm: dict[str, Curve]) -> dict[str, Curve]:
    return {k: replace(c, points=tuple(sorted(c.points))) for k, c in gemm.items()}


def second_pass_rank(micro: dict, threads: int, point_s: float, limit_s: float, report,
                     layer: LayerProbe | None = None) -> dict | None:
    """second_pass on every rank of an initialised group at once (as measure_rank measured the
    first), on rank 0's first-pass figures `micro`; rank 0's result is returned, its GEMM points
    sorted."""
    torch.set_num_threads(threads)
    device = _device("cpu")
    out = {**micro, "gemm": dict(micro["gemm"]), "sdpa": dict(micro["sdpa"]),
           "attention": dict(micro["attention"])}
    lead = dist.get_rank() == 0
    say = report if lead else (lambda frac, what: None)
    second_pass(out, list(out["gemm"]), gemm_shapes("cpu"), device, point_s, limit_s, say)
    if layer is not None and "layer_ops" in out:
        out["layer_ops"] = faster_layer_ops(out["layer_ops"], layer_ops(layer, out["gemm"], say))
    out["gemm"] = sorted_gemm(out["gemm"])
    return out if lead else None


# A CPU shared with other tenants slows by tens of percent for one to several seconds at a time,
# each core on its own. A profile whose fp32 GEMMs fell in such a stretch prices every fp32 plan
# slow. So on a CPU each curve and the per-operator, dropout and GeLU costs are measured twice
# where the budget leaves time (planner.commands.profile._second_pass), and each point keeps
# the faster pass: a stretch rarely spans both, and best-of is what each
# point already keeps (a whole profile in a slow stretch is not caught: the runs then beat it).
# The second pass runs after the probes, some 25 s after the first, since passes a few seconds
# apart can fall in the same slow stretch. It may take this much of the first's time (it
# measures the same points, so it needs more only when slowed).
SECOND_PASS_SLACK = 1.25


def best_of(first, second) -> tuple[tuple[float, float], ...]:
    """(size, rate) points of two passes over the same sizes in the same order, each at the
    faster; the first's points beyond the second's end (a budget stopped it) as they were."""
    out = list(first)
    for i, ((x, rate), (x2, rate2)) in enumerate(zip(first, second)):
        if x != x2:
            raise RuntimeError(f"second pass point {i} is at size {x2}, the first's at {x}")
        out[i] = (x, max(rate, rate2))
    return tuple(out)


def best_pass(first: tuple[list, list], second: tuple[list, list]) -> tuple[list, list]:
    """A forward SDPA curve and its backward (a difference of two timings, backward_s) from two
    passes: per point, both from the pass whose forward and backward together were faster. The
    faster of each alone could pair a pass whose forward alone fell in a slow stretch, its
    backward too cheap, with the other pass's forward."""
    fwd, bwd = list(first[0]), list(first[1])
    for i, ((s, d, f2), (_, _, b2)) in enumerate(zip(*second)):
        (s1, d1, f1), (_, _, b1) = fwd[i], bwd[i]
        if (s, d) != (s1, d1):
            raise RuntimeError(f"second pass point {i} is at sequence {s}, head dim {d}; the first's at {s1}, {d1}")
        if f2 + b2 < f1 + b1:
            fwd[i], bwd[i] = (s, d, f2), (s, d, b2)
    return fwd, bwd


def second_pass(out: dict, dtypes: list[str], shapes, device: torch.device, point_s: float, limit_s: float,
                report) -> None:
    """Measure measure_rank's curves again, the points the first pass measured and no more, and
    keep each point's faster pass in `out` (SECOND_PASS_SLACK): within limit_s, except that the
    SDPA shapes of the two shortest sequences are always measured, and the per-operator, dropout
    and GeLU costs after them (a fraction of a second). The optimizer's and the gradient
    accumulation's costs are means over page placements by design (optimizer_s_per_param): the
    faster of two would pick placements, so they are not measured again; nor FSDP's one-rank costs,
    medians of their own (fsdp_sync_s_per_param), a second of the profile's budget each time."""
    start = time.perf_counter()

    def left_s() -> float:
        return max(limit_s - (time.perf_counter() - start), 0.0)

    for i, name in enumerate(dtypes):
        dist.barrier()
        first = out["gemm"][name]
        again = gemm_curve(shapes[:len(first.points)], DTYPES[name], device, left_s(),
                           point_s if first.accelerated else point_s / 4)
        out["gemm"][name] = replace(first, points=best_of(first.points, again.points))
        report(0.5 * (i + 1) / len(dtypes), f"GEMM {name} again")
    dist.barrier()
    first = out["memory"]
    again = memory_curve(device, left_s(), point_s, lambda frac, what: None, count=len(first.points))
    out["memory"] = replace(first, points=best_of(first.points, again.points))
    for i, name in enumerate(dtypes):
        dist.barrier()
        key = sdpa_key(name, False, False)
        again = sdpa_curves(name, device, left_s(), point_s, CPU_SDPA_SHAPES[:len(out["sdpa"][key])])
        for drop in (False, True):
            f, b = sdpa_key(name, drop, False), sdpa_key(name, drop, True)
            out["sdpa"][f], out["sdpa"][b] = best_pass((out["sdpa"][f], out["sdpa"][b]), (again[f], again[b]))
        out["attention"][name] = sdpa_gemm_ratio(out["sdpa"][key], tuple(sorted(out["gemm"][name].points)))
        report(0.5 + 0.45 * (i + 1) / len(dtypes), f"attention {name} again")
    dist.barrier()
    out["overhead_s"] = min(out["overhead_s"], op_overhead_s(device))
    out["dropout_s_per_element"] = min(out["dropout_s_per_element"], dropout_s_per_element(device))
    gelu = gelu_s_per_element(device)
    out["gelu_s_per_element"] = {k: min(v, gelu[k], key=sum) for k, v in out["gelu_s_per_element"].items()}
    report(1.0, "per-unit costs again")


def probe_rank(plans: list, threads: int, phase_s: float, report) -> list[dict | None]:
    """Training steps of small plans on this group (the plans of its world size), so the profile
    holds what a step adds to its kernels: autograd and module overhead per kernel, collectives
    inside FSDP / DTensor / pipelining, how much communication hides. PROBE_WARMUP warm-up and
    PROBE_STEPS timed steps each, the median kept; plans the phase budget leaves no time for are skipped
    (None) on every rank, all but the first (the fit needs a probe of each world size)."""
    from runtime.train import RunConfig, run_rank  # the runtime's own step, as `planner run` runs it
    torch.set_num_threads(threads)
    start, results = time.perf_counter(), []
    for i, pf in enumerate(plans):
        spent = time.perf_counter() - start
        expected = spent / i if i else 0.0
        if i and _agree(spent + expected > phase_s):   # the first is measured whatever the time
            results.append(None)
            continue
        with warnings.catch_warnings():   # FSDP's and pipelining's notices are the user's business in a run
            warnings.simplefilter("ignore")
            raw = run_rank(pf, RunConfig(steps=PROBE_STEPS, warmup=PROBE_WARMUP, quiet=True))
        results.append(raw)
        if dist.get_rank() == 0:
            report((i + 1) / len(plans), f"probe step: {pf.plan.short()} {pf.train.compute_dtype}")
    return results
