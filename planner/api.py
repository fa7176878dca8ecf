"""The planner from Python: the answers the command line prints, as typed results.

    from planner import api
    answer = api.search("llama-70b", "8x8xA100")
    print(answer.best.plan.short(), answer.best.estimate.step_time_s)

A model is a registry name (`planner models`), a path to a Hugging Face config.json, such a
config as a dict, or a `costmodel.specs.ModelSpec`; a cluster is `NODESxGPUSxDEVICE` (or a
`ClusterSpec`). Every result has `to_dict()`, JSON-serialisable, in the command line's --json
shape. Bad input raises `costmodel.inputs.UserError` with the one line the CLI prints.
Examples that run: docs/api.md (tests/planner/test_api.py runs them).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from costmodel.check import check_structure
from costmodel.estimate import Estimate, estimate
from costmodel.hardware import ClusterSpec
from costmodel.inputs import UserError
from costmodel.plan import Plan, Recompute
from costmodel.resilience import LLAMA3, Failures
from costmodel.schedules import Schedule
from costmodel.specs import ModelSpec, TrainSpec
from planner.compare import Comparison, comparisons
from planner.no_plan import no_plan_reason
from planner.search import Found, SearchOptions, SearchResult
from planner.space import Choice, build_plan
from planner.specs import ModelLike, build_specs, enum_value
from planner.sweep import SweepResult, SweepSpec
from planner.targets import PLANNER, options_for, refuse_unless_runs

__all__ = ["SearchAnswer", "PredictAnswer", "search", "predict", "sweep", "validate"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchAnswer:
    """`planner search`: the ranked plans (the first is the answer) and how the search went."""

    model: ModelSpec
    train: TrainSpec
    cluster: ClusterSpec
    framework: str
    result: SearchResult
    # the first plan against the fastest of another layout and the model's published recipes
    comparisons: tuple[Comparison, ...] = ()

    @property
    def best(self) -> Found:
        return self.result.plans[0]

    @property
    def plans(self) -> list[Found]:
        return self.result.plans

    @property
    def proven_optimal(self) -> bool:
        return self.result.stats.optimal

    def to_dict(self) -> dict[str, Any]:
        return {"plans": [{"plan": f.plan.to_dict(), "estimate": f.estimate.to_dict(),
                           "alternatives": [a.to_dict() for a in f.alternatives]} for f in self.plans],
                "comparisons": [c.to_dict() for c in self.comparisons],
                "search": {**self.result.stats.to_dict(), "framework": self.framework}}


@dataclass(frozen=True, kw_only=True, slots=True)
class PredictAnswer:
    """`planner predict`: one plan's estimate (step-time ledger, memory per stage)."""

    model: ModelSpec
    train: TrainSpec
    cluster: ClusterSpec
    framework: str
    plan: Plan
    estimate: Estimate

    @property
    def fits(self) -> bool:
        return self.estimate.fits

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "framework": self.framework, "estimate": self.estimate.to_dict()}


def _fixed(fix: dict[str, Any] | None) -> dict[str, Any]:
    """`fix` as the search pins fields: keyed by the plan's field names ("zero_stage") or the
    CLI's --fix names ("zero"), a value as the field holds it or as the CLI writes it ("1f1b",
    "yes"); an unknown key or a value no field takes is a UserError naming it."""
    from planner.commands.search import FIXABLE
    fields = {name: parse for name, parse in FIXABLE.values()}
    out: dict[str, Any] = {}
    for key, value in (fix or {}).items():
        name, parse = FIXABLE[key] if key in FIXABLE else (key, fields.get(key))
        if parse is None:
            raise UserError(f"fix: unknown key {key!r}; keys: {', '.join(FIXABLE)} (or their plan fields: "
                            f"{', '.join(fields)})")
        try:   # a bool as the field holds it; a number or a name (an enum's too) as the CLI parses it
            out[name] = value if isinstance(value, bool) else parse(str(value))
        except (ValueError, KeyError, TypeError, argparse.ArgumentTypeError) as exc:
            raise UserError(f"fix: {key}={value!r}: {exc}") from None
    return out


def search(model: ModelLike, cluster: str | ClusterSpec, *, framework: str = PLANNER, top: int = 5,
           fix: dict[str, Any] | None = None, time_limit_s: float = 60.0, max_tp: int | None = None,
           no_recompute: bool = False, **train: Any) -> SearchAnswer:
    """The fastest plans that fit (proven optimal under the cost model unless the time limit
    stops the search). `fix`: plan fields pinned, e.g. {"pp": 4, "zero_stage": 1}; `train`:
    seq_len, global_batch, dtype, memory_headroom... as the CLI's flags. Raises UserError when
    nothing fits (with the closest plan) or the constraints contradict."""
    from planner.args import MAX_TOP
    from planner.search import search as run
    if not 1 <= top <= MAX_TOP:
        raise UserError(f"top {top}: give 1 to {MAX_TOP}")
    spec, train_spec, parsed = build_specs(model, cluster, framework=framework, **train)
    options = options_for(framework, spec, train_spec, parsed,
                          SearchOptions(top_k=top, fixed=_fixed(fix), time_limit_s=time_limit_s, max_tp=max_tp,
                                        no_recompute=no_recompute))
    result = run(spec, train_spec, parsed, options)
    if not result.plans:
        raise UserError(f"no plan found within the time limit of {time_limit_s:g} s" if not result.stats.optimal
                        else no_plan_reason(spec, train_spec, parsed, options, result))
    return SearchAnswer(model=spec, train=train_spec, cluster=parsed, framework=framework, result=result,
                        comparisons=tuple(comparisons(spec, train_spec, parsed, result)))


def predict(model: ModelLike, cluster: str | ClusterSpec, plan: Plan | dict[str, Any] | None = None, *,
            framework: str = PLANNER, tp: int = 1, pp: int = 1, cp: int = 1, dp: int | None = None, ep: int = 1,
            zero: int | None = None, recompute: str = "none", sp: bool | None = None, mbs: int = 1,
            vpp: int | None = None, schedule: str | None = None, dp_replicate: int = 1, **train: Any) -> PredictAnswer:
    """One plan's estimate: a `Plan` (or its dict, as plan.json holds it), else the degrees
    given here, with the CLI's defaults (zero: the framework's; vpp: the one count the schedule
    allows, else 1; sp: on with TP where the framework has it). Raises UserError for a plan that
    is not valid or that the framework cannot run; a plan that does not fit is answered (`fits` False)."""
    from planner.targets import default_zero_stage, has_sequence_parallel
    spec, train_spec, parsed = build_specs(model, cluster, framework=framework, **train)
    if isinstance(plan, dict):
        plan = Plan.from_dict(plan, "plan")
    if plan is None:
        kind = None if schedule is None else enum_value(Schedule, schedule, "schedule")
        if vpp is None:
            vpp = kind.traits.min_vpp if kind is not None and kind.traits.min_vpp == kind.traits.max_vpp else 1
        plan = build_plan(spec, train_spec, parsed, Choice(
            tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, zero_stage=default_zero_stage(framework, pp) if zero is None else zero,
            recompute=enum_value(Recompute, recompute, "recompute"),
            sequence_parallel=sp if sp is not None or has_sequence_parallel(framework, spec, train_spec, parsed)
            else False, micro_batch_size=mbs, vpp=vpp, schedule=kind, dp_replicate=dp_replicate))
    if problems := check_structure(spec, train_spec, parsed, plan):
        raise UserError("invalid plan: " + "; ".join(problems))
    refuse_unless_runs(framework, spec, train_spec, parsed, plan)
    return PredictAnswer(model=spec, train=train_spec, cluster=parsed, framework=framework, plan=plan,
                         estimate=estimate(spec, train_spec, parsed, plan))


def sweep(model: ModelLike, devices: str | list[str], nodes: list[int], tokens: float, *, gpus_per_node: int = 8,
          gpu_hour_usd: float | list[float] | None = None, deadline_days: float | None = None,
          budget_usd: float | None = None, objective: str = "cost", framework: str = PLANNER, failures: Failures = LLAMA3, time_limit_s: float = 120.0,
          fix: dict[str, Any] | None = None, **train: Any) -> SweepResult:
    """`planner sweep`: the best plan per size and device, days, GPU-hours and cost of training
    `tokens`; `best` is the cheapest size (objective "cost") or the one that ends soonest ("time")
    within `deadline_days` and `budget_usd` (None with `why_none` when none)."""
    from planner.sweep import sweep as run
    names = [devices] if isinstance(devices, str) else list(devices)
    prices = () if gpu_hour_usd is None else tuple(
        [gpu_hour_usd] if isinstance(gpu_hour_usd, (int, float)) else gpu_hour_usd)
    spec = SweepSpec(devices=tuple(names), nodes=tuple(nodes), gpus_per_node=gpus_per_node, tokens=tokens,
                     gpu_hour_usd=prices, deadline_days=deadline_days, budget_usd=budget_usd, objective=objective,
                     framework=framework, failures=failures,
                     time_limit_s=time_limit_s)
    return run(spec, lambda name: build_specs(model, name, framework=framework, **train),
               SearchOptions(fixed=_fixed(fix)))


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidateAnswer:
    rows: list[Any]   # planner.measure.validate.RowResult
    summary: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [r.to_dict() for r in self.rows], "summary": self.summary}


def validate(runs: str | Path | None = None, *, time_limit_s: float = 600.0) -> ValidateAnswer:
    """`planner validate`: predicted against published step times of a runs table (default: the
    shipped calibration table)."""
    from planner.measure.runs_table import default_runs_path
    from planner.measure.validate import validate as run
    rows, summary = run(Path(runs) if runs is not None else default_runs_path(), time_limit_s)
    return ValidateAnswer(rows=rows, summary=summary)
