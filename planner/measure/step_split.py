"""What a micro-batch costs and what a step adds once, measured against predicted.

Rows of one source and software release that run the same model and layout on the same device
and framework, and differ only in how many micro-batches m a step runs (a cluster grown with the
global batch held, or the batch grown on one cluster), have a step time affine in m: t = a·m + b, where a is
a micro-batch's work on the critical rank and b what the step adds once (the pipeline's fill and
drain, the exposed data-parallel synchronisation, the optimizer, the host's step). A
least-squares line through the family's measured times and one through its predicted times
separate an error in a (the kernels, the per-micro-batch communication) from an error in b,
which a fit of efficiencies to step times cannot. b is the same each step, so its share of the
step grows with the cluster, which runs fewer micro-batches a rank: a model right on average and
wrong in b is wrong in the direction of scale.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from planner.measure.validate import RowResult, step_time_error_pct

# the cells, beside the run's source (less the system it names: one submission's clusters) and the
# resolved plan, that make two rows one workload
_WORKLOAD = ("framework", "arch", "layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab",
             "seq_len", "gpu", "gpus_per_node", "precision")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSplit:
    """One family's lines through (m, step time): a seconds per micro-batch, b seconds per step."""

    label: str
    row_ids: tuple[str, ...]
    micro_batches: tuple[int, ...]
    measured_per_micro_batch_s: float
    measured_per_step_s: float
    predicted_per_micro_batch_s: float
    predicted_per_step_s: float

    @property
    def per_micro_batch_error_pct(self) -> float:
        """+: the model prices a micro-batch too slow."""
        return 100 * (self.predicted_per_micro_batch_s / self.measured_per_micro_batch_s - 1)

    @property
    def per_step_error_s(self) -> float:
        """+: the model adds too much once a step."""
        return self.predicted_per_step_s - self.measured_per_step_s


def _plan_key(result: RowResult) -> tuple:
    """The resolved plan less its micro-batch count and data-parallel degree (what a family varies)."""
    p = result.plan
    return (p.tp, p.pp, p.vpp, p.cp, p.ep, p.etp, p.sequence_parallel, p.zero_stage, str(p.recompute),
            p.micro_batch_size, str(p.schedule), p.fp8_linears)


def _software(source: str) -> str:
    """A row's source less the system it ran on (MLPerf's `, system ...`): one round, submitter
    and software release, whose clusters of different sizes make one family; a version or tag
    the source names keeps releases apart."""
    return source.split(", system ")[0].strip()


def _label(row: dict[str, str], result: RowResult) -> str:
    p = result.plan
    return (f"{_software(row['source'])[:64]}: {row['layers']}x{row['hidden']} {row['gpu']} {row['framework']} "
            f"tp{p.tp} pp{p.pp}x{p.vpp} cp{p.cp} mbs{p.micro_batch_size} z{p.zero_stage} {row['precision']}")


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares t = a·m + b through (m, t)."""
    ms = np.array([m for m, _ in points], dtype=float)
    a, b = np.linalg.lstsq(np.stack([ms, np.ones_like(ms)], axis=1), np.array([t for _, t in points]), rcond=None)[0]
    return float(a), float(b)


def step_splits(rows: list[dict[str, str]], results: list[RowResult]) -> list[StepSplit]:
    """The families of measured rows (validated as `results`) that run at two or more
    micro-batch counts, each with its measured and predicted lines."""
    families: dict[tuple, list[tuple[dict[str, str], RowResult]]] = defaultdict(list)
    for row, result in zip(rows, results):
        if result.error_pct is None:
            continue
        key = (_software(row["source"]), *(row[k].strip() for k in _WORKLOAD), _plan_key(result))
        families[key].append((row, result))
    out = []
    for members in families.values():
        counts = [r.plan.num_micro_batches for _, r in members]
        if len(set(counts)) < 2:
            continue
        predicted = [r.estimate.step_time_s for _, r in members]
        measured = [t / (1 + step_time_error_pct(row, r.error_pct) / 100) for (row, r), t in zip(members, predicted)]
        (ma, mb), (pa, pb) = _line(list(zip(counts, measured))), _line(list(zip(counts, predicted)))
        out.append(StepSplit(label=_label(*members[0]), row_ids=tuple(r.id for _, r in members),
                             micro_batches=tuple(sorted(set(counts))), measured_per_micro_batch_s=ma,
                             measured_per_step_s=mb, predicted_per_micro_batch_s=pa, predicted_per_step_s=pb))
    return out
