"""CP-SAT: split layers over pipeline ranks and choose per-rank recomputation under the memory cap
so that the predicted step time is minimal (the AdaPipe idea, Sun et al. 2024).

For one outer choice (degrees, micro-batch, schedule, ZeRO, recompute mode, placement) the cost
model is, per pipeline rank r, affine in its layer count L_r and recomputed-layer count n_r:
micro-batch time t_r, the zero-bubble fill f_r, optimizer time, memory (plus one step when n_r > 0);
the exposed data-parallel time is a max of affine pieces and a constant. The model here reads those
coefficients by evaluating costmodel's own functions (and checks they are affine), then minimises
exactly what `estimate` computes:

    m·max(t) + (sum(f) - max(f)) / v + max_r(sum_k mult_k·max(comm_kr - window_kr, one layer's bucket))
    + max_r(optimizer_r)       (+ a constant: tied-embedding sync)

in integer nanoseconds. Within a rank, interleaved virtual stages get an even split (the model
prices a rank by its totals only).
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, replace

import numpy as np
from ortools.sat.python import cp_model

from costmodel.cluster import ClusterSpec
from costmodel.compute import optimizer_step_s
from costmodel.memory import AffineBytes, stage_memory_shapes
from costmodel.params import layer_params, rank_params_at
from costmodel.pipeline import closed_form_s, fill_s, scaled_closed_form
from costmodel.plan import Plan, Recompute, even_layers
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.timing import (RankTimeModel, RankTimes, dp_bucket_s, dp_term_comm_s, dp_terms,
                              dp_window_s, rank_time_model, spans)

NS = 1e9
# CP-SAT attempts on a split model, each stopped at a deterministic-time budget (the same on
# every machine, so the answer is too) and the last at the deadline. Figures from
# `python benchmarks/search_profile.py --row ID --top 10 [--only-attempt N]` (2026-11-22):
# - without presolve almost every model settles in milliseconds; with CP-SAT's defaults alone
#   megatron_h100_70B's search takes 36.8 s instead of 2.7 s;
# - a few models with deep pipelines and full recomputation need more: symmetry breaking without
#   probing alone settles sc21_t1_530 in 6.5 s where the defaults alone do not in 120 s, but
#   leaves sc21_t1_1T unproven at 60 s where the defaults alone take 19.0 s. Chained as below:
#   21.3 s and 15.2 s, both proven.
ATTEMPTS: list[tuple[dict, float | None]] = [
    ({"cp_model_presolve": False}, 0.05),
    ({"symmetry_level": 4, "cp_model_probing_level": 0}, 0.3),
    ({}, None),
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Split:
    layers: tuple[int, ...]      # per pipeline rank
    recomputed: tuple[int, ...]  # per pipeline rank
    optimal: bool


class SolverTimeout(Exception):
    """CP-SAT ran out of time before finding any split (not a proof that none fits)."""


def _affine(f, x0: int, x1: int) -> tuple[float, float]:
    """(intercept, slope) of f from two points (the affinity itself is checked in the tests)."""
    y0, y1 = f(x0), f(x1)
    slope = (y1 - y0) / (x1 - x0)
    return y0 - slope * x0, slope


@dataclass(frozen=True, slots=True)
class _RankShape:
    """Everything the solver needs about one pipeline rank, read from costmodel. Each quantity
    is affine in (L, n) for a fixed outer choice (tests/planner/test_partition.py checks it
    against the cost model at many points): coefficients (per rank, per layer, per recomputed
    layer) of the micro-batch time t and zero-bubble fill f, (intercept, slope in L) of the
    optimizer step, memory as (base, per layer, per recomputed layer, jump once n > 0), and per
    DP term (multiplier, comm, window, bucket)."""

    t: tuple[float, float, float]
    f: tuple[float, float, float]
    opt: tuple[float, float]
    mem: tuple[float, float, float, float]
    dp: list
    memory: AffineBytes  # mem as costmodel states it


def _pipeline_rows(rtm: RankTimeModel, plan: Plan, edge: RankTimes) -> tuple[tuple, tuple]:
    """(t, f) coefficients of a rank whose fixed part (edges, sends) is `edge`."""
    parts = (edge, rtm.per_layer, rtm.per_recomputed_layer)
    t = tuple(p.total_s for p in parts)
    return t, tuple(fill_s(plan.schedule.traits, p) for p in parts)


def pipeline_rows(rtm: RankTimeModel, plan: Plan) -> tuple[list[tuple], list[tuple]]:
    """Per pipeline rank, the t and f coefficients of _RankShape (what the pipeline bound needs),
    without the optimizer and DP parts."""
    first, last = plan.stage_rank(0), plan.stage_rank(plan.num_virtual_stages - 1)
    kinds = {(r == first, r == last) for r in range(plan.pp)}
    rows = {kind: _pipeline_rows(rtm, plan, rtm.at(0, 0, *kind)) for kind in kinds}
    per_rank = [rows[r == first, r == last] for r in range(plan.pp)]
    return [t for t, _ in per_rank], [f for _, f in per_rank]


def _time_shape(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan, rtm: RankTimeModel,
                first: bool, last: bool, dp_shape: list) -> tuple:
    """(t, f, opt, dp) of a rank: the same on every rank in the middle of the pipeline."""
    edge = rtm.at(0, 0, first, last)
    t, f = _pipeline_rows(rtm, plan, edge)
    edge_params = rank_params_at(model, plan, 0, first, last).total
    per_layer_params = rank_params_at(model, plan, 1, first, last).total - edge_params
    shards = plan.dp * plan.cp if plan.zero_stage >= 1 else 1
    opt = _affine(lambda L: optimizer_step_s((edge_params + L * per_layer_params) / shards, train, cluster.device),
                  1, 2)
    # DP collectives: comm(P) = alpha + beta·P in the rank's parameters P = edge + L·per_layer
    overlap = cluster.device.efficiency.overlap
    dp = [(mult, (alpha + beta * edge_params, beta * per_layer_params),
           (dp_window_s(term, edge, overlap), dp_window_s(term, rtm.per_layer, overlap),
            dp_window_s(term, rtm.per_recomputed_layer, overlap)), bucket)
          for mult, term, alpha, beta, bucket in dp_shape]
    return t, f, opt, dp


def _dp_shape(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> list:
    """Per DP term: (multiplier, term, alpha, beta, bucket) with comm(P params) = alpha + beta·P."""
    sp = spans(plan, cluster)
    if sp.dp.size == 1:
        return []
    unit = layer_params(model, plan.tp)
    out = []
    for term in dp_terms(model, train, plan, cluster):
        alpha, beta = _affine(lambda k: dp_term_comm_s(term, k * unit, cluster, sp.dp, unit), 1, 2)
        out.append((term.multiplier, term, alpha, beta / unit, dp_bucket_s(model, plan, term, cluster, sp.dp)))
    return out


def rank_shapes(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan,
                memory: list[AffineBytes] | None = None, rtm: RankTimeModel | None = None) -> list[_RankShape]:
    """`memory` (the plan's `stage_memory_shapes`) and `rtm` (its rank time model): when the
    caller already has them."""
    rtm = rtm or rank_time_model(model, train, plan, cluster, spans(plan, cluster))
    dp_shape = _dp_shape(model, train, cluster, plan)
    memory = memory or stage_memory_shapes(model, train, plan, cluster.device.efficiency.reserved_memory_bytes,
                                          cluster.framework)
    first, last = plan.stage_rank(0), plan.stage_rank(plan.num_virtual_stages - 1)
    times: dict[tuple[bool, bool], tuple] = {}
    out = []
    for r, mem in enumerate(memory):
        key = (r == first, r == last)
        if key not in times:
            times[key] = _time_shape(model, train, cluster, plan, rtm, *key, dp_shape)
        t, f, opt, dp = times[key]
        out.append(_RankShape(t, f, opt, (mem.base, mem.per_layer, mem.per_recomputed, mem.jump), dp, mem))
    return out


def max_layers_that_fit(mem: AffineBytes, cap: float, can_recompute: bool, total: int) -> int:
    """Most layers a rank can hold within `cap`: memory is affine in layers at n = 0 and at n = L
    (every layer recomputed), and recomputing more never needs more memory."""
    base, per_layer, per_rc, jump = mem.base, mem.per_layer, mem.per_recomputed, mem.jump
    options = [(base, per_layer)] + ([(base + jump, per_layer + per_rc)] if can_recompute else [])
    best = -1
    for intercept, slope in options:
        if slope <= 0:
            best = max(best, total if intercept <= cap else -1)
        elif intercept <= cap:
            best = max(best, min(total, int((cap - intercept) // slope)))
    return best


def split_exists(memory: list[AffineBytes], plan: Plan, cap: float, total: int) -> bool:
    """Exact: some split of `total` layers (at least vpp per rank) fits every rank (`memory`:
    costmodel.memory.stage_memory_shapes)."""
    most = [max_layers_that_fit(m, cap, plan.recompute is not Recompute.NONE, total) for m in memory]
    return min(most) >= plan.vpp and sum(most) >= total


def min_total_recompute(memory: list[AffineBytes], plan: Plan, cap: float, total: int) -> float:
    """Lower bound on sum(n_r) over all splits (continuous relaxation). A rank's need for
    recomputed layers is convex in its layer count (zero until memory binds, then linear), so the
    cheapest way to place the layers beyond vpp per rank takes the smallest per-layer increments
    over all ranks: sum of needs at vpp layers + the (total - vpp·pp) smallest increments."""
    col = lambda name: np.array([getattr(mem, name) for mem in memory])[:, None]  # noqa: E731
    per_rc = col("per_recomputed")
    over = col("base") + col("per_layer") * np.arange(plan.vpp, total + 1)[None, :] - cap
    with np.errstate(divide="ignore", invalid="ignore"):
        need = np.where(over <= 0, 0.0, np.where(per_rc < 0, (over + col("jump")) / -per_rc, np.inf))
    extra = total - plan.vpp * plan.pp
    if extra < 0:
        return math.inf
    start = float(need[:, 0].sum())
    if extra == 0 or math.isinf(start):
        return start
    with np.errstate(invalid="ignore"):  # inf - inf where a rank can never hold that many
        steps = np.where(np.isfinite(need[:, 1:]), np.diff(need, axis=1), np.inf).ravel()
    return start + float(np.partition(steps, extra - 1)[:extra].sum())


def least_recomputed(memory: list[AffineBytes], cap: float, recompute: bool, total: int) -> np.ndarray:
    """[rank, L] for L = 0..total layers on the rank: the fewest recomputed layers that make them
    fit (-1 where none does). Memory falls by per_rc per recomputed layer after a one-off jump."""
    col = lambda name: np.array([getattr(mem, name) for mem in memory])[:, None]  # noqa: E731
    per_rc, jump = col("per_recomputed"), col("jump")
    layers = np.arange(total + 1)[None, :]
    over = col("base") + col("per_layer") * layers - cap
    need = np.where(over <= 0, 0, -1)
    if recompute:
        with np.errstate(divide="ignore", invalid="ignore"):
            # 1e-9: the CP-SAT model and estimate() round differently at the very edge
            n = np.maximum(1, np.ceil((over + jump) / -per_rc - 1e-9))
        need = np.where((over > 0) & (per_rc < 0) & (n <= layers), n, need)
    return need


class MemoryFit:
    """What memory alone says about an outer choice; rank placement does not change it, so the
    search computes it once for all placements. The recompute figures are worked out when first
    asked for (many choices that fit are never examined further)."""

    def __init__(self, memory: list[AffineBytes], plan: Plan, cap: float, total: int) -> None:
        self.memory = memory  # costmodel.memory.stage_memory_shapes
        self.fits = split_exists(memory, plan, cap, total)  # some split fits (exact)
        self._plan, self._cap, self._total = plan, cap, total

    @functools.cached_property
    def least_recomputed(self) -> np.ndarray:
        """[rank, L]: see `least_recomputed` (meaningful when it fits)."""
        return least_recomputed(self.memory, self._cap, self._plan.recompute is not Recompute.NONE, self._total)

    @functools.cached_property
    def min_recomputed(self) -> float:
        """No split that fits recomputes fewer layers in all."""
        if not self.fits:
            return math.inf
        floor = 0.0 if self._plan.recompute is Recompute.NONE else 1.0
        return max(min_total_recompute(self.memory, self._plan, self._cap, self._total), floor)


def min_max_time_s(ts: list[tuple], plan: Plan, fit: MemoryFit, total: int) -> float:
    """The least possible max_r t_r over every split that fits (exact over integer layer and
    recompute counts, up to the relaxation that a rank may take any layer count whose time fits):
    a rank's fastest way to hold L layers recomputes as few as fit, so for a candidate T each rank
    holds at most max{L : t_min(L) <= T} layers, and T is feasible when those sum to `total`.
    `ts`: per rank, (t0, t1, t2) of _RankShape.t."""
    need = fit.least_recomputed
    t0 = np.array([t[0] for t in ts])[:, None]
    t = t0 + ts[0][1] * np.arange(total + 1)[None, :] + ts[0][2] * need
    t = np.where(need >= 0, t, np.inf)
    t[:, :plan.vpp] = np.inf  # every virtual stage holds a layer
    # t[r, L]: fastest way for rank r to hold at least L layers, nondecreasing in L. Within T,
    # rank r holds #{L >= 1 : t[r, L] <= T} layers; those sum to `total` from the total-th
    # smallest t[r, L >= 1] on, and every rank holds its vpp layers from max_r t[r, vpp] on.
    t = np.minimum.accumulate(t[:, ::-1], axis=1)[:, ::-1]
    slots = t[:, 1:].ravel()
    enough = np.partition(slots, total - 1)[total - 1]
    return float(max(enough, t[:, plan.vpp].max()))


def pipeline_floor_s(ts: list[tuple], fs: list[tuple], plan: Plan, fit: MemoryFit, total: int) -> float:
    """Lower bound on the pipeline part of the step time (see planner.bounds.time_floor_s) with
    the recomputation needed to fit, and the slowest rank at least as slow as the best
    memory-feasible min-max split allows. `ts`, `fs`: `pipeline_rows`. Placement-aware but
    cheaper than the rank shapes: the search tries it first."""
    rc = fit.min_recomputed
    if not fit.fits or math.isinf(rc) or (rc > 0 and plan.recompute is Recompute.NONE):
        return math.inf
    slowest = min_max_time_s(ts, plan, fit, total)
    sum_t = sum(t[0] for t in ts) + ts[0][1] * total + ts[0][2] * rc
    slowest = max(slowest, sum_t / plan.pp)
    # the closed form with max(f) <= T (f = t for 1F1B, t - 2W for ZB-H1)
    sum_f = sum(f[0] for f in fs) + fs[0][1] * total + fs[0][2] * rc
    return closed_form_s(plan.schedule.traits, plan.num_micro_batches, slowest, sum_f, slowest, plan.vpp)


def lower_bound_with_memory_s(shapes: list[_RankShape], plan: Plan, fit: MemoryFit, total: int) -> float:
    """Step-time lower bound for this outer choice: `pipeline_floor_s`, the DP buckets that can
    never hide, and the optimizer on the average rank."""
    pipe = pipeline_floor_s([sh.t for sh in shapes], [sh.f for sh in shapes], plan, fit, total)
    if math.isinf(pipe):
        return pipe
    opt = (sum(sh.opt[0] for sh in shapes) + shapes[0].opt[1] * total) / plan.pp
    return pipe + _dp_floor_s(shapes, plan, total) + opt


def _dp_floor_s(shapes: list[_RankShape], plan: Plan, total: int) -> float:
    """Exposed DP time of the slowest rank >= the rank average >= (by convexity of max) the same
    max at the average layer count; the window is taken with every layer recomputed (its widest),
    so this never exceeds the true value."""
    pp = len(shapes)
    layers = total / pp
    recomputed = layers if plan.recompute is not Recompute.NONE else 0.0
    out = 0.0
    for k, (mult, (_, c1), (_, w1, w2), bucket) in enumerate(shapes[0].dp):
        intercept = sum(sh.dp[k][1][0] - sh.dp[k][2][0] for sh in shapes) / pp
        out += mult * max(intercept + (c1 - w1) * layers - w2 * recomputed, bucket)
    return out


def _scan_single_rank(shape: _RankShape, plan: Plan, total: int, cap: float, cutoff_s: float) -> Split | None:
    """pp = 1: the whole objective is a function of n alone; try every n (exact, no solver)."""
    base, per_layer, per_rc, jump = shape.mem
    choices = [0] if plan.recompute is Recompute.NONE else range(1, total + 1)
    best = None
    for n in choices:
        if base + per_layer * total + per_rc * n + jump * (n > 0) > cap:
            continue
        t = shape.t[0] + shape.t[1] * total + shape.t[2] * n
        dp = sum(mult * max(c0 + c1 * total - (w0 + w1 * total + w2 * n), bucket)
                 for mult, (c0, c1), (w0, w1, w2), bucket in shape.dp)
        value = plan.num_micro_batches * t + dp + shape.opt[0] + shape.opt[1] * total
        if value <= cutoff_s and (best is None or value < best[0]):
            best = (value, n)
    return None if best is None else Split(layers=(total,), recomputed=(best[1],), optimal=True)


def _ns(x: float) -> int:
    return round(x * NS)


def solve_split(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan,
                time_limit_s: float = 10.0, ranks: list[_RankShape] | None = None,
                cutoff_s: float = math.inf, fit: MemoryFit | None = None) -> Split | None:
    """The best (layers, recomputed) per rank for `plan`'s outer choices, or None if no split
    fits with a step time of at most `cutoff_s` (the branch and bound's K-th best so far: the
    solver then only has to show nothing beats it). The objective leaves out the plan's
    constant terms (>= 0), so None never hides a plan that would beat the cutoff."""
    ranks = ranks or rank_shapes(model, train, cluster, plan)
    total, v, m = model.num_layers, plan.vpp, plan.num_micro_batches
    fit = fit or MemoryFit([r.memory for r in ranks], plan, cluster.memory_budget_bytes, total)
    if not fit.fits:
        return None
    if plan.pp == 1:
        return _scan_single_rank(ranks[0], plan, total, cluster.memory_budget_bytes, cutoff_s)
    cm = cp_model.CpModel()
    L = [cm.NewIntVar(v, total, f"L{r}") for r in range(plan.pp)]
    n = [cm.NewIntVar(0, total, f"n{r}") for r in range(plan.pp)]
    z = [cm.NewBoolVar(f"z{r}") for r in range(plan.pp)]
    cm.Add(sum(L) == total)
    for r in range(plan.pp):
        cm.Add(n[r] <= L[r])
        cm.Add(n[r] <= total * z[r])
        cm.Add(n[r] >= z[r])
    if plan.recompute is Recompute.NONE:
        cm.Add(sum(n) == 0)
    else:
        cm.Add(sum(n) >= 1)
    cap = cluster.memory_budget_bytes
    t_vars, f_vars, dp_vars, opt_vars = [], [], [], []
    for r, rs in enumerate(ranks):
        base, per_layer, per_rc, jump = rs.mem
        cm.Add(round(base) + round(per_layer) * L[r] + round(per_rc) * n[r] + round(jump) * z[r] <= int(cap))
        t_vars.append(_affine_var(cm, rs.t, L[r], n[r], v, total, f"t{r}"))
        f_vars.append(_affine_var(cm, rs.f, L[r], n[r], v, total, f"f{r}"))
        opt_vars.append(_affine_var(cm, (*rs.opt, 0.0), L[r], n[r], v, total, f"o{r}"))
        dp_vars.append(_dp_rank(cm, rs, L[r], n[r], total, v, r))
    T = _max_var(cm, t_vars, "T")
    F = _max_var(cm, f_vars, "F")
    DP = _max_var(cm, dp_vars, "DP")
    OPT = _max_var(cm, opt_vars, "OPT")
    even = even_layers(total, plan.pp)
    for r in range(plan.pp):
        cm.AddHint(L[r], max(v, even[r]))
    traits = plan.schedule.traits
    scale = v if traits.fill_divided_by_vpp else 1
    step = scaled_closed_form(traits, m, T.var, sum(f.var for f in f_vars), F.var, v) + scale * (DP.var + OPT.var)
    # integer nanoseconds round each coefficient: allow that much slack in both bounds below
    slack = (scale * m + 3 * plan.pp + 3) * (2 * total + 2)
    slowest = min_max_time_s([r.t for r in ranks], plan, fit, total)
    cm.Add(T.var >= math.floor(slowest * NS) - slack)  # the exact min-max of the slowest rank
    if math.isfinite(cutoff_s):
        cm.Add(step <= math.floor(scale * cutoff_s * NS) + slack)
    # ties (equal predicted time) go to the split that recomputes fewer layers
    cm.Minimize((total + 1) * step + sum(n))
    # With the bounds above the model is small and tight, and presolve usually costs more than it
    # saves; see ATTEMPTS.
    deadline = time.perf_counter() + time_limit_s
    for attempt, budget in ATTEMPTS:
        solver, status = _solve(cm, time_limit_s=max(0.1, deadline - time.perf_counter()), deterministic_limit=budget,
                                **attempt)
        if status in (cp_model.OPTIMAL, cp_model.INFEASIBLE):
            break
    if status == cp_model.UNKNOWN:
        raise SolverTimeout(plan.short())
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return Split(layers=tuple(solver.Value(x) for x in L), recomputed=tuple(solver.Value(x) for x in n),
                 optimal=status == cp_model.OPTIMAL)


def _solve(cm: cp_model.CpModel, *, time_limit_s: float, deterministic_limit: float | None = None,
           **parameters) -> tuple[cp_model.CpSolver, int]:
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1  # deterministic
    for name, value in parameters.items():
        setattr(solver.parameters, name, value)
    solver.parameters.max_time_in_seconds = time_limit_s
    if deterministic_limit is not None:
        solver.parameters.max_deterministic_time = deterministic_limit
    return solver, solver.Solve(cm)


def _affine_var(cm: cp_model.CpModel, coef: tuple[float, float, float], L, n, lo_layers: int,
                total: int, name: str):
    """An IntVar equal to a + b·L + c·n (ns), with its exact range as domain (tight domains make
    CP-SAT's propagation and optimality proof fast)."""
    a, b, c = (_ns(x) for x in coef)
    corners = [a + b * x + c * y for x in (lo_layers, total) for y in (0, total)]
    var = _Bounded(cm.NewIntVar(min(corners), max(corners), name), min(corners), max(corners))
    cm.Add(var.var == a + b * L + c * n)
    return var


@dataclass(frozen=True, slots=True)
class _Bounded:
    var: cp_model.IntVar
    lo: int
    hi: int


def _max_var(cm: cp_model.CpModel, xs: list[_Bounded], name: str) -> _Bounded:
    lo, hi = max(x.lo for x in xs), max(x.hi for x in xs)
    var = cm.NewIntVar(lo, hi, name)
    cm.AddMaxEquality(var, [x.var for x in xs])
    return _Bounded(var, lo, hi)


def _dp_rank(cm: cp_model.CpModel, rs: _RankShape, L, n, total: int, v: int, r: int):
    """sum_k mult_k · max(comm_k - window_k, bucket_k) for one rank."""
    if not rs.dp:
        return _Bounded(cm.NewConstant(0), 0, 0)
    parts, lo, hi = [], 0, 0
    # terms that hide behind nothing (window "none": exposed syncs, the contention terms) are
    # affine in L once one layer's worth already exceeds the bucket: one variable for all of them
    exposed = [(mult, c0, c1) for mult, (c0, c1), w, bucket in rs.dp if w == (0.0, 0.0, 0.0)
               and c1 >= 0 and c0 + c1 * max(v, 1) >= bucket]
    if exposed:
        var = _affine_var(cm, (sum(m * c0 for m, c0, _ in exposed), sum(m * c1 for m, _, c1 in exposed), 0.0),
                          L, n, v, total, f"e{r}")
        parts.append(var.var)
        lo, hi = lo + var.lo, hi + var.hi
    for k, (mult, (c0, c1), (w0, w1, w2), bucket) in enumerate(rs.dp):
        if (mult, c0, c1) in exposed and (w0, w1, w2) == (0.0, 0.0, 0.0):
            continue
        diff = _affine_var(cm, (c0 - w0, c1 - w1, -w2), L, n, v, total, f"d{r}_{k}")
        b = _ns(bucket)
        hidden = _max_var(cm, [diff, _Bounded(cm.NewConstant(b), b, b)], f"h{r}_{k}")
        parts.append(mult * hidden.var)
        lo, hi = lo + mult * hidden.lo, hi + mult * hidden.hi
    out = cm.NewIntVar(lo, hi, f"dp{r}")
    cm.Add(out == sum(parts))
    return _Bounded(out, lo, hi)


def apply_split(plan: Plan, split: Split) -> Plan:
    """The concrete plan: rank r's layers spread evenly over its virtual stages (loop placement)."""
    per_stage = [0] * plan.num_virtual_stages
    for r, layers in enumerate(split.layers):
        for chunk, count in enumerate(even_layers(layers, plan.vpp)):
            per_stage[chunk * plan.pp + r] = count
    return replace(plan, layers_per_stage=tuple(per_stage), recompute_num_layers=split.recomputed)
