"""What a search produces: the plans it found (Found), how it went (SearchStats) and the whole
answer (SearchResult)."""
from __future__ import annotations

from dataclasses import dataclass, field

from costmodel.estimate import Estimate
from costmodel.plan import Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class Found:
    plan: Plan
    estimate: Estimate
    # plans the model prices identically (same step time and peak memory), shown as this one row
    alternatives: tuple[Plan, ...] = ()


@dataclass(kw_only=True)
class SearchStats:
    wall_s: float = 0.0
    num_candidates: int = 0
    num_feasible: int = 0
    num_solved: int = 0
    pruned_by_reason: dict[str, int] = field(default_factory=dict)
    optimal: bool = True
    lower_bound_s: float = 0.0  # no plan left unexamined can beat this (equals the best when optimal)
    enumerated: bool = True     # False: the time limit fell while the space was being listed (no bound)

    def prune(self, reason: str, count: int = 1) -> None:
        self.pruned_by_reason[reason] = self.pruned_by_reason.get(reason, 0) + count

    def to_dict(self) -> dict:
        return {"wall_s": self.wall_s, "num_candidates": self.num_candidates,
                "num_feasible": self.num_feasible, "num_solved": self.num_solved,
                "pruned_by_reason": dict(sorted(self.pruned_by_reason.items())), "optimal": self.optimal,
                "lower_bound_s": self.lower_bound_s, "enumerated": self.enumerated}


@dataclass(kw_only=True)
class SearchResult:
    plans: list[Found]
    stats: SearchStats
    evaluated: list[Found]         # every plan the solver produced, for --csv
    closest: Found | None = None   # when nothing fits: the plan that overflows least
    equivalent: int = 1            # the first plans within the error band of the fastest
    error_band: float = 0.0
    fastest: Found | None = None   # the fastest plan found (plans[0] is the most robust)
    # why states or activations went to the host ("": the user decided, or nothing did)
    offloaded_because: str = ""
    # the fastest closed-form plan, which the optimality proof is about (differs from `fastest`
    # when a variant priced by simulation alone beat it: a schedule without a closed form, ZBV,
    # or a plan laid out again, planner.relayout)
    proven_fastest: Found | None = None
    # the closed-form step time up to which the rows are proven (planner.cutoff), when plans found
    # slower than it were left out of the table; None when none was
    rows_proven_to_s: float | None = None
    # plans found but not re-priced by simulation before the time limit (left out of the table)
    unpriced: int = 0
