"""`planner sweep`: the best plan at each cluster size and device, and what training takes there.

Each size is searched as `planner search` searches one cluster (proven optimal under the cost
model unless the sweep's time runs out), then priced for the run: days to train the tokens
with the checkpoint and failure overhead of costmodel.resilience, GPU-hours and cost
(costmodel.training_cost). The answer is, among the sizes within the deadline and the budget,
the cheapest (objective "cost": by cost with a price, else by GPU-hours) or the one that ends
soonest (objective "time"), fewer GPUs on a tie; the scaling curve's knee is the largest size
that keeps KNEE_EFFICIENCY of the smallest size's throughput per GPU, per device.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from costmodel.hardware import ClusterSpec
from costmodel.inputs import UserError
from costmodel.resilience import LLAMA3, Failures, checkpoint_cost
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.training_cost import TrainingCost, training_cost
from planner.no_plan import no_plan_reason
from planner.search import Found, SearchOptions, search
from planner.targets import PLANNER, options_for

KNEE_EFFICIENCY = 0.9   # per-GPU throughput kept, against the device's smallest size, at the knee


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepRow:
    device: str
    num_nodes: int
    gpus_per_node: int
    found: Found | None   # the best plan, None when none fits or the time ran out
    proven: bool          # the search proved it optimal under the cost model
    reason: str           # why there is no plan ("" with one)
    cost: TrainingCost | None
    scaling_efficiency: float | None = None   # tokens/s per GPU over the device's smallest size's

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    def to_dict(self) -> dict[str, Any]:
        est = None if self.found is None else self.found.estimate
        cost = self.cost
        return {"num_gpus": self.num_gpus, "num_nodes": self.num_nodes, "gpus_per_node": self.gpus_per_node,
                "device": self.device, "plan": None if self.found is None else self.found.plan.to_dict(),
                "plan_label": None if self.found is None else self.found.plan.short(),
                # a size without a plan has no optimum to prove: its reason says whether none fits
                "proven_optimal": None if self.found is None else self.proven, "reason": self.reason or None,
                "step_time_s": None if est is None else est.step_time_s,
                "tokens_per_s": None if est is None else est.tokens_per_s,
                "tokens_per_s_per_gpu": None if est is None else est.tokens_per_s / self.num_gpus,
                "mfu": None if est is None else est.mfu,
                "peak_memory_gib": None if est is None else est.max_peak_memory_bytes / 2**30,
                "scaling_efficiency": self.scaling_efficiency,
                "effective_tokens_per_s": None if cost is None else cost.effective_tokens_per_s,
                "days": None if cost is None else cost.days, "gpu_hours": None if cost is None else cost.gpu_hours,
                "cost_usd": None if cost is None else cost.cost_usd}


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepResult:
    rows: tuple[SweepRow, ...]
    best: SweepRow | None          # the objective's answer within the deadline and budget
    knees: dict[str, int]          # device -> GPUs at its knee
    deadline_days: float | None
    why_none: str                  # when best is None: why
    wall_s: float
    objective: str = "cost"
    budget_usd: float | None = None

    def limits(self) -> str:
        """The deadline and budget the answer keeps, as a summary says them ("" without either)."""
        return " and ".join(([] if self.deadline_days is None else [f"{self.deadline_days:g} days"])
                            + ([] if self.budget_usd is None else [f"${self.budget_usd:,.0f}"]))

    def outside(self, row: SweepRow) -> str:
        """Why a priced size is not an answer under the deadline or budget ("" when it is one)."""
        if row.cost is None:
            return ""
        if self.deadline_days is not None and row.cost.days > self.deadline_days:
            return f"past the {self.deadline_days:g}-day deadline"
        if self.budget_usd is not None and (row.cost.cost_usd or 0.0) > self.budget_usd:
            return f"over the ${self.budget_usd:,.0f} budget"
        return ""

    def to_dict(self) -> dict[str, Any]:
        rows = [{**r.to_dict(), "outside_limits": self.outside(r) or None} for r in self.rows]
        return {"rows": rows, "best": None if self.best is None else self.best.to_dict(),
                "knee_gpus": self.knees, "knee_efficiency": KNEE_EFFICIENCY, "deadline_days": self.deadline_days,
                "objective": self.objective, "budget_usd": self.budget_usd,
                "why_none": self.why_none or None, "wall_s": self.wall_s}


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepSpec:
    """What a sweep asks: sizes per device, tokens, prices (one, or one per device)."""

    devices: tuple[str, ...]
    nodes: tuple[int, ...]
    gpus_per_node: int = 8
    tokens: float
    gpu_hour_usd: tuple[float, ...] = ()
    deadline_days: float | None = None
    budget_usd: float | None = None
    objective: str = "cost"   # cost: the cheapest size within the limits; time: the one that ends soonest
    framework: str = PLANNER
    failures: Failures = LLAMA3
    time_limit_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.devices or not self.nodes:
            raise UserError("a sweep needs at least one device and one node count (--device, --nodes)")
        if len(set(self.devices)) != len(self.devices):
            raise UserError(f"--device {','.join(self.devices)}: give each device once")
        if mixed := next((d for d in self.devices if "+" in d), None):
            raise UserError(f"--device {mixed}: a sweep sizes clusters of one device each; list devices with "
                            "commas (A100,H100), or search a mixed cluster with planner search --cluster")
        if len(set(self.nodes)) != len(self.nodes) or any(n < 1 for n in self.nodes):
            raise UserError(f"--nodes {','.join(map(str, self.nodes))}: give each node count once, each >= 1")
        if len(self.gpu_hour_usd) not in (0, 1, len(self.devices)):
            raise UserError(f"--gpu-hour-usd gives {len(self.gpu_hour_usd)} prices for {len(self.devices)} devices: "
                            "give one, or one per device in the order of --device")
        if any(not (math.isfinite(p) and p >= 0) for p in self.gpu_hour_usd):
            raise UserError("--gpu-hour-usd: a price is a number of zero or more")
        if self.deadline_days is not None and not self.deadline_days > 0:
            raise UserError(f"--deadline-days {self.deadline_days}: must be positive")
        if self.objective not in ("cost", "time"):
            raise UserError(f"a sweep's objective is cost or time, not {self.objective!r}")
        if self.budget_usd is not None and not (self.gpu_hour_usd and self.budget_usd > 0):
            raise UserError("--budget-usd limits the cost of the run: give --gpu-hour-usd, and a positive budget")

    def price(self, device_index: int) -> float | None:
        if not self.gpu_hour_usd:
            return None
        return self.gpu_hour_usd[0] if len(self.gpu_hour_usd) == 1 else self.gpu_hour_usd[device_index]


Specs = Callable[[str], tuple[ModelSpec, TrainSpec, ClusterSpec]]   # cluster name -> the specs there


def sweep(spec: SweepSpec, specs: Specs, options: SearchOptions = SearchOptions(),
          progress: Callable[[str], None] | None = None) -> SweepResult:
    """Every (device, node count), smallest first; the whole sweep within spec.time_limit_s."""
    start = time.perf_counter()
    deadline = start + spec.time_limit_s
    rows: list[SweepRow] = []
    for d, device in enumerate(spec.devices):
        for nodes in sorted(spec.nodes):
            name = f"{nodes}x{spec.gpus_per_node}x{device}"
            model, train, cluster = specs(name)
            left = deadline - time.perf_counter()
            if left <= 0:
                rows.append(SweepRow(device=cluster.device.name, num_nodes=nodes, gpus_per_node=spec.gpus_per_node,
                                     found=None, proven=False, reason="not searched: the sweep's time limit was spent",
                                     cost=None))
                continue
            row = _row(spec, model, train, cluster, options, left, spec.price(d))
            rows.append(row)
            if progress:
                progress(f"[{time.perf_counter() - start:6.1f} s] {_progress_text(row, name)}")
    rows = _with_scaling(rows)
    best, why = _best(rows, spec)
    knees = _knees(rows)
    return SweepResult(rows=tuple(rows), best=best, knees=knees, deadline_days=spec.deadline_days, why_none=why,
                       wall_s=time.perf_counter() - start, objective=spec.objective, budget_usd=spec.budget_usd)


def _row(spec: SweepSpec, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions,
         left_s: float, price: float | None) -> SweepRow:
    narrowed = options_for(spec.framework, model, train, cluster, replace(options, time_limit_s=left_s, top_k=1))
    result = search(model, train, cluster, narrowed)
    common = dict(device=cluster.device.name, num_nodes=cluster.num_nodes, gpus_per_node=cluster.devices_per_node)
    if not result.plans:
        reason = ("no plan found within the sweep's time limit" if not result.stats.optimal
                  else no_plan_reason(model, train, cluster, narrowed, result))
        return SweepRow(**common, found=None, proven=result.stats.optimal, reason=reason, cost=None)
    best = result.plans[0]
    est = best.estimate
    kept = checkpoint_cost(model, train, cluster.world_size, est.step_time_s, est.tokens_per_s, spec.failures)
    cost = training_cost(spec.tokens, cluster.world_size, kept.effective_tokens_per_s, price)
    return SweepRow(**common, found=best, proven=result.stats.optimal, reason="", cost=cost)


def _progress_text(row: SweepRow, name: str) -> str:
    if row.found is None:
        return f"{name}: {row.reason}"
    assert row.cost is not None
    return (f"{name}: {row.found.plan.short()}, {row.found.estimate.step_time_s:.3f} s per step, "
            f"{row.cost.days:,.1f} days")


def _with_scaling(rows: list[SweepRow]) -> list[SweepRow]:
    out = []
    for row in rows:
        base = next((r for r in rows if r.device == row.device and r.found is not None), None)
        if row.found is None or base is None or base.found is None:
            out.append(row)
            continue
        per_gpu = row.found.estimate.tokens_per_s / row.num_gpus
        out.append(replace(row, scaling_efficiency=per_gpu / (base.found.estimate.tokens_per_s / base.num_gpus)))
    return out


def _knees(rows: list[SweepRow]) -> dict[str, int]:
    knees: dict[str, int] = {}
    for row in rows:
        if row.scaling_efficiency is not None and row.scaling_efficiency >= KNEE_EFFICIENCY - 1e-12:
            knees[row.device] = max(knees.get(row.device, 0), row.num_gpus)
    return knees


def _best(rows: list[SweepRow], spec: SweepSpec) -> tuple[SweepRow | None, str]:
    priced = [r for r in rows if r.cost is not None and math.isfinite(r.cost.days)]
    if not priced:
        if any("time limit" in r.reason for r in rows):
            return None, "no size was solved within the sweep's time limit; raise --time-limit"
        largest = max(rows, key=lambda r: r.num_gpus)
        return None, f"no size has a plan that fits; at the largest, {largest.num_gpus:,} {largest.device}: {largest.reason}"
    deadline_days, budget = spec.deadline_days, spec.budget_usd
    meets = [r for r in priced if deadline_days is None or r.cost.days <= deadline_days]
    if not meets:
        closest = min(priced, key=lambda r: r.cost.days)
        return None, (f"no size meets the deadline of {deadline_days:g} days; the closest is {closest.num_gpus:,} "
                      f"{closest.device} at {closest.cost.days:,.1f} days ({closest.found.plan.short()}); "
                      "more nodes, or a later deadline")
    affordable = [r for r in meets if budget is None or r.cost.cost_usd <= budget]
    if not affordable:
        cheapest = min(meets, key=lambda r: r.cost.cost_usd)
        return None, (f"no size{'' if deadline_days is None else f' within {deadline_days:g} days'} costs at most "
                      f"${budget:,.0f}; the cheapest is {cheapest.num_gpus:,} {cheapest.device} at "
                      f"${cheapest.cost.cost_usd:,.0f}; a larger budget or a later deadline")

    def key(r: SweepRow) -> tuple:
        money = r.cost.cost_usd if r.cost.cost_usd is not None else r.cost.gpu_hours
        return (r.cost.days, money, r.num_gpus) if spec.objective == "time" else (money, r.num_gpus)
    return min(affordable, key=key), ""
