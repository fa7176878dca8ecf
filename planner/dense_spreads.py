"""Where a layer split puts DeepSeek's dense first layers (ModelSpec.first_k_dense: the model's
first layers, so the first virtual stages hold them in pipeline order).

apply_split gives each rank's layers evenly to its virtual stages, shortest first, so stage s < pp
(rank s's first chunk) holds floor(L_s / vpp) layers. A spread (d_0, ..., d_j) says stages 0..j-1
hold only dense layers, d_s = floor(L_s / vpp) of them, and stage j the d_j left, among others:
Megatron-Core's DeepSeek-V3 layout on 1,024 H100s, Et|(tt|)*30mL, is (1, 2) at PP8 VP4. The
dense layers stay off the last rank, which holds the head (the loop placement the search
splits; it lays V-shaped schedules out by simulation only). A rank's shape (time, fill, optimizer,
DP terms, memory) is linear in its dense layers: one CP-SAT model chooses the spread
(`DenseChoice`: the shapes with none and what each adds, `DenseDelta`), and the bounds the search
prunes with before the spread is chosen take each rank's least, at the fewest or the most dense
layers a spread gives it (`dense_range`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

from costmodel.frameworks import FrameworkTraits
from costmodel.memory import AffineBytes, stage_memory_shapes_by_dense, stage_memory_shapes_by_zero
from costmodel.plan import Plan
from costmodel.rank_time import RankTimeModel
from costmodel.specs import ModelSpec, TrainSpec
from planner.shapes import RankShape, pipeline_rows

# Spreads are the compositions of first_k_dense (2^(k-1) of them); published mixtures have at
# most three dense first layers (DeepSeek-V3, GLM-4.5: 3; DeepSeek-V2, Kimi K2: 1). Beyond this
# many the search keeps them all on the first stage: the spreads, and the joint model's Booleans,
# would double with each further layer.
MOST_SPREAD_DENSE = 4


@dataclass(frozen=True, slots=True)
class DenseSpread:
    """Dense first layers per stage, `per_stage[s]` on stage s (rank s's first virtual stage)."""

    per_stage: tuple[int, ...]

    def per_rank(self, pp: int) -> tuple[int, ...]:
        return self.per_stage + (0,) * (pp - len(self.per_stage))

    def layer_bounds(self, pp: int, vpp: int, total: int) -> tuple[tuple[int, int], ...]:
        """Per rank, the least and most layers under which apply_split lays the dense layers out
        so: each wholly dense first chunk exactly as long, the last at least (and a layer a
        virtual stage); vpp elsewhere."""
        *whole, last = self.per_stage
        bounds = [(vpp * d, vpp * d + vpp - 1) for d in whole] + [(max(vpp, vpp * last), total)]
        return tuple(bounds) + ((vpp, total),) * (pp - len(bounds))

    def constrain(self, cm, L, vpp: int, total: int) -> None:
        """`layer_bounds` as CP-SAT constraints on the layers per rank L."""
        for x, (lo, hi) in zip(L, self.layer_bounds(len(L), vpp, total)):
            cm.Add(x >= lo)
            cm.Add(x <= hi)

    def admits(self, layers: tuple[int, ...], vpp: int) -> bool:
        """Whether a split of `layers` per rank lays the dense layers out so (`layer_bounds`)."""
        return all(lo <= n <= hi for n, (lo, hi) in zip(layers, self.layer_bounds(len(layers), vpp, sum(layers))))


def first_stage_spread(model: ModelSpec) -> DenseSpread:
    """All of the dense first layers on the first stage (costmodel.params.rank_params_at's
    default); a dense model's (0,)."""
    return DenseSpread((model.first_k_dense,))


def dense_spreads(model: ModelSpec, plan: Plan) -> list[DenseSpread]:
    """The spreads a split of `plan` may take, all on the first stage first; that one alone for a
    dense model or one dense layer, without a pipeline (or with two ranks: never on the last), and
    beyond MOST_SPREAD_DENSE dense layers."""
    k = model.first_k_dense
    if plan.pp <= 2 or k <= 1 or k > MOST_SPREAD_DENSE:
        return [first_stage_spread(model)]
    out = []
    for parts in range(1, min(k, plan.pp - 1) + 1):
        for cuts in combinations(range(1, k), parts - 1):
            bounds = (0, *cuts, k)
            out.append(DenseSpread(tuple(b - a for a, b in zip(bounds, bounds[1:]))))
    return out


def dense_range(model: ModelSpec, plan: Plan) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per rank, the fewest and the most dense first layers the spreads give it."""
    counts = [spread.per_rank(plan.pp) for spread in dense_spreads(model, plan)]
    return tuple(map(min, zip(*counts))), tuple(map(max, zip(*counts)))


def reachable(model: ModelSpec, plan: Plan) -> tuple[int, ...]:
    """Per rank, the most dense first layers some spread gives it (0 on ranks none reaches)."""
    return dense_range(model, plan)[1]


def spread_memory_shapes(model: ModelSpec, train: TrainSpec, plan: Plan, reserved_bytes: float,
                         traits: FrameworkTraits) -> dict[tuple[int, ...], list[AffineBytes]]:
    """The memory shapes of `plan` per placement of the dense first layers (per rank, how many it
    holds): every spread's, none anywhere and each rank's most (`reachable`: with none, the
    shapes DenseDelta reads), priced at once, sharing the ranks' activations."""
    placements = list(dict.fromkeys([*(s.per_rank(plan.pp) for s in dense_spreads(model, plan)),
                                     (0,) * plan.pp, reachable(model, plan)]))
    shapes = stage_memory_shapes_by_dense(model, train, [plan], reserved_bytes, traits, placements)
    return {placed: by_zero[0] for placed, by_zero in zip(placements, shapes)}


def least_memory_shapes_by_zero(model: ModelSpec, train: TrainSpec, plans: list[Plan], reserved_bytes: float,
                                traits: FrameworkTraits) -> list[list[AffineBytes]]:
    """costmodel.memory.stage_memory_shapes_by_zero with the dense first layers where the search's
    split puts them: where it may spread them, each rank's least over every spread (its memory is
    linear in its dense layers: the least is at the fewest or the most it holds, `dense_range`),
    a bound below each spread's shapes."""
    plan = plans[0]
    if len(dense_spreads(model, plan)) == 1:
        return stage_memory_shapes_by_zero(model, train, plans, reserved_bytes, traits)
    ends = stage_memory_shapes_by_dense(model, train, plans, reserved_bytes, traits, dense_range(model, plan))
    return [[_lower(a, b) for a, b in zip(fewest, most)] for fewest, most in zip(*ends)]


def _lower(a, b):
    """The lower of two shapes (costmodel.memory.AffineBytes, planner.shapes.Coefficients) that
    differ in their base alone: a rank's dense layers move only that."""
    assert (a.per_layer, a.per_recomputed, getattr(a, "jump", 0.0)) == \
        (b.per_layer, b.per_recomputed, getattr(b, "jump", 0.0)), (a, b)
    return a if a.base <= b.base else b


def least_pipeline_rows(model: ModelSpec, rtm: RankTimeModel, plan: Plan) -> tuple[list, list]:
    """planner.shapes.pipeline_rows, each rank's least over every spread of the dense first
    layers (linear in them: at the fewest or the most it holds, `dense_range`)."""
    if len(dense_spreads(model, plan)) == 1:
        return pipeline_rows(rtm, plan)
    (t0, f0), (t1, f1) = (pipeline_rows(rtm, plan, dense) for dense in dense_range(model, plan))
    return [_lower(a, b) for a, b in zip(t0, t1)], [_lower(a, b) for a, b in zip(f0, f1)]


@dataclass(frozen=True, slots=True)
class DenseDelta:
    """What each dense first layer a rank holds adds to its shape (planner.shapes.RankShape): to
    its micro-batch time, fill, optimizer and memory, and per DP term to the collective's time and
    to the compute it hides behind. A rank's shape is linear in its dense layers."""

    t_s: float
    f_s: float
    opt_s: float
    memory_bytes: float
    dp_s: tuple[tuple[float, float], ...]   # per DP term: (comm, window)

    @staticmethod
    def between(none: RankShape, most: RankShape, count: int) -> DenseDelta:
        """The delta from a rank's shape with none of them to its shape with `count`."""
        def per(a: float, b: float) -> float:
            return 0.0 if a == b else (b - a) / count   # a window that hides everything stays so
        def fixed(s: RankShape) -> tuple:   # what the dense layers leave alone
            return (s.t[1:], s.f[1:], s.memory.per_layer, s.memory.per_recomputed, s.memory.jump,
                    [(t.multiplier, t.comm.slope, t.window[1:], t.bucket) for t in s.dp])
        assert fixed(none) == fixed(most), (none, most)
        assert math.isclose(none.opt.slope, most.opt.slope, rel_tol=1e-9, abs_tol=1e-15), (none.opt, most.opt)
        return DenseDelta(t_s=per(none.t.base, most.t.base), f_s=per(none.f.base, most.f.base),
                          opt_s=per(none.opt.intercept, most.opt.intercept),
                          memory_bytes=per(none.memory.base, most.memory.base),
                          dp_s=tuple((per(a.comm.intercept, b.comm.intercept), per(a.window.base, b.window.base))
                                   for a, b in zip(none.dp, most.dp)))


@dataclass(frozen=True, slots=True)
class DenseChoice:
    """The spreads one split model chooses among (planner.split_model): with one, the ranks'
    shapes are that spread's; with several, they are the shapes with no dense layer, `deltas`
    adds each rank's (None where no spread reaches it), and `slowest_s` is the least of the
    spreads' min-max rank times (planner.bounds.min_max_time_s)."""

    spreads: tuple[DenseSpread, ...]
    deltas: tuple[DenseDelta | None, ...] = ()
    slowest_s: float = 0.0

    def constrain(self, cm, L, vpp: int, total: int) -> list:
        """The spreads' layer bounds on L (one of them holding), and per rank the CP-SAT
        expression of its dense layers with the most it may hold, or None (the shapes hold them)."""
        if len(self.spreads) == 1:
            self.spreads[0].constrain(cm, L, vpp, total)
            return [None] * len(L)
        chosen = [cm.NewBoolVar(f"spread{i}") for i in range(len(self.spreads))]
        cm.AddExactlyOne(chosen)
        # each rank's bounds as sums over the choice (exactly one holds): linear, so the
        # relaxation CP-SAT proves optimality with keeps them
        bounds = [s.layer_bounds(len(L), vpp, total) for s in self.spreads]
        for r, x in enumerate(L):
            cm.Add(x >= sum(b[r][0] * y for b, y in zip(bounds, chosen)))
            cm.Add(x <= sum(b[r][1] * y for b, y in zip(bounds, chosen)))
        out = []
        for r in range(len(L)):
            counts = [s.per_rank(len(L))[r] for s in self.spreads]
            out.append((sum(d * y for d, y in zip(counts, chosen) if d), max(counts)) if any(counts) else None)
        return out
