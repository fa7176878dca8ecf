"""The CP-SAT model of a layer split (planner.partition): per pipeline rank its layer and
recomputed-layer counts, the framework's rules on them (`SplitRules`), each rank's memory under
its cap, and the step time the cost model computes, as planner.shapes reads it off the cost
model, in integer nanoseconds."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from costmodel.memory import AffineBytes
from costmodel.pipeline_closed_form import scaled_closed_form
from costmodel.plan import Plan, Recompute, even_layers
from costmodel.specs import ModelSpec
from planner.bounds import MemoryFit, min_max_time_s
from planner.dense_spreads import DenseChoice, DenseDelta, first_stage_spread
from planner.shapes import RankShape

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

NS = 1e9


def cp_sat() -> ModuleType:
    """OR-Tools' CP-SAT module (ortools.sat.python.cp_model), imported when the first split is
    solved: with the pandas it imports, it is most of the command line's start-up, which the
    commands that solve no split (predict, report, export, models, --help) need not pay."""
    from ortools.sat.python import cp_model
    return cp_model


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitRules:
    """How a framework splits layers and recomputes them (planner.search_options.FrameworkSpace):
    split free | even (costmodel.plan.even_layers); recompute_counts free | every_nth (every
    k-th layer of each rank, k the same everywhere: torchtitan's layer-level checkpointing) | block (the
    first k layers of every virtual stage, k the same everywhere: Megatron's block method) | all."""

    split: str = "free"
    recompute_counts: str = "free"


FREE = SplitRules()


def recomputes_all(plan: Plan, rules: SplitRules) -> bool:
    """Whether every layer of the plan's recompute mode is recomputed: the framework's rule, or
    selective recomputation where the framework applies it to every layer (Megatron's core
    attention beside the block method; torchtitan's per-op policy beside every n-th layer)."""
    if plan.recompute is Recompute.NONE:
        return False
    return rules.recompute_counts == "all" or (rules.recompute_counts in ("block", "every_nth")
                                               and plan.recompute is Recompute.SELECTIVE)


def narrow(cm: cp_model.CpModel, plan: Plan, rules: SplitRules, L, n, total: int,
            block_k: int | None = None) -> None:
    """The framework's rules on the split (`SplitRules`) as constraints; `block_k` fixes the
    block method's shared count (partition._solve_per_block_count)."""
    pp, v = plan.pp, plan.vpp
    if rules.split == "even":
        for r, layers in enumerate(even_layers(total, pp)):
            cm.Add(L[r] == layers)
    if recomputes_all(plan, rules):
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


def _ns(x: float) -> int:
    return round(x * NS)


def integer_bytes(mem: AffineBytes) -> tuple[int, int, int, int]:
    """A rank's memory shape (base, per layer, per recomputed layer, the rebuilt layer's jump) in
    the whole bytes the model constrains against the rank's cap."""
    return round(mem.base), round(mem.per_layer), round(mem.per_recomputed), round(mem.jump)


class SplitModel:
    """The CP-SAT model of one outer choice's split under `rules` (the block method's shared
    count fixed to `block_k` where given), its objective at most `ceiling` where given."""

    def __init__(self, model: ModelSpec, plan: Plan, ranks: list[RankShape], fit: MemoryFit, cutoff_s: float,
                 rules: SplitRules, block_k: int | None = None, ceiling: int | None = None,
                 dense: DenseChoice | None = None):
        total, v, m = model.num_layers, plan.vpp, plan.num_micro_batches
        self.cm = cm = cp_sat().CpModel()
        self.L = L = [cm.NewIntVar(v, total, f"L{r}") for r in range(plan.pp)]
        self.n = n = [cm.NewIntVar(0, total, f"n{r}") for r in range(plan.pp)]
        z = [cm.NewBoolVar(f"z{r}") for r in range(plan.pp)]
        cm.Add(sum(L) == total)
        # the dense first layers where the ranks' shapes price them (planner.dense_spreads; by
        # default all on the first stage, the first rank's shortest chunk under apply_split)
        dense = dense or DenseChoice((first_stage_spread(model),))
        dense_terms = dense.constrain(cm, L, plan.vpp, total)
        for r in range(plan.pp):
            cm.Add(n[r] <= L[r])
            cm.Add(n[r] <= total * z[r])
            cm.Add(n[r] >= z[r])
        if plan.recompute is Recompute.NONE:
            cm.Add(sum(n) == 0)
        else:
            cm.Add(sum(n) >= 1)
        narrow(cm, plan, rules, L, n, total, block_k)
        t_vars, f_vars, dp_vars, opt_vars = [], [], [], []
        for r, rs in enumerate(ranks):
            mem = rs.memory
            base, per_layer, per_recomputed, jump = integer_bytes(mem)
            delta = dense.deltas[r] if dense_terms[r] else None
            d, most = dense_terms[r] or (0, 0)
            per_dense = round(delta.memory_bytes) if delta else 0
            cm.Add(base + per_layer * L[r] + per_recomputed * n[r] + jump * z[r] + per_dense * d <= int(fit.caps[r]))
            t_vars.append(_affine_var(cm, rs.t, L[r], n[r], v, total, f"t{r}", delta and (delta.t_s, d, most)))
            f_vars.append(_affine_var(cm, rs.f, L[r], n[r], v, total, f"f{r}", delta and (delta.f_s, d, most)))
            opt_vars.append(_affine_var(cm, (*rs.opt, 0.0), L[r], n[r], v, total, f"o{r}",
                                        delta and (delta.opt_s, d, most)))
            dp_vars.append(_dp_rank(cm, rs, L[r], n[r], total, v, r, delta, d, most))
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
        slack = (scale * m + 3 * plan.pp + 3) * (2 * total + 2 + model.first_k_dense)
        slowest = min_max_time_s([r.t for r in ranks], plan, fit, total) if len(dense.spreads) == 1 else dense.slowest_s
        cm.Add(T.var >= math.floor(slowest * NS) - slack)  # the exact min-max of the slowest rank
        if math.isfinite(cutoff_s):
            cm.Add(step <= math.floor(scale * cutoff_s * NS) + slack)
        # ties (equal predicted time) go to the split that recomputes fewer layers
        objective = (total + 1) * step + sum(n)
        if ceiling is not None:
            cm.Add(objective <= ceiling)
        cm.Minimize(objective)

    def solve(self, deadline: float, attempts: list[tuple[dict, float | None]],
              wall_per_deterministic_s: float = math.inf) -> tuple[cp_model.CpSolver, int]:
        """The attempts (ATTEMPTS) in turn until one proves optimality or infeasibility, one
        without a budget up to the deadline; a budgeted one also stops after
        `wall_per_deterministic_s` x its budget of wall time. With the bounds above the model is
        small and tight, and presolve usually costs more than it saves."""
        cp_model = cp_sat()
        settled = (cp_model.OPTIMAL, cp_model.INFEASIBLE)
        for attempt, budget in attempts:
            left_s = max(0.1, deadline - time.perf_counter())
            wall_s = left_s if budget is None else min(left_s, max(0.1, wall_per_deterministic_s * budget))
            solver, status = solve_model(self.cm, time_limit_s=wall_s, deterministic_limit=budget, **attempt)
            if status in settled:
                break
        return solver, status

    def solution(self, solver: cp_model.CpSolver) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Layers and recomputed layers per rank of the solver's best solution."""
        return tuple(solver.Value(x) for x in self.L), tuple(solver.Value(x) for x in self.n)


def solve_model(cm: cp_model.CpModel, *, time_limit_s: float, deterministic_limit: float | None = None,
           **parameters) -> tuple[cp_model.CpSolver, int]:
    solver = cp_sat().CpSolver()
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
                total: int, name: str, dense: tuple[float, object, int] | None = None):
    """An IntVar equal to a + b·L + c·n (ns), + e·d where `dense` is (e, the rank's dense layers
    d, the most it may hold), with its exact range as domain (tight domains make CP-SAT's
    propagation and optimality proof fast)."""
    a, b, c = (_ns(x) for x in coef)
    e, d, most = dense or (0.0, 0, 0)
    e = _ns(e)
    corners = [a + b * x + c * y + e * w for x in (lo_layers, total) for y in (0, total) for w in (0, most)]
    var = _Bounded(cm.NewIntVar(min(corners), max(corners), name), min(corners), max(corners))
    cm.Add(var.var == a + b * L + c * n + e * d)
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


def _dp_rank(cm: cp_model.CpModel, rs: RankShape, L, n, total: int, v: int, r: int,
             delta: DenseDelta | None = None, d=0, most: int = 0):
    """sum_k mult_k · max(comm_k - window_k, bucket_k) for one rank (each term's comm and window
    moved by the rank's dense layers d where `delta` says by how much)."""
    if not rs.dp:
        return _Bounded(cm.NewConstant(0), 0, 0)
    moves = delta.dp_s if delta else ((0.0, 0.0),) * len(rs.dp)
    parts, lo, hi = [], 0, 0
    # terms that hide behind nothing (window "none": exposed syncs, the contention terms) are
    # affine in L once one layer's worth already exceeds the bucket: one variable for all of them
    exposed = [k for k, ((_, (c0, c1), w, bucket), (dc, dw)) in enumerate(zip(rs.dp, moves))
               if w == (0.0, 0.0, 0.0) and dw == 0.0 and c1 >= 0
               and c0 + min(0.0, dc * most) + c1 * max(v, 1) >= bucket]
    if exposed:
        terms = [(rs.dp[k].multiplier, rs.dp[k].comm, moves[k][0]) for k in exposed]
        var = _affine_var(cm, (sum(m * c0 for m, (c0, _), _ in terms), sum(m * c1 for m, (_, c1), _ in terms), 0.0),
                          L, n, v, total, f"e{r}", (sum(m * dc for m, _, dc in terms), d, most) if delta else None)
        parts.append(var.var)
        lo, hi = lo + var.lo, hi + var.hi
    for k, ((mult, (c0, c1), (w0, w1, w2), bucket), (dc, dw)) in enumerate(zip(rs.dp, moves)):
        if k in exposed:
            continue
        diff = _affine_var(cm, (c0 - w0, c1 - w1, -w2), L, n, v, total, f"d{r}_{k}",
                           (dc - dw, d, most) if delta else None)
        b = _ns(bucket)
        hidden = _max_var(cm, [diff, _Bounded(cm.NewConstant(b), b, b)], f"h{r}_{k}")
        parts.append(mult * hidden.var)
        lo, hi = lo + mult * hidden.lo, hi + mult * hidden.hi
    out = cm.NewIntVar(lo, hi, f"dp{r}")
    cm.Add(out == sum(parts))
    return _Bounded(out, lo, hi)
