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

import heapq
import math
from dataclasses import dataclass, replace

import numpy as np
from ortools.sat.python import cp_model

from costmodel.cluster import ClusterSpec
from costmodel.compute import optimizer_step_s
from costmodel.memory import stage_memory_at
from costmodel.params import layer_params, rank_params_at
from costmodel.plan import Plan, Recompute, Schedule, even_layers
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.timing import (RankTimeModel, dp_bucket_s, dp_term_comm_s, dp_terms,
                              dp_window_s, rank_time_model, spans)

NS = 1e9


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


class _RankShape:
    """Everything the solver needs about one pipeline rank, read from costmodel. Each quantity
    is affine in (L, n) for a fixed outer choice (tests/planner/test_partition.py checks it
    against the cost model at many points), so a few evaluations give its coefficients."""

    def __init__(self, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan,
                 rtm: RankTimeModel, rank: int, dp_shape: list) -> None:
        first, last = rank == 0, rank == plan.pp - 1
        edge = rtm.at(0, 0, first, last)
        zb = plan.schedule is Schedule.ZB_H1
        self.t = (edge.total_s, rtm.per_layer.total_s, rtm.per_recomputed_layer.total_s)
        w0, w1 = edge.backward_weight_s, rtm.per_layer.backward_weight_s
        self.f = (self.t[0] - 2 * w0 * zb, self.t[1] - 2 * w1 * zb, self.t[2])
        edge_params = rank_params_at(model, plan, 0, first, last).total
        per_layer_params = rank_params_at(model, plan, 1, first, last).total - edge_params
        shards = plan.dp * plan.cp if plan.zero_stage >= 1 else 1
        opt = lambda L: optimizer_step_s((edge_params + L * per_layer_params) / shards, train, cluster.device)  # noqa: E731
        self.opt = _affine(opt, 1, 2)
        reserved = cluster.device.efficiency.reserved_memory_bytes
        mem = lambda L, n: stage_memory_at(model, train, plan, rank, L, n, reserved).total_bytes  # noqa: E731
        base, per_layer = _affine(lambda L: mem(L, 0), 1, 2)
        m21 = mem(2, 1)
        per_rc = mem(2, 2) - m21
        self.mem = (base, per_layer, per_rc, m21 - (base + 2 * per_layer) - per_rc)
        # DP collectives: comm(P) = alpha + beta·P in the rank's parameters P = edge + L·per_layer
        overlap = cluster.device.efficiency.overlap
        self.dp = [(mult, (alpha + beta * edge_params, beta * per_layer_params),
                    (dp_window_s(term, edge, overlap), dp_window_s(term, rtm.per_layer, overlap),
                     dp_window_s(term, rtm.per_recomputed_layer, overlap)), bucket)
                   for mult, term, alpha, beta, bucket in dp_shape]


def _dp_shape(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> list:
    """Per DP term: (multiplier, term, alpha, beta, bucket) with comm(P params) = alpha + beta·P."""
    sp = spans(plan, cluster)
    if sp.dp.size == 1:
        return []
    unit = layer_params(model, plan.tp)
    out = []
    for term in dp_terms(train, plan):
        alpha, beta = _affine(lambda k: dp_term_comm_s(term, k * unit, cluster, sp.dp), 1, 2)
        out.append((term.multiplier, term, alpha, beta / unit, dp_bucket_s(model, plan, term, cluster, sp.dp)))
    return out


def rank_shapes(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> list[_RankShape]:
    rtm = rank_time_model(model, train, plan, cluster, spans(plan, cluster))
    dp_shape = _dp_shape(model, train, cluster, plan)
    return [_RankShape(model, train, cluster, plan, rtm, r, dp_shape) for r in range(plan.pp)]


def max_layers_that_fit(shape: _RankShape, cap: float, can_recompute: bool, total: int) -> int:
    """Most layers a rank can hold within `cap`: memory is affine in layers at n = 0 and at n = L
    (every layer recomputed), and recomputing more never needs more memory."""
    base, per_layer, per_rc, jump = shape.mem
    options = [(base, per_layer)] + ([(base + jump, per_layer + per_rc)] if can_recompute else [])
    best = -1
    for intercept, slope in options:
        if slope <= 0:
            best = max(best, total if intercept <= cap else -1)
        elif intercept <= cap:
            best = max(best, min(total, int((cap - intercept) // slope)))
    return best


def split_exists(shapes: list[_RankShape], plan: Plan, cap: float, total: int) -> bool:
    """Exact: some split of `total` layers (at least vpp per rank) fits every rank."""
    most = [max_layers_that_fit(s, cap, plan.recompute is not Recompute.NONE, total) for s in shapes]
    return min(most) >= plan.vpp and sum(most) >= total


def _recompute_needed(shape: _RankShape, layers: int, cap: float) -> float:
    """Least (fractional) number of recomputed layers that makes `layers` fit on this rank."""
    base, per_layer, per_rc, jump = shape.mem
    over = base + per_layer * layers - cap
    if over <= 0:
        return 0.0
    return (over + jump) / -per_rc if per_rc < 0 else math.inf


def min_total_recompute(shapes: list[_RankShape], plan: Plan, cap: float, total: int) -> float:
    """Lower bound on sum(n_r) over all splits: each rank's need is convex in its layer count
    (zero, then linear), so adding layers greedily where the need grows least is optimal for the
    continuous relaxation."""
    layers = [plan.vpp] * plan.pp
    need = [_recompute_needed(sh, plan.vpp, cap) for sh in shapes]
    heap = [(_recompute_needed(sh, plan.vpp + 1, cap) - need[r], r) for r, sh in enumerate(shapes)]
    heapq.heapify(heap)
    for _ in range(total - plan.vpp * plan.pp):
        delta, r = heapq.heappop(heap)
        layers[r] += 1
        need[r] += delta
        heapq.heappush(heap, (_recompute_needed(shapes[r], layers[r] + 1, cap) - need[r], r))
    return sum(need)


def lower_bound_with_memory_s(shapes: list[_RankShape], plan: Plan, cap: float, total: int) -> float:
    """Step-time lower bound for this outer choice including the recomputation needed to fit,
    the DP buckets that can never hide, and the optimizer on the average rank (see
    planner.bounds.lower_bound_s for the pipeline part)."""
    rc = max(min_total_recompute(shapes, plan, cap, total),
             0.0 if plan.recompute is Recompute.NONE else 1.0)
    if math.isinf(rc) or (rc > 0 and plan.recompute is Recompute.NONE):
        return math.inf
    sum_t = sum(sh.t[0] for sh in shapes) + shapes[0].t[1] * total + shapes[0].t[2] * rc
    m, pp = plan.num_micro_batches, plan.pp
    if plan.schedule is Schedule.ZB_H1:
        sum_f = sum(sh.f[0] for sh in shapes) + shapes[0].f[1] * total + shapes[0].f[2] * rc
        pipe = (m - 1) * sum_t / pp + sum_f
    else:
        v = plan.vpp if plan.schedule is Schedule.INTERLEAVED else 1
        pipe = (m - 1 / v) * sum_t / pp + sum_t / v
    opt = (sum(sh.opt[0] for sh in shapes) + shapes[0].opt[1] * total) / pp
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


def _scan_single_rank(shape: _RankShape, plan: Plan, total: int, cap: float) -> Split | None:
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
        if best is None or value < best[0]:
            best = (value, n)
    return None if best is None else Split(layers=(total,), recomputed=(best[1],), optimal=True)


def _enumerate_two_ranks(ranks: list[_RankShape], plan: Plan, total: int, cap: float) -> Split | None:
    """pp = 2: every (L0, n0, n1) at once with numpy, the same objective as the CP-SAT model, in
    floating point; ties go to fewer recomputed layers, then fewer layers on rank 0."""
    v, m = plan.vpp, plan.num_micro_batches
    l0 = np.arange(total + 1)[:, None, None]
    n0 = np.arange(total + 1)[None, :, None]
    n1 = np.arange(total + 1)[None, None, :]
    l1 = total - l0
    ok = (l0 >= v) & (l1 >= v) & (n0 <= l0) & (n1 <= l1)
    if plan.recompute is Recompute.NONE:
        ok &= (n0 == 0) & (n1 == 0)
    else:
        ok &= (n0 + n1) >= 1
    for (base, per_layer, per_rc, jump), L, n in ((ranks[0].mem, l0, n0), (ranks[1].mem, l1, n1)):
        ok &= base + per_layer * L + per_rc * n + jump * (n > 0) <= cap
    if not ok.any():
        return None
    lin = lambda c, L, n: c[0] + c[1] * L + c[2] * n  # noqa: E731
    t0, t1 = lin(ranks[0].t, l0, n0), lin(ranks[1].t, l1, n1)
    f0, f1 = lin(ranks[0].f, l0, n0), lin(ranks[1].f, l1, n1)
    dp = [sum(mult * np.maximum(c0 + c1 * L - (w0 + w1 * L + w2 * n), bucket)
              for mult, (c0, c1), (w0, w1, w2), bucket in rs.dp)
          for rs, L, n in ((ranks[0], l0, n0), (ranks[1], l1, n1))]
    opt = np.maximum(ranks[0].opt[0] + ranks[0].opt[1] * l0, ranks[1].opt[0] + ranks[1].opt[1] * l1)
    scale = v if plan.schedule is Schedule.INTERLEAVED else 1
    step = (scale * m * np.maximum(t0, t1) + f0 + f1 - np.maximum(f0, f1)
            + scale * (np.maximum(dp[0], dp[1]) + opt))
    step = np.where(ok, np.broadcast_to(step, ok.shape), np.inf)
    best = np.min(step)
    tie = np.isclose(step, best, rtol=1e-12, atol=0.0) & ok
    a, b, c = np.nonzero(tie)
    i = np.lexsort((a, b + c))[0]  # fewest recomputed layers, then fewer layers on rank 0
    return Split(layers=(int(a[i]), total - int(a[i])), recomputed=(int(b[i]), int(c[i])), optimal=True)


def _ns(x: float) -> int:
    return round(x * NS)


def solve_split(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan,
                time_limit_s: float = 10.0, ranks: list[_RankShape] | None = None) -> Split | None:
    """The best (layers, recomputed) per rank for `plan`'s outer choices, or None if nothing fits."""
    ranks = ranks or rank_shapes(model, train, cluster, plan)
    total, v, m = model.num_layers, plan.vpp, plan.num_micro_batches
    if not split_exists(ranks, plan, cluster.device.memory_bytes, total):
        return None
    if plan.pp == 1:
        return _scan_single_rank(ranks[0], plan, total, cluster.device.memory_bytes)
    if plan.pp == 2:
        return _enumerate_two_ranks(ranks, plan, total, cluster.device.memory_bytes)
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
    cap = cluster.device.memory_bytes
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
    scale = v if plan.schedule is Schedule.INTERLEAVED else 1
    step = scale * m * T.var + sum(f.var for f in f_vars) - F.var + scale * (DP.var + OPT.var)
    # ties (equal predicted time) go to the split that recomputes fewer layers
    cm.Minimize((total + 1) * step + sum(n))
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1  # deterministic
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.Solve(cm)
    if status == cp_model.UNKNOWN:
        raise SolverTimeout(plan.short())
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return Split(layers=tuple(solver.Value(x) for x in L), recomputed=tuple(solver.Value(x) for x in n),
                 optimal=status == cp_model.OPTIMAL)


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
    for k, (mult, (c0, c1), (w0, w1, w2), bucket) in enumerate(rs.dp):
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
