"""The calibration table priced as if no row named its framework: what a published run costs the
model when the framework that ran it is one it does not know (costmodel.frameworks.GENERIC).

Each measured row is validated again under a framework name no trait set has; a row whose own
columns state a setting only its framework has (Megatron-Core's expert all-to-all overlap, hybrid
sharding, DeepSpeed's ZeRO-3 buckets) is refused under generic traits and counted, not priced.
The signed mean per framework that ran the rows says how far generic traits sit from each one's
own: a tuned framework's runs read slow, an eager one's fast. benchmarks/fidelity.py prints it and
docs/results.md holds it, so that a default of the generic traits that prices some class of run
far off shows as a figure.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass

from costmodel.inputs import UserError
from planner.measure.runs_table import framework_name
from planner.measure.validate import step_time_error_pct, validate_row

UNKNOWN_FRAMEWORK = "a-framework-the-model-does-not-know"


@dataclass(frozen=True, kw_only=True, slots=True)
class GenericPricing:
    n: int                      # measured rows priced with generic traits
    refused: int                # measured rows whose columns state a setting generic traits do not have
    mape_pct: float | None      # of step time
    max_abs_error_pct: float | None
    mean_error_by_framework_pct: dict[str, float]   # signed, of step time (+ predicted too slow)

    def to_dict(self) -> dict:
        return asdict(self)


def price_as_unknown(rows: list[dict[str, str]]) -> GenericPricing:
    """The measured rows (not the `status` ones) priced again under a framework the model does
    not know."""
    by_framework: dict[str, list[float]] = {}
    refused = 0
    for row in rows:
        if row["metric_name"].strip() == "status":
            continue
        try:
            res = validate_row({**row, "framework": UNKNOWN_FRAMEWORK})
        except UserError:
            refused += 1
            continue
        name = framework_name(row) or "(unstated)"
        by_framework.setdefault(name, []).append(step_time_error_pct(row, res.error_pct))
    errors = [abs(e) for es in by_framework.values() for e in es]
    return GenericPricing(n=len(errors), refused=refused,
                          mape_pct=statistics.mean(errors) if errors else None,
                          max_abs_error_pct=max(errors) if errors else None,
                          mean_error_by_framework_pct={k: statistics.mean(v) for k, v in sorted(by_framework.items())})


def summary_line(p: GenericPricing) -> str:
    """One line: the figures, and each framework's signed mean."""
    if not p.n:
        return f"priced as a framework the model does not know: no row ({p.refused} refused)"
    means = ", ".join(f"{k} {v:+.1f}%" for k, v in p.mean_error_by_framework_pct.items())
    return (f"priced as a framework the model does not know (generic traits): rows {p.n} "
            f"({p.refused} refused: their columns state a setting only their framework has)  MAPE {p.mape_pct:.1f}%  "
            f"max |error| {p.max_abs_error_pct:.1f}% (of step time); mean by the framework that ran them: {means}")
