"""Fit device efficiencies on published runs, and judge the fit on runs it never saw.

One parameter set per chip (A100 40/80 GB share one, H100 SXM5 and the 96 GB HBM2e part at
500 W share one; the H200 and B200 profiles borrow H100's), never per row, source or model, each parameter inside the range published
measurements give it (the profile's [ranges]). The objective is the mean squared log error of predicted step time,
with each range as a prior about its centre (PRIOR_WEIGHT). Rows'
unstated fields are filled once by the search (`planner.measure.fill.best_plan_for_row`) with the
profile's current values; the fit then re-prices those plans (closed-form pipeline: every
published schedule has one, and it is what the search reasons with).

`leave_one_source_out` refits without each source in turn and predicts that source's rows: the
error a user should expect on a run of a kind the table does not hold. `leave_scale_out` fits on
the runs below a size (SCALE_OUT_GPUS) and predicts the larger ones: the error at the scale a
planner is used for, from a fit that never saw it.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from costmodel.estimate import estimate
from costmodel.frameworks import attention_speedup
from costmodel.hardware import FITTED_PARAMS, ClusterSpec, resolve_device
from costmodel.hardware.profile_check import bound_at
from costmodel.inputs import UserError
from costmodel.plan import Plan
from costmodel.specs import ModelSpec, TrainSpec

# Each fitted value stays inside the published range its profile gives it ([ranges] in
# profiles/*.toml, every bound with its source; costmodel.hardware.range_problems names a value
# outside or at a bound). Chips without rows of their own borrow another chip's fitted values.
PARAMS = FITTED_PARAMS
# chips without rows of their own are fitted with the bounds of the chip whose values they borrow
# (the A800 and H800 are the A100 and H100 dies with NVLink cut, which their profiles state apart)
BORROWS = {"H200": "H100", "B200": "H100", "GB200": "H100", "B300": "H100", "GB300": "H100", "V100": "A100",
           "A800": "A100", "H800": "H100"}
# of those, the values a chip keeps its own of, published rather than fitted on the other chip's
# rows: Blackwell's attention (FlashAttention-2 untuned for it, cuDNN's forward at about 0.61 of a
# B200's peak and its backward at 0.79 of that: profiles/B200.toml), which the fit prices its rows with
BLACKWELL_ATTENTION = ("attention", "vendor_attention_speedup")
KEEPS = {die: BLACKWELL_ATTENTION for die in ("B200", "GB200", "B300", "GB300")}


def bounds_for(cluster: ClusterSpec) -> dict[str, tuple[float, float]]:
    """The published ranges of the chip's profile, every fitted parameter's."""
    ranges = dict(cluster.device.ranges)
    if missing := [k for k in PARAMS if k not in ranges]:
        raise UserError(f"{cluster.device.path}: [ranges] lacks {', '.join(missing)}: a fit needs a published range "
                        "for every parameter it sets")
    return {k: (ranges[k].low, ranges[k].high) for k in PARAMS}


def chip(cluster: ClusterSpec) -> str:
    """The chip a profile's rows are fitted with: the die its name starts with (H100-SXM5-80GB and
    H100-HBM2e-96GB are one GH100, whose memory, clock under its power limit and network their
    profiles state apart), or the chip whose values it borrows."""
    name = cluster.device.die
    return BORROWS.get(name, name)


def coverage(filled: list["FilledRow"]) -> tuple[int, int, int, str]:
    """What a runs table covers: its measured rows (not status rows), those on 256 or more GPUs,
    those fitted with the H100 chip's values (H100 and the parts that borrow them: `chip`), and
    those parts' dies, named as the table holds them."""
    timed = [r for r in filled if r.row["metric_name"].strip() != "status"]
    hopper = [r for r in timed if chip(r.cluster) == "H100"]
    return (len(timed), sum(r.cluster.world_size >= 256 for r in timed), len(hopper),
            ", ".join(sorted({r.cluster.device.die for r in hopper})))


def gemm_scale(cluster: ClusterSpec) -> float:
    """A borrowing chip's GEMM fraction over the one fitted on its lender's rows: the two chips' best
    matmuls as fractions of their peaks (best_matmul_fraction, the MAMF table), since training's GEMMs
    run at a share of what the chip's best matmul reaches (a GB200 at 1,200 W reaches 0.73 of its
    higher peak where the H100 reaches 0.80); 1 where its die is the lender's or either is unpublished."""
    lender = chip(cluster)
    own = cluster.device.best_matmul_fraction
    theirs = _best_matmul_fraction(lender) if lender != cluster.device.die and own else 0.0
    return own / theirs if theirs else 1.0


@functools.cache
def _best_matmul_fraction(device: str) -> float:
    return resolve_device(device).best_matmul_fraction


@dataclass(frozen=True, kw_only=True, slots=True)
class FilledRow:
    """A published run with its plan chosen once: what the fit re-prices."""

    row: dict[str, str]
    model: ModelSpec
    train: TrainSpec
    cluster: ClusterSpec
    plan: Plan

    @property
    def source(self) -> str:
        return source_group(self.row["source"])

    def log_error(self, values: dict[str, float] | None = None, *, simulate: bool = False) -> float:
        """log(predicted / published step time): positive means predicted too slow."""
        cluster = with_values(self.cluster, values) if values else self.cluster
        est = estimate(self.model, self.train, cluster, self.plan, simulate=simulate)
        published = float(self.row["metric_value"])
        if self.row["metric_name"].strip() == "iteration_time_s":
            return math.log(est.step_time_s / published)
        return -math.log(est.tokens_per_s / cluster.world_size / published)


def source_group(source: str) -> str:
    """The publication a row comes from, whatever table or file of it the row cites: the
    repository (owner/name) or the first author. Rows of one publication share their
    conventions and software, so they are left out together."""
    text = source.strip().removeprefix("https://").removeprefix("github.com/")
    repo = re.match(r"^([\w.-]+/[\w.-]+)", text)
    return repo[1].lower() if repo else text.split()[0].rstrip(",").lower()


def _attention_factor(cluster: ClusterSpec) -> float:
    """The framework's attention kernels against the profile's FlashAttention-2 figure."""
    return attention_speedup(cluster.framework, cluster.device.efficiency.vendor_attention_speedup)


def current_values(cluster: ClusterSpec) -> dict[str, float]:
    dev = cluster.device
    eff = dev.efficiency
    return {"gemm": eff.gemm / gemm_scale(cluster), "attention": eff.attention / _attention_factor(cluster), "memory": eff.memory,
            "comm_contention": eff.comm_contention, "vendor_attention_speedup": eff.vendor_attention_speedup,
            "kernel_overhead_s": eff.kernel_overhead_s, "intra_node_comm": dev.intra_node.efficiency,
            "inter_node_comm": dev.inter_node.efficiency, "step_overhead_s": eff.step_overhead_s}


def with_values(cluster: ClusterSpec, values: dict[str, float]) -> ClusterSpec:
    """The cluster with the chip's fitted `values`, less those its profile keeps (KEEPS)."""
    if kept := KEEPS.get(cluster.device.die):
        values = {**values, **{k: v for k, v in current_values(cluster).items() if k in kept}}
    dev = cluster.device
    speedup = values["vendor_attention_speedup"]
    eff = dataclasses.replace(dev.efficiency, gemm=values["gemm"] * gemm_scale(cluster),
                              attention=values["attention"] * attention_speedup(cluster.framework, speedup),
                              memory=values["memory"], kernel_overhead_s=values["kernel_overhead_s"],
                              comm_contention=values["comm_contention"], vendor_attention_speedup=speedup,
                              step_overhead_s=values["step_overhead_s"])
    dev = dataclasses.replace(dev, efficiency=eff,
                              intra_node=dataclasses.replace(dev.intra_node, efficiency=values["intra_node_comm"]),
                              inter_node=dataclasses.replace(dev.inter_node, efficiency=values["inter_node_comm"]))
    return dataclasses.replace(cluster, device=dev)


def fill_rows(rows: list[dict[str, str]], progress: Callable[[str], None] | None = None) -> list[FilledRow]:
    from planner.measure.validate import best_plan_for_row, row_specs
    out = []
    for i, row in enumerate(rows):
        if row["metric_name"].strip() == "status":
            continue
        model, train, cluster = row_specs(row)
        plan, _, _ = best_plan_for_row(row, model, train, cluster)
        out.append(FilledRow(row=row, model=model, train=train, cluster=cluster, plan=plan))
        if progress:
            progress(f"filled {i + 1}/{len(rows)} rows")
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class _Space:
    """One chip's rows and the parameters they identify, in units of each upper bound."""

    rows: list[FilledRow]
    start: dict[str, float]
    keys: list[str]
    low: np.ndarray    # one entry per key
    high: np.ndarray
    scale: np.ndarray  # each key's upper bound

    def values(self, x) -> dict[str, float]:
        return {**self.start, **{k: float(v * u) for k, v, u in zip(self.keys, x, self.scale)}}

    def point(self, values: dict[str, float]):
        """`values` in the fit's units, clipped into the bounds."""
        return np.clip([values[k] / u for k, u in zip(self.keys, self.scale)], self.low, self.high)


def _space(rows: list[FilledRow], held: frozenset[str] = frozenset(),
           released: frozenset[str] = frozenset()) -> _Space:
    """`held`: parameters kept at the profile's values (one the whole table would pin at a bound,
    held inside its range: scripts/fit_published.py --hold); `released`: ones kept by default,
    fitted on request (--release)."""
    bounds = bounds_for(rows[0].cluster)
    # fused attention is identifiable only from rows that ran it, a vendor kernel's speedup only
    # from rows that called it, and only where the chip has such a kernel (bounds not one value)
    flash = [r for r in rows if r.train.attention_kernel == "flash"]
    identifiable = {"attention": bool(flash),
                    "vendor_attention_speedup": bounds["vendor_attention_speedup"][0] < bounds["vendor_attention_speedup"][1]
                    and any(r.cluster.framework.vendor_attention for r in flash)}
    # the per-kernel host cost keeps the profile's value unless released: few rows move it, the
    # host-bound ones (Hopper's MoE rows at small micro-batches, Qwen3-30B-A3B on 8 B200 at
    # micro-batch 1; the A100's eager Megatron layers at TP 4, Skywork's and FlagPerf's), and the
    # profiles ship what a fit that releases it gives (fit_published.py --release CHIP:kernel_overhead_s:
    # 29.9 us for the H100 chip, 78.5 us for the A100); gpu_check measures it on a lent GPU
    identifiable["kernel_overhead_s"] = "kernel_overhead_s" in released
    keys = [k for k in PARAMS if identifiable.get(k, True) and k not in held]
    return _Space(rows=rows, start=current_values(rows[0].cluster), keys=keys,
                  low=np.array([bounds[k][0] / bounds[k][1] for k in keys]), high=np.ones(len(keys)),
                  scale=np.array([bounds[k][1] for k in keys]))


# The published ranges as prior knowledge (maximum a posteriori): each range one standard deviation
# of a Gaussian about its centre, weighed against the rows, whose log errors scatter by about 6 %.
# Where the rows pull a parameter, they decide, up to a bound; where they barely do (a flat
# direction: with A100's two network efficiencies at opposite bounds or near their ranges'
# centres, the 45 A100 rows' MAPE is 4.1 % either way), the value stays near its range's
# centre instead of drifting to a bound.
PRIOR_WEIGHT = 0.06


def _prior_residuals(space: _Space, x) -> np.ndarray:
    centre, half = (space.low + space.high) / 2, (space.high - space.low) / 2
    return PRIOR_WEIGHT * (x - centre) / half


def fitted_keys(rows: list[FilledRow], held: frozenset[str] = frozenset(),
                released: frozenset[str] = frozenset()) -> list[str]:
    """The parameters one chip's rows identify, which its fit sets (the rest keep their values)."""
    return _space(rows, held, released).keys


def _residuals(space: _Space, x):
    """The rows' log errors, then one prior term per parameter (_prior_residuals)."""
    values = space.values(x)
    return np.concatenate([[r.log_error(values) for r in space.rows], _prior_residuals(space, x)])


def _jacobian(space: _Space, x, r0):
    """Forward differences of the log errors, a step of 1 % of each parameter's range, taken
    toward the inside of the range."""
    columns = []
    for i in range(len(x)):
        h = 0.01 * (space.high[i] - space.low[i])
        h = -h if x[i] + h > space.high[i] else h
        xh = x.copy()
        xh[i] += h
        columns.append((_residuals(space, xh) - r0) / h)
    return np.stack(columns, axis=1)


def _step(jac, r, x, space: _Space):
    """The Gauss-Newton step inside the bounds: least squares of the linearised log errors and
    the prior's terms. A parameter no row's step time depends on is moved by its prior alone,
    toward its range's centre; one with a zero column throughout (none while every fitted key has
    a prior term) keeps its value."""
    from scipy.optimize import lsq_linear
    active = np.abs(jac).max(axis=0) > 1e-9
    dx = np.zeros(len(x))
    if active.any():
        dx[active] = lsq_linear(jac[:, active], -r, bounds=((space.low - x)[active], (space.high - x)[active])).x
    return dx


def fit(rows: list[FilledRow], *, iterations: int = 8, held: frozenset[str] = frozenset(),
        released: frozenset[str] = frozenset()) -> dict[str, float]:
    """Least squares in log step time over the rows of one chip inside the published ranges:
    bounded Gauss-Newton (each step the linearised problem's bounded least squares, halved until
    the mean squared error falls), about ten evaluations of the rows per step."""
    space = _space(rows, held, released)
    x = space.point(space.start)
    r = _residuals(space, x)
    for _ in range(iterations):
        dx = _step(_jacobian(space, x, r), r, x, space)
        for t in (1.0, 0.5, 0.25):
            trial = np.clip(x + t * dx, space.low, space.high)
            rt = _residuals(space, trial)
            if rt @ rt < r @ r:
                break
        else:
            break
        converged = np.max(np.abs(trial - x)) < 1e-3
        x, r = trial, rt
        if converged:
            break
    return space.values(x)


def by_chip(rows: list[FilledRow]) -> dict[str, list[FilledRow]]:
    """The rows grouped by the chip whose one parameter set prices them (chip), in name order."""
    groups: dict[str, list[FilledRow]] = defaultdict(list)
    for r in rows:
        groups[chip(r.cluster)].append(r)
    return dict(sorted(groups.items()))


def fit_by_chip(rows: list[FilledRow]) -> dict[str, dict[str, float]]:
    return {name: fit(group) for name, group in by_chip(rows).items()}


def at_bounds(rows: list[FilledRow], fitted: dict[str, dict[str, float]]) -> list[str]:
    """The fitted values (fit_by_chip) at a bound of their published range, as range_problems
    counts a shipped value at one (bound_at): 'H100 comm_contention = 0.4 at its upper bound 0.4'."""
    clusters = {chip(r.cluster): r.cluster for r in rows}
    out = []
    for name, values in sorted(fitted.items()):
        for key in fitted_keys([r for r in rows if chip(r.cluster) == name]):
            low, high = bounds_for(clusters[name])[key]
            if side := bound_at(values[key], low, high):
                out.append(f"{name} {key} = {values[key]:.4g} at its {side} bound {low if side == 'lower' else high:g}")
    return out


def leave_one_source_out(rows: list[FilledRow], progress: Callable[[str], None] | None = None
                         ) -> list[tuple[FilledRow, float]]:
    """Each source's rows predicted by a fit on every other source's rows of the same chip
    (simulated, as `validate` prices them). The refit is one bounded Gauss-Newton step from the
    whole table's fit, on the Jacobian computed there with the source's rows taken out: the
    exact refit's first step, second-order close to it where the fit moves little. A chip with
    no other source keeps its profile's values for those rows."""
    out = []
    for name, group in by_chip(rows).items():
        space = _space(group)
        x = space.point(fit(group))
        r = _residuals(space, x)
        jac = _jacobian(space, x, r)
        sources = sorted({g.source for g in group})
        for source in sources:
            held = np.array([g.source == source for g in group] + [False] * len(space.keys))
            values = None
            if not held[:len(group)].all():
                values = space.values(np.clip(x + _step(jac[~held], r[~held], x, space), space.low, space.high))
            out += [(g, g.log_error(values, simulate=True)) for g, h in zip(group, held[:len(group)]) if h]
            if progress:
                progress(f"{name}: left out {source[:60]}")
    return out


# where a planner is used most, and where a model fitted on smaller runs must still hold
SCALE_OUT_GPUS = 1024


def leave_scale_out(rows: list[FilledRow], min_gpus: int = SCALE_OUT_GPUS,
                    progress: Callable[[str], None] | None = None) -> list[tuple[FilledRow, float]]:
    """The rows on `min_gpus` or more GPUs predicted by a fit (fit, to convergence) on each chip's
    rows below that size alone (simulated, as `validate` prices them): how the model carries from
    the runs a team can afford to measure to the cluster it plans for. A chip with no row below
    `min_gpus` predicts none of its rows (its profile's values were fitted on them)."""
    out = []
    for name, group in by_chip(rows).items():
        small = [g for g in group if g.cluster.world_size < min_gpus]
        large = [g for g in group if g.cluster.world_size >= min_gpus]
        if not small or not large:
            continue
        if progress:
            progress(f"{name}: fitting the {len(small)} runs below {min_gpus} GPUs")
        values = fit(small)
        out += [(g, g.log_error(values, simulate=True)) for g in large]
    return out


def scale_out_summary(rows: list[FilledRow], min_gpus: int = SCALE_OUT_GPUS,
                      progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """leave_scale_out's rows summarised (summary), with `min_gpus` and the same rows in sample
    (`in_sample`: priced with the values fitted on the whole table)."""
    scaled = leave_scale_out(rows, min_gpus, progress)
    return {**summary([e for _, e in scaled]), "min_gpus": min_gpus,
            "in_sample": summary([r.log_error(simulate=True) for r, _ in scaled])}


def summary(errors: list[float]) -> dict[str, Any]:
    """MAPE, max |error| and mean signed error of step time, in percent, from log errors (+ predicted
    too slow)."""
    signed = [100 * (math.exp(e) - 1) for e in errors]
    pct = [abs(e) for e in signed]
    return {"n": len(pct), "mape_pct": sum(pct) / len(pct), "max_abs_error_pct": max(pct),
            "mean_error_pct": sum(signed) / len(signed)}
