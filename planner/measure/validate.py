"""`planner validate RUNS.csv`: predicted vs published for measured training runs.

Semantics (profiles/runs/README.md): each row read as the specs it states
(planner.measure.runs_table), priced with the traits of the framework that ran it
(costmodel.frameworks); its empty plan cells filled by the planner's own search with every stated
field fixed (planner.measure.fill); `status` rows with value OOM are right when the plan is
predicted not to fit; errors are signed, (predicted - published) / published.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from costmodel.estimate import Estimate
from costmodel.frameworks import framework_known
from costmodel.groups import rank_budgets_bytes
from costmodel.hardware import DEFAULT_MEMORY_HEADROOM, ClusterSpec, range_problems, resolve_device
from costmodel.inputs import UserError
from costmodel.plan import Plan
from planner.measure.fill import best_plan_for_row
from planner.measure.runs_table import instance_from_notes, metric_step_time_s, read_numbered_runs, row_specs


@dataclass(frozen=True, kw_only=True, slots=True)
class RowResult:
    id: str
    metric: str
    published: float | str
    predicted: float | str
    error_pct: float | None
    fits: bool
    filled: dict[str, Any]
    plan: Plan
    estimate: Estimate
    # the predicted allocator reservation's error against the row's memory_gb, where it states one
    # and every cell that sets memory (None: no figure, or a filled cell that sets it: memory_error_pct)
    memory_error_pct: float | None = None
    # a run that fits the device but not the budget the planner plans with: (the tightest stage's
    # predicted total, its budget) in bytes (past_budget); None within it, or not fitting at all
    past_budget: tuple[float, float] | None = None

    @property
    def published_mfu(self) -> float | None:
        """The MFU the published measurement implies, on the cost model's FLOP convention (the
        predicted MFU scaled by predicted over published speed)."""
        if self.error_pct is None:
            return None
        speed_ratio = 1 + self.error_pct / 100   # predicted / published, as a speed or a time
        return self.estimate.mfu * (speed_ratio if self.metric == "iteration_time_s" else 1 / speed_ratio)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "metric": self.metric, "published": self.published,
                "predicted": self.predicted, "error_pct": self.error_pct, "fits": self.fits,
                "filled": self.filled, "plan": self.plan.to_dict(),
                "step_time_s": self.estimate.step_time_s, "mfu": self.estimate.mfu,
                "published_mfu": self.published_mfu, "memory_error_pct": self.memory_error_pct,
                "past_budget": None if self.past_budget is None else list(self.past_budget)}


ROW_SEARCH_LIMIT_S = 20.0   # a row's search for its unstated fields


def validate_row(row: dict[str, str], time_limit_s: float = ROW_SEARCH_LIMIT_S) -> RowResult:
    model, train, cluster = row_specs(row)
    plan, est, filled = best_plan_for_row(row, model, train, cluster, time_limit_s=time_limit_s)
    metric, raw = row["metric_name"].strip(), row["metric_value"].strip()
    if metric == "status":
        predicted = "fits" if est.fits else "OOM"
        return RowResult(id=row["id"], metric=metric, published=raw, predicted=predicted,
                         error_pct=None, fits=est.fits, filled=filled, plan=plan, estimate=est,
                         past_budget=past_budget(row, cluster, est, plan))
    if metric == "iteration_time_s":
        predicted = est.step_time_s
    elif metric == "tokens_per_sec_per_gpu":
        predicted = est.tokens_per_s / cluster.world_size
    else:
        raise UserError(f"row {row['id']!r}: unknown metric_name {metric!r}")
    published = float(raw)
    return RowResult(id=row["id"], metric=metric, published=published, predicted=predicted,
                     error_pct=100.0 * (predicted - published) / published, fits=est.fits,
                     filled=filled, plan=plan, estimate=est,
                     memory_error_pct=memory_error_pct(row, cluster, est, filled, plan),
                     past_budget=past_budget(row, cluster, est, plan))


def _as_profiled(row: dict[str, str], cluster: ClusterSpec, headroom: float = 0.0) -> ClusterSpec:
    """The row's cluster with its profile's allocator fragmentation, which row_specs sets aside to
    judge the fit at the hard limit, and `headroom`."""
    fragmentation = resolve_device(row["gpu"].strip()).efficiency.allocator_fragmentation
    return replace(cluster, memory_headroom=headroom, device=replace(cluster.device, efficiency=replace(
        cluster.device.efficiency, allocator_fragmentation=fragmentation)))


def as_searched(row: dict[str, str], cluster: ClusterSpec) -> ClusterSpec:
    """The row's cluster (its framework's traits) under the budget a search plans with: the
    default headroom and the profile's allocator fragmentation."""
    return _as_profiled(row, cluster, DEFAULT_MEMORY_HEADROOM)


def past_budget(row: dict[str, str], cluster: ClusterSpec, est: Estimate, plan: Plan) -> tuple[float, float] | None:
    """Where a run fits the device (what validate judges) but a stage's predicted total passes the
    budget the planner plans with (the default headroom, the profile's allocator fragmentation:
    ClusterSpec.memory_budget_bytes), that stage's (total, budget) in bytes, the tightest one's: a
    run at the allocator's edge, whose caching allocator may free and retry (a cost the model does
    not price) and which the search would not emit. None within the budget or past the device.
    Device memory only: an offloading run's host memory has no allocator of this kind."""
    if not est.fits:
        return None
    budgets = rank_budgets_bytes(plan, as_searched(row, cluster))
    over = [(peak / budget, peak, budget) for peak, budget in zip(est.peak_memory_bytes, budgets) if peak > budget]
    return max(over)[1:] if over else None


def memory_error_pct(row: dict[str, str], cluster, est: Estimate, filled: dict[str, Any], plan: Plan) -> float | None:
    """The predicted peak reservation of the fullest stage against the row's memory_gb (GB,
    read as the allocator's peak reservation, max over ranks), (predicted - published) /
    published; None without a figure, or where a filled cell sets the memory (a searched
    micro-batch or recomputation is the planner's plan, not the run's)."""
    stated = (row.get("memory_gb") or "").strip()
    moot = {"vpp"} if plan.pp == 1 else set()   # filled where they change nothing
    moot |= {"sp"} if plan.tp == 1 else set()
    if not stated or set(filled) - moot:
        return None
    tight = max(range(len(est.peak_memory_bytes)), key=est.peak_memory_bytes.__getitem__)
    # Transformer Engine's userbuffers sit outside the allocator with the device's reserve
    predicted = _as_profiled(row, cluster).allocator_reserved_bytes(est.peak_memory_bytes[tight],
                                                                    est.memory_breakdown_bytes[tight]["reserved"])
    return 100.0 * (predicted - float(stated) * 1e9) / (float(stated) * 1e9)


def _step_time(result: RowResult, row: dict[str, str], which: str) -> float:
    return metric_step_time_s(row, float(getattr(result, which)))


def step_time_error_pct(row: dict[str, str], metric_error_pct: float) -> float:
    """`validate`'s error is of the published metric; a throughput's error as one of step time
    (+ predicted too slow): +27.9 % tokens/s is -21.8 % step time."""
    if row["metric_name"].strip() == "iteration_time_s":
        return metric_error_pct
    return 100 * (1 / (1 + metric_error_pct / 100) - 1)


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties), by scipy; None where it is
    undefined (fewer than two rows, or a column of one value)."""
    from scipy.stats import spearmanr
    if len(xs) < 2 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return float(spearmanr(xs, ys).statistic)


def summarize(results: list[RowResult], rows: list[dict[str, str]]) -> dict[str, Any]:
    timed = [(r, row) for r, row in zip(results, rows) if r.error_pct is not None]
    status = [r for r in results if r.error_pct is None]
    errors = [abs(r.error_pct) for r, _ in timed]
    return {
        "n": len(timed),
        "mape_pct": sum(errors) / len(errors) if errors else None,   # None: no timed row (JSON null)
        "max_abs_error_pct": max(errors) if errors else None,
        "spearman": spearman([_step_time(r, row, "predicted") for r, row in timed],
                             [_step_time(r, row, "published") for r, row in timed]),
        "num_status_rows": len(status),
        "num_status_correct": sum(1 for r in status if (r.published == "OOM") == (not r.fits)),
        **_memory_summary(results),
        "past_budget_ids": [r.id for r in results if r.past_budget is not None],
        "profile_problems": profile_range_problems(rows),
        "generic_frameworks": generic_frameworks(rows),
        "networks_from_notes": networks_from_notes(rows),
    }


def networks_from_notes(rows: list[dict[str, str]]) -> dict[str, str]:
    """Row id -> the cloud instance its notes name, for the rows priced over that instance's
    network (runs_table.node_network_gbps): said, since no column states it."""
    return {row["id"]: f"{instance.name}: {instance.node_network_gbps:g} Gbit/s a node"
            for row in rows if (instance := instance_from_notes(row))}


def _memory_summary(results: list[RowResult]) -> dict[str, Any]:
    errors = [r.memory_error_pct for r in results if r.memory_error_pct is not None]
    return {"memory_rows": len(errors),
            "memory_mape_pct": sum(map(abs, errors)) / len(errors) if errors else None,
            "memory_max_abs_error_pct": max(map(abs, errors)) if errors else None,
            "memory_mean_error_pct": sum(errors) / len(errors) if errors else None}


def generic_frameworks(rows: list[dict[str, str]]) -> dict[str, int]:
    """Rows per framework name the model does not know (empty: unstated), which are priced with
    the generic traits (costmodel.frameworks.GENERIC): said, so that nobody reads their errors as
    the framework's."""
    found: dict[str, int] = {}
    for row in rows:
        if not framework_known(name := (row.get("framework") or "").strip()):
            found[name] = found.get(name, 0) + 1
    return found


def profile_range_problems(rows: list[dict[str, str]]) -> list[str]:
    """The fitted efficiencies of the rows' device profiles that lie outside their published
    ranges or at a bound (costmodel.hardware.range_problems): where the fit hides a mechanism."""
    devices = {}
    for row in rows:
        device = resolve_device(row["gpu"].strip())
        devices.setdefault(device.name, device)
    return [p for name in sorted(devices) for p in range_problems(devices[name])]


PROGRESS_EVERY_S = 2.0   # validate's progress: a line at most this often


def validate(path: Path, time_limit_s: float = 600.0,
             progress: Callable[[str], None] | None = None) -> tuple[list[RowResult], dict[str, Any]]:
    """Every row, within `time_limit_s` in all (each row's search gets what is left, at most
    ROW_SEARCH_LIMIT_S), or an UserError saying where it stopped. `progress` hears the row
    reached, at most every PROGRESS_EVERY_S seconds."""
    numbered = read_numbered_runs(path)
    results = []
    start = last = time.perf_counter()
    deadline = start + time_limit_s
    for n, (line, row) in enumerate(numbered, 1):
        if progress and (now := time.perf_counter()) - last >= PROGRESS_EVERY_S:
            progress(f"[{now - start:6.1f} s] row {n:,} of {len(numbered):,} ({row['id']})")
            last = now
        left = deadline - time.perf_counter()
        if left <= 0:
            raise UserError(f"{path}: stopped at --time-limit {time_limit_s:g} s after {len(results)} of "
                             f"{len(numbered)} rows (rows with unstated fields are searched); raise it")
        try:
            results.append(validate_row(row, min(ROW_SEARCH_LIMIT_S, left)))
        except ValueError as exc:
            raise UserError(f"{path} line {line}: {exc}") from None
    return results, summarize(results, [row for _, row in numbered])
