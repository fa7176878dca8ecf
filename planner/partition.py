"""CP-SAT: split layers over pipeline ranks and choose per-rank recomputation under the memory cap
so that the predicted step time is minimal (the AdaPipe idea, Sun et al. 2024).

For one outer choice (degrees, micro-batch, schedule, ZeRO, recompute mode, placement) the cost
model is, per pipeline rank r, affine in its layer count L_r and recomputed-layer count n_r:
micro-batch time t_r, the schedule's fill f_r, optimizer time, memory (plus one step when n_r > 0);
the exposed data-parallel time is a max of affine pieces and a constant. planner.shapes reads those
coefficients from costmodel's own functions (tests/planner/test_partition.py checks they are
affine); the model here minimises exactly what `estimate` computes:

    m·max(t) + (sum(f) - max(f)) / v + max_r(sum_k mult_k·max(comm_kr - window_kr, one layer's bucket))
    + max_r(optimizer_r + host_r + tp_replica_sync_r)   (+ a constant: tied-embedding sync)

in integer nanoseconds. Within a rank, interleaved virtual stages get an even split (the model
prices a rank by its totals only). A framework other than our runtime narrows the split
(`SplitRules`: equal stages, the first k layers of every virtual stage recomputed, ...); the
bounds of the free split stay valid lower bounds of the narrowed one.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from ortools.sat.python import cp_model

from costmodel.groups import rank_caps_bytes
from costmodel.hardware import ClusterSpec
from costmodel.pipeline_closed_form import scaled_closed_form
from costmodel.plan import Plan, Recompute, even_layers
from costmodel.specs import ModelSpec, TrainSpec
from planner.bounds import MemoryFit, min_max_time_s
from planner.shapes import RankShape, rank_shapes

NS = 1e9
# CP-SAT attempts on a split model, each stopped at a deterministic-time budget (the same on
# every machine, so the answer is too) and the last at the deadline:
# - without presolve almost every model settles in milliseconds; CP-SAT's defaults alone spend
#   an order of magnitude longer in presolve on the large ones (megatron_h100_70B);
# - a few models with deep pipelines and full recomputation need more: symmetry breaking without
#   probing settles some that the defaults alone do not (sc21_t1_530) but leaves others unproven
#   that the defaults prove (sc21_t1_1T); chained as below, both are proven.
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


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitRules:
    """How a framework splits layers and recomputes them (planner.candidates.FrameworkSpace):
    split free | even (costmodel.plan.even_layers); recompute_counts free | every_nth (every
    k-th layer of each rank, k the same everywhere: torchtitan's layer-level checkpointing) | block (the
    first k layers of every virtual stage, k the same everywhere: Megatron's block method) | all."""

    split: str = "free"
    recompute_counts: str = "free"


FREE = SplitRules()


class SolverTimeout(Exception):
    """CP-SAT ran out of time before finding any split (not a proof that none fits)."""


def _recomputes_all(plan: Plan, rules: SplitRules) -> bool:
    """Whether every layer of the plan's recompute mode is recomputed: the framework's rule, or
    selective recomputation under the block method (Megatron applies it to every layer)."""
    if plan.recompute is Recompute.NONE:
        return False
    return rules.recompute_counts == "all" or (rules.recompute_counts == "block"
                                               and plan.recompute is Recompute.SELECTIVE)


def _narrow(cm: cp_model.CpModel, plan: Plan, rules: SplitRules, L, n, total: int,
            block_k: int | None = None) -> None:
    """The framework's rules on the split (`SplitRules`) as constraints; `block_k` fixes the
    block method's shared count (_solve_per_block_count)."""
    pp, v = plan.pp, plan.vpp
    if rules.split == "even":
        for r, layers in enumerate(even_layers(total, pp)):
            cm.Add(L[r] == layers)
    if _recomputes_all(plan, rules):
        for r in range(pp):
            cm.Add(n[r] == L[r])
    elif rules.recompute_counts == "every_nth" and plan.recompute is not Recompute.NONE:
        k = cm.NewIntVar(1, total, "k")   # every k-th layer of each rank (torchtitan)
        for r in range(pp):
            cm.AddDivisionEquality(n[r], L[r], k)
    elif rules.recompute_counts == "block" and plan.recompute is not Recompute.NONE:
        k = cm.NewIntVar(1, total, "k") if block_k is None else cm.NewConstant(block_k)   # the first k of every virtual stage
        for r in range(pp):
            if v == 1:
                cm.AddMinEquality(n[r], [k, L[r]])
            else:   # a rank's virtual stages split its layers evenly (apply_split): k <= the shortest
                cm.Add(n[r] == v * k)
                cm.Add(k * v <= L[r])


def _single_rank_counts(plan: Plan, rules: SplitRules, total: int) -> list[int]:
    """The recompute counts a single rank of `total` layers may take under the framework's rules."""
    if plan.recompute is Recompute.NONE:
        return [0]
    if _recomputes_all(plan, rules):
        return [total]
    if rules.recompute_counts == "every_nth":
        return sorted({total // k for k in range(1, total + 1)} - {0})
    return list(range(1, total + 1))


def _scan_single_rank(shape: RankShape, plan: Plan, total: int, cap: float, cutoff_s: float,
                      choices: list[int]) -> Split | None:
    """pp = 1: the whole objective is a function of n alone; try every n the framework allows
    (`choices`: _single_rank_counts; exact, no solver)."""
    best = None
    for n in choices:
        if shape.memory.at(total, n) > cap:
            continue
        t = shape.t.base + shape.t.per_layer * total + shape.t.per_recomputed * n
        dp = sum(mult * max(c0 + c1 * total - (w0 + w1 * total + w2 * n), bucket)
                 for mult, (c0, c1), (w0, w1, w2), bucket in shape.dp)
        value = plan.num_micro_batches * t + dp + shape.opt.intercept + shape.opt.slope * total
        if value <= cutoff_s and (best is None or value < best[0]):
            best = (value, n)
    return None if best is None else Split(layers=(total,), recomputed=(best[1],), optimal=True)


def _ns(x: float) -> int:
    return round(x * NS)


def solve_split(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan,
                time_limit_s: float = 10.0, ranks: list[RankShape] | None = None,
                cutoff_s: float = math.inf, fit: MemoryFit | None = None,
                rules: SplitRules = FREE) -> Split | None:
    """The best (layers, recomputed) per rank for `plan`'s outer choices, or None if no split
    fits with a step time of at most `cutoff_s` (the branch and bound's K-th best so far: the
    solver then only has to show nothing beats it). The objective leaves out the plan's
    constant terms (>= 0), so None never hides a plan that would beat the cutoff."""
    ranks = ranks or rank_shapes(model, train, cluster, plan)
    total = model.num_layers
    fit = fit or MemoryFit([r.memory for r in ranks], plan, rank_caps_bytes(plan, cluster), total)
    if not fit.fits:
        return None
    if plan.pp == 1:
        return _scan_single_rank(ranks[0], plan, total, fit.caps[0], cutoff_s, _single_rank_counts(plan, rules, total))
    deadline = time.perf_counter() + time_limit_s
    split = _SplitModel(model, plan, ranks, fit, cutoff_s, rules)
    shared_count = _shared_block_count(plan, rules)
    solver, status = split.solve(deadline, ATTEMPTS[:2] if shared_count else ATTEMPTS)
    if shared_count and status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE):
        return _solve_per_block_count(model, plan, ranks, fit, cutoff_s, rules, deadline)
    if status == cp_model.UNKNOWN:
        raise SolverTimeout(plan.short())
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return split.split(solver, optimal=status == cp_model.OPTIMAL)


def _shared_block_count(plan: Plan, rules: SplitRules) -> bool:
    """Whether the split holds the block method's count shared by every rank as min(k, L_r)
    (one virtual stage per rank, some layers recomputed): CP-SAT propagates that min of two
    variables poorly, and deep pipelines can take it tens of seconds to prove."""
    return (rules.recompute_counts == "block" and plan.vpp == 1 and plan.recompute is not Recompute.NONE
            and not _recomputes_all(plan, rules))


def _solve_per_block_count(model: ModelSpec, plan: Plan, ranks: list[RankShape], fit: MemoryFit, cutoff_s: float,
                           rules: SplitRules, deadline: float) -> Split | None:
    """The block method's split solved once per shared count k (each model then settles in a
    fraction of a second), over the counts some split fits (_block_counts), each solve held
    below the best so far; the best of them."""
    best: Split | None = None
    ceiling, optimal = None, True
    for k in _block_counts(model, plan, ranks, fit):
        split = _SplitModel(model, plan, ranks, fit, cutoff_s, rules, block_k=k, ceiling=ceiling)
        solver, status = split.solve(deadline, ATTEMPTS)
        if status == cp_model.UNKNOWN:
            optimal = False
            continue
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            continue
        best = split.split(solver, optimal=True)
        ceiling = round(solver.ObjectiveValue()) - 1
        optimal &= status == cp_model.OPTIMAL
    if best is None and not optimal:
        raise SolverTimeout(plan.short())
    return None if best is None else replace(best, optimal=optimal)


def _block_counts(model: ModelSpec, plan: Plan, ranks: list[RankShape], fit: MemoryFit) -> list[int]:
    """The shared counts k worth solving (one virtual stage per rank): those under which every
    rank can hold enough layers for their sum to reach the model's (a rank of L layers keeps
    min(k, L) recomputed: its memory is affine on either side of L = k), from the least up to
    the first under which no rank can hold more than k layers (every larger k is that split,
    every layer recomputed)."""
    total, pp = model.num_layers, plan.pp
    first = plan.stage_rank(0)
    counts = []
    for k in range(1, total + 1):
        most = [_most_layers(rs.memory, cap, k, total) for rs, cap in zip(ranks, fit.caps)]
        if all(m >= 1 for m in most) and sum(most) >= total and most[first] >= model.first_k_dense:
            counts.append(k)
        if max(most) <= k:
            break
    return counts


def _most_layers(mem, cap: float, k: int, total: int) -> int:
    """The most layers (at most `total`) a rank fits with min(k, L) of them recomputed; 0 if
    not even one. Memory as the CP-SAT model rounds it (_SplitModel)."""
    base, per_layer, per_rec, jump = round(mem.base), round(mem.per_layer), round(mem.per_recomputed), round(mem.jump)
    def fits(layers: int) -> bool:
        return base + per_layer * layers + per_rec * min(k, layers) + jump <= int(cap)
    lo, hi = 0, total   # fits() is monotone in L: each layer, recomputed or not, keeps something
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


class _SplitModel:
    """The CP-SAT model of one outer choice's split under `rules` (the block method's shared
    count fixed to `block_k` where given), its objective at most `ceiling` where given."""

    def __init__(self, model: ModelSpec, plan: Plan, ranks: list[RankShape], fit: MemoryFit, cutoff_s: float,
                 rules: SplitRules, block_k: int | None = None, ceiling: int | None = None):
        total, v, m = model.num_layers, plan.vpp, plan.num_micro_batches
        self.cm = cm = cp_model.CpModel()
        self.L = L = [cm.NewIntVar(v, total, f"L{r}") for r in range(plan.pp)]
        self.n = n = [cm.NewIntVar(0, total, f"n{r}") for r in range(plan.pp)]
        z = [cm.NewBoolVar(f"z{r}") for r in range(plan.pp)]
        cm.Add(sum(L) == total)
        # check_plan: the dense first layers on the first stage; apply_split gives the first rank's
        # shortest chunk, floor(L / vpp), to it
        cm.Add(L[plan.stage_rank(0)] >= model.first_k_dense * plan.vpp)
        for r in range(plan.pp):
            cm.Add(n[r] <= L[r])
            cm.Add(n[r] <= total * z[r])
            cm.Add(n[r] >= z[r])
        if plan.recompute is Recompute.NONE:
            cm.Add(sum(n) == 0)
        else:
            cm.Add(sum(n) >= 1)
        _narrow(cm, plan, rules, L, n, total, block_k)
        t_vars, f_vars, dp_vars, opt_vars = [], [], [], []
        for r, rs in enumerate(ranks):
            mem = rs.memory
            cm.Add(round(mem.base) + round(mem.per_layer) * L[r] + round(mem.per_recomputed) * n[r]
                   + round(mem.jump) * z[r] <= int(fit.caps[r]))
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
        objective = (total + 1) * step + sum(n)
        if ceiling is not None:
            cm.Add(objective <= ceiling)
        cm.Minimize(objective)

    def solve(self, deadline: float, attempts: list[tuple[dict, float | None]]) -> tuple[cp_model.CpSolver, int]:
        """The attempts (ATTEMPTS) in turn until one proves optimality or infeasibility, one
        without a budget up to the deadline. With the bounds above the model is small and tight,
        and presolve usually costs more than it saves."""
        for attempt, budget in attempts:
            solver, status = _solve(self.cm, time_limit_s=max(0.1, deadline - time.perf_counter()),
                                    deterministic_limit=budget, **attempt)
            if status in (cp_model.OPTIMAL, cp_model.INFEASIBLE):
                break
        return solver, status

    def split(self, solver: cp_model.CpSolver, optimal: bool) -> Split:
        return Split(layers=tuple(solver.Value(x) for x in self.L), recomputed=tuple(solver.Value(x) for x in self.n),
                     optimal=optimal)


def _solve(cm: cp_model.CpModel, *, time_limit_s: float, deterministic_limit: float | None = None,
           **parameters) -> tuple[cp_model.CpSolver, int]:
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1  # deterministic
    # CP-SAT's own Ctrl-C handler leaves SIGINT at its default (kill, no clean-up) once a solve
    # ends; each solve is short, so Python's handler serves between solves.
    solver.parameters.catch_sigint_signal = False
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


def _dp_rank(cm: cp_model.CpModel, rs: RankShape, L, n, total: int, v: int, r: int):
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
    """The concrete plan: rank r's layers spread evenly over its virtual stages (loop placement),
    a short chunk first on the first rank and last on the last, where the embedding and the LM
    head sit (costmodel.plan.embedding_loss_split is this layout)."""
    per_stage = [0] * plan.num_virtual_stages
    for r, layers in enumerate(split.layers):
        counts = even_layers(layers, plan.vpp)
        for chunk, count in enumerate(counts[::-1] if r == plan.pp - 1 else counts):
            per_stage[chunk * plan.pp + r] = count
    return replace(plan, layers_per_stage=tuple(per_stage), recompute_num_layers=split.recomputed)
