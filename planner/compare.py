"""Why the first plan beat the others, line by line of the ledger: against the fastest plan of
another layout (another TP / PP / CP / EP / ZeRO shape: the rows next to the first differ only
in recomputation or micro-batching and teach little) and against the model's published expert
recipes (planner/recipes.toml) placed on the same cluster."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from costmodel.check import check_memory
from costmodel.estimate import Estimate, estimate
from costmodel.hardware import ClusterSpec
from costmodel.plan import Plan
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.units import GIB
from planner.ranking import price
from planner.recipes import Recipe, adapted, float8_variants, place, recipes_for
from planner.search_result import Found, SearchResult

OTHER_LAYOUT = "runner-up of another layout"
SHOWN_MORE, SHOWN_LESS = 4, 2   # ledger items where the other plan spends more, and less
SMALLEST_S = 5e-4               # ledger differences under half a millisecond are not shown
RESIMULATED = 3                 # other-layout plans re-priced by simulation before the fastest is taken


@dataclass(frozen=True, kw_only=True, slots=True)
class Comparison:
    against: str                  # OTHER_LAYOUT or "recipe: <name> (<source>)"
    plan: Plan | None             # None: the recipe cannot be placed on this cluster
    estimate: Estimate | None
    delta_s: float | None         # the other plan's step time less the first's
    lines: tuple[str, ...]        # the ledger items that differ, or why there is no plan
    note: str = ""                # what was adapted from the recipe as written
    within_band: bool = False     # faster than the first by less than the model's error band
    by_memory: bool = False       # the first was chosen for its memory (--objective memory), not robustness

    def headline(self) -> str:
        if self.plan is None or self.estimate is None or self.delta_s is None:
            return f"vs {self.against}: not comparable here: {self.lines[0]}"
        fits = "" if self.estimate.fits else " (does not fit)"
        speed = "slower" if self.delta_s >= 0 else "faster"
        chosen = ("--objective memory takes the one with less memory" if self.by_memory
                  else "the first is chosen as the more robust")
        band = (f" (within the model's error band, where {chosen})"
                if self.within_band else
                " (it does not fit, so it is not a plan)" if self.delta_s < 0 and not self.estimate.fits else "")
        return (f"vs {self.against} ({self.plan.short()}{fits}): {abs(self.delta_s) * 1e3:,.0f} ms {speed} per step"
                + band + (f" [{self.note}]" if self.note else ""))

    def text(self) -> str:
        if self.plan is None:
            return self.headline()
        return "\n".join([self.headline(), *(f"    {line}" for line in self.lines)])

    def to_dict(self) -> dict[str, Any]:
        return {"against": self.against, "plan": None if self.plan is None else self.plan.to_dict(),
                "delta_s": self.delta_s, "fits": None if self.estimate is None else self.estimate.fits,
                "within_error_band": self.within_band, "note": self.note or None, "lines": list(self.lines)}


def comparisons(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, result: SearchResult,
                objective: str = "time") -> list[Comparison]:
    best = result.plans[0]
    out = []
    other = other_layout(model, train, cluster, result)
    if other is not None:
        out.append(_priced(OTHER_LAYOUT, best, other.plan, other.estimate))
    recipes = [against_recipe(recipe, model, train, cluster, best) for recipe in recipes_for(model)]
    # the recipes placed on this cluster; where none can be, each says why
    out += [c for c in recipes if c.plan is not None] or recipes
    floor_s = best.estimate.step_time_s * (1 - result.error_band)
    # only a plan that fits can be equivalent to the first (one that does not is not a plan)
    return [replace(c, within_band=c.delta_s is not None and c.delta_s < 0 and c.estimate.step_time_s >= floor_s
                    and c.estimate.fits,
                    by_memory=objective == "memory") for c in out]


def layout(plan: Plan) -> tuple:
    """What makes a layout another: the parallel degrees and where the training states live."""
    return plan.tp, plan.pp, plan.cp, plan.ep, plan.etp, plan.zero_stage, plan.offload_optimizer


def other_layout(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, result: SearchResult) -> Found | None:
    """The fastest plan the search priced exactly whose layout differs from the first's and whose
    price differs too (plans priced alike are the first row's alternatives, not a runner-up).
    The search prices exactly what its bound cannot rule out for the rows it shows, so a larger
    --top may find a faster plan of another layout; the first plan itself never changes.
    The solver prices in closed form: its RESIMULATED fastest such plans are priced by simulation,
    as the first plan is, and the fastest of them is the answer."""
    best = result.plans[0]
    mine = {layout(p) for p in (best.plan, *best.alternatives)}
    others = {f.plan: f for f in (*result.plans[1:], *result.evaluated)
              if layout(f.plan) not in mine and price(f) != price(best) and f.estimate.fits}
    closest = sorted(others.values(), key=lambda f: (f.estimate.step_time_s, f.estimate.max_peak_memory_bytes))
    simulated = [Found(plan=f.plan, estimate=estimate(model, train, cluster, f.plan)) for f in closest[:RESIMULATED]]
    return min(simulated, key=lambda f: (f.estimate.step_time_s, f.estimate.max_peak_memory_bytes), default=None)


def against_recipe(recipe: Recipe, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
                   best: Found) -> Comparison:
    label = f"recipe: {recipe.name} ({recipe.source})"
    placed = [place(recipe, model, train, cluster, fp8) for fp8 in float8_variants(recipe, model, train, cluster)]
    priced = [(plan, estimate(model, train, cluster, plan)) for plan, _ in placed if plan is not None]
    if not priced:
        return Comparison(against=label, plan=None, estimate=None, delta_s=None,
                          lines=(f"{recipe.layout()} on {cluster.name}: {placed[0][1]}",))
    # in bf16 or float8 linears, the faster that fits (else the leaner), as the search weighs them
    plan, est = min(priced, key=lambda p: (not p[1].fits, p[1].step_time_s if p[1].fits else p[1].max_peak_memory_bytes))
    compared = _priced(label, best, plan, est, adapted(recipe, train, cluster, plan))
    if est.fits:
        return compared
    over = check_memory(model, train, cluster, plan)
    return Comparison(against=label, plan=plan, estimate=est, delta_s=compared.delta_s, note=compared.note,
                      lines=(f"does not fit on {cluster.device.name}: {over[0] if over else 'over capacity'}",
                             *compared.lines))


def _priced(label: str, best: Found, plan: Plan, est: Estimate, note: str = "") -> Comparison:
    return Comparison(against=label, plan=plan, estimate=est,
                      delta_s=est.step_time_s - best.estimate.step_time_s,
                      lines=tuple(ledger_lines(best.estimate, est)), note=note)


def ledger_lines(best: Estimate, other: Estimate) -> list[str]:
    """The step-time items where `other` spends more (largest first), then where it spends less,
    each with both figures, and the peak memory of the tightest rank of each."""
    keys = dict.fromkeys([*best.time_breakdown_s, *other.time_breakdown_s])
    deltas = {k: other.time_breakdown_s.get(k, 0.0) - best.time_breakdown_s.get(k, 0.0) for k in keys}
    more = sorted((k for k, d in deltas.items() if d >= SMALLEST_S), key=lambda k: -deltas[k])[:SHOWN_MORE]
    less = sorted((k for k, d in deltas.items() if d <= -SMALLEST_S), key=lambda k: deltas[k])[:SHOWN_LESS]
    lines = [f"{k}: {other.time_breakdown_s.get(k, 0.0):.3f} s vs {best.time_breakdown_s.get(k, 0.0):.3f} s "
             f"({deltas[k] * 1e3:+,.0f} ms)" for k in more + less]
    if not lines:
        lines.append("no ledger item differs by half a millisecond or more")
    peak_o, peak_b = other.max_peak_memory_bytes, best.max_peak_memory_bytes
    lines.append(f"peak memory: {peak_o / GIB:.1f} GiB vs {peak_b / GIB:.1f} GiB ({(peak_o - peak_b) / GIB:+.1f} GiB)")
    return lines
