"""measured.json: what a run measured, in the Estimate's field names, beside the prediction.

Throughput and MFU come from the measured step time and the cost model's FLOP count (one
formula, one place): tokens/s = tokens per step / step time; MFU = model FLOPs per step /
(step time x world size x the profile's peak for the compute dtype).
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Any

from costmodel.estimate import Estimate, estimate
from costmodel.flops import model_flops_per_step, utilization
from costmodel.frameworks import COMPILED_RUNTIME
from costmodel.groups import world_peak_flops_per_s
from costmodel.hardware import run_by
from costmodel.inputs import UserError
from costmodel.measured import MeasuredRun, finite_or_none, part_error, shown_loss, shown_mfu
from costmodel.plan import PlanFile
from costmodel.units import MIB


def priced_as_run(pf: PlanFile, compiled: bool) -> PlanFile:
    """The plan file as `planner run` ran it: under --compile its cluster as the runtime with
    compiled layers drives it (costmodel.frameworks `compiled_layer`)."""
    if not compiled:
        return pf
    if pf.cluster.groups:
        raise UserError("--compile: a mixed cluster is priced for the eager runtime only; run it without --compile")
    return replace(pf, cluster=run_by(pf.cluster, COMPILED_RUNTIME))


def run_record(pf: PlanFile, raw: dict[str, Any], *, wall_s: float, compiled: bool,
               oversubscribed: bool = False) -> MeasuredRun:
    """measured.json of a run whose rank 0 wrote `raw` (runtime.worker), as the plan ran
    (priced_as_run): what `planner run` writes after its local ranks end, and a printed launch's
    rank 0 for itself. A resumed run measures the steps it ran."""
    timed = len(raw["step_times_s"])
    return measured_record(priced_as_run(pf, compiled), raw, steps=timed, warmup=len(raw["losses"]) - timed,
                           wall_s=wall_s, oversubscribed=oversubscribed, compiled=compiled)


def error_pct(measured: float | None, predicted: float) -> float | None:
    if measured is None or abs(predicted) < 1e-12:   # ~0 predicted: no relative error
        return None
    return 100.0 * (measured - predicted) / predicted


def predicted_tensor_peaks_bytes(est: Estimate) -> list[float]:
    """Each stage's predicted peak as a run measures it. Both measurements count tensors only
    (CPU: runtime.memtrack; CUDA: max_memory_allocated, which leaves out the CUDA context and the
    allocator's cache), so the prediction is compared less its reserve, the part outside them."""
    reserve = est.memory_breakdown_bytes[0]["reserved"]
    return [p - reserve for p in est.peak_memory_bytes]


def _diverged(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """runtime.health's record of a diverged run, its non-finite values as null."""
    if record is None:
        return None
    return {k: finite_or_none(v) if isinstance(v, float) else v for k, v in record.items()}


def measured_record(pf: PlanFile, raw: dict[str, Any], *, steps: int, warmup: int,
                    wall_s: float, complete: bool = True, oversubscribed: bool = False,
                    compiled: bool = False) -> MeasuredRun:
    est: Estimate = estimate(pf.model, pf.train, pf.cluster, pf.plan)
    step_s = statistics.median(raw["step_times_s"])
    # over every device's peak together, as costmodel.estimate takes it (a mixed cluster's differ)
    mfu = utilization(model_flops_per_step(pf.model, pf.train), step_s, 1,
                      world_peak_flops_per_s(pf.cluster, pf.train.compute_dtype))
    peak = raw["peak_memory_bytes"]
    predicted_peak = predicted_tensor_peaks_bytes(est)
    measured_parts, predicted_parts = _stage_parts(pf, est, raw, step_s)
    return MeasuredRun(**{
        "stage_breakdown_s": measured_parts,
        "predicted_stage_breakdown_s": predicted_parts,
        "step_time_s": step_s,
        "tokens_per_s": pf.train.tokens_per_step / step_s,
        "mfu": mfu,
        "peak_memory_bytes": peak,
        "peak_reserved_bytes": raw.get("peak_reserved_bytes"),   # CUDA only: allocated + allocator cache
        "rank_forward_s": raw.get("rank_forward_s"),
        "checkpoint_wait_s": raw.get("checkpoint_wait_s"),
        "grad_norms": None if raw.get("grad_norms") is None else [finite_or_none(x) for x in raw["grad_norms"]],
        "diverged": _diverged(raw.get("diverged")),
        "losses": [finite_or_none(x) for x in raw["losses"]],
        "step_times_s": raw["step_times_s"],
        "predicted": est.to_dict(),
        "error_pct": {
            "step_time_s": error_pct(step_s, est.step_time_s),
            "tokens_per_s": error_pct(pf.train.tokens_per_step / step_s, est.tokens_per_s),
            "mfu": error_pct(mfu, est.mfu),
            "peak_memory_bytes": (None if peak is None else
                                  [error_pct(m, p) for m, p in zip(peak, predicted_peak)]),
            "stage_breakdown_s": (None if measured_parts is None else
                                  {k: [error_pct(a, b) for a, b in zip(measured_parts[k], predicted_parts[k])]
                                   for k in measured_parts}),
        },
        "memory_source": raw["memory_source"],
        "predicted_memory_compared_bytes": predicted_peak,
        "device": raw["device"],
        "world_size": pf.plan.world_size,
        "steps": steps,
        "warmup_steps": warmup,
        "wall_s": wall_s,
        "plan": pf.plan.to_dict(),
        "model": pf.model.name,
        "cluster": pf.cluster.name,
        "complete": complete,
        "oversubscribed": oversubscribed,
        "compiled": compiled,   # `planner run --compile`; pf is then priced so (priced_as_run)
    })


PARTS = {"work": "work (compute + TP/CP)", "dp_sync": "DP gradient sync", "optimizer": "optimizer",
         "wait": "wait (bubble, PP transfer, host)"}


def part_labels(pp: int) -> dict[str, str]:
    """PARTS as a plan times them: without a pipeline the DP reduction runs inside the backward
    pass (its time in the work); with one, after the pipeline (with a one-rank FSDP group's)."""
    if pp == 1:
        return {**PARTS, "work": "work (compute + TP/CP + DP sync)", "dp_sync": "DP sync after backward"}
    return {**PARTS, "dp_sync": "DP sync after pipeline"}


def _stage_parts(pf: PlanFile, est: Estimate, raw: dict[str, Any], step_s: float):
    """Per pipeline stage, the step split as the runtime times it, measured and predicted:
    the stage's own work, the data-parallel reduction after the pipeline, the optimizer step
    (with its zero_grad, which sets the gradients to None: microseconds), and the rest (waiting
    in the bubble, point-to-point transfers, the step's own host work: the ledger's host/step,
    which the runtime does not time apart). Without a pipeline FSDP
    reduces gradients inside the backward pass, so the prediction's DP time joins the work; FSDP2's
    copy-outs run inside the passes either way (Estimate.rank_work_s holds them)."""
    work = raw.get("stage_busy_s")
    if work is None:
        return None, None
    sync, optim = raw["stage_dp_sync_s"], raw["stage_optimizer_s"]
    measured = {"work": work, "dp_sync": sync, "optimizer": optim,
                "wait": [step_s - w - d - o for w, d, o in zip(work, sync, optim)]}
    ledger = est.time_breakdown_s
    dp = ledger["comm/dp_exposed"] + ledger["comm/embedding_sync"] + ledger.get("comm/tp_replica_sync", 0.0)
    inside = pf.plan.pp == 1
    pred_work = [w + (dp if inside else 0.0) for w in est.rank_work_s]
    # a pipeline's once-a-step reduce on a one-rank FSDP group is timed as its DP sync too
    pred_sync = [0.0 if inside else dp + r for r in est.rank_fsdp_reduce_s]
    pred_optim = [ledger["optimizer/step"]] * pf.plan.pp
    predicted = {"work": pred_work, "dp_sync": pred_sync, "optimizer": pred_optim,
                 "wait": [est.step_time_s - w - d - o for w, d, o in zip(pred_work, pred_sync, pred_optim)]}
    return measured, predicted


def straggler_row(rank_forward_s: list[float]) -> tuple[str, str, str, str]:
    """The slowest rank's own layer forwards per step against the ranks' median (a straggler shows)."""
    slowest = max(range(len(rank_forward_s)), key=rank_forward_s.__getitem__)
    median = statistics.median(rank_forward_s)
    spread = f"{100 * (rank_forward_s[slowest] / median - 1):+.1f}% vs median" if median > 0 else "-"
    return (f"slowest rank's layer forwards (rank {slowest})", f"{median * 1e3:,.1f} ms (median)",
            f"{rank_forward_s[slowest] * 1e3:,.1f} ms", spread)


def steps_row(step_times_s: list[float]) -> tuple[str, str, str, str]:
    """The timed steps' range beside the median: an error smaller than their scatter is the
    machine's noise, not the model's (on a shared 2-core CPU the steps of one run can lie 5-40 % apart)."""
    fastest, slowest = min(step_times_s), max(step_times_s)
    return (f"  {len(step_times_s)} timed steps, fastest - slowest", "-",
            f"{fastest * 1e3:,.1f} - {slowest * 1e3:,.1f} ms", f"{100 * (slowest / fastest - 1):.0f}% apart")


def comparison_rows(m: MeasuredRun) -> list[tuple[str, str, str, str]]:
    """(quantity, predicted, measured, error) for the end-of-run table."""
    est, err = m.predicted, m.error_pct

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:+.1f}%"

    rows = [("step time", f"{est['step_time_s'] * 1e3:,.1f} ms", f"{m.step_time_s * 1e3:,.1f} ms",
             pct(err["step_time_s"])),
            *([steps_row(m.step_times_s)] if len(m.step_times_s) > 1 else []),
            ("tokens/s", f"{est['tokens_per_s']:,.0f}", f"{m.tokens_per_s:,.0f}", pct(err["tokens_per_s"])),
            ("MFU", f"{100 * est['mfu']:.1f}%", shown_mfu(m.mfu), pct(err["mfu"]))]
    parts, predicted = m.stage_breakdown_s, m.predicted_stage_breakdown_s
    for stage in range(len(parts["work"]) if parts else 0):
        for key, label in part_labels(m.plan.get("pp", 1)).items():
            p, q = predicted[key][stage], parts[key][stage]
            rows.append((f"stage {stage} {label}", f"{p * 1e3:,.1f} ms", f"{q * 1e3:,.1f} ms",
                         part_error(p, q, err["stage_breakdown_s"][key][stage], est["step_time_s"])))
    peak = m.peak_memory_bytes
    for stage, predicted in enumerate(m.predicted_memory_compared_bytes):
        measured = "-" if peak is None else f"{peak[stage] / MIB:,.1f} MiB"
        rows.append((f"peak memory, stage {stage}", f"{predicted / MIB:,.1f} MiB", measured,
                     pct(None if peak is None else err["peak_memory_bytes"][stage])))
    if m.rank_forward_s and len(m.rank_forward_s) > 1:
        rows.append(straggler_row(m.rank_forward_s))
    losses = m.losses
    rows.append(("loss (first -> last step)", "-", f"{shown_loss(losses[0])} -> {shown_loss(losses[-1])}", "-"))
    return rows
