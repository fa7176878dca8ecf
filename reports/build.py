"""Write a report directory: figures (PNG + SVG), index.md and index.html with captions that say
where the time goes, what limits the plan and what would change it."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from costmodel.estimate import Estimate, simulate_plan
from costmodel.groups import placement_lines, representative, short_device_name
from costmodel.hardware import ClusterSpec
from costmodel.measured import MeasuredRun, part_error, shown_loss, shown_mfu
from costmodel.memory import cp_gathered_kv_bytes, expert_state_bytes
from costmodel.params import expert_dp, folds_ep
from costmodel.pipeline_closed_form import uniform_1f1b_bubble_fraction
from costmodel.plan import Plan
from costmodel.rank_time import spans
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.units import GIB, MIB
from reports.bubble import Variant, bubble_figures, schedule_table
from reports.document import Document
from reports.html import page
from reports.measured import measured_figure
from reports.memory_report import PlanMemory, memory_figures, memory_table
from reports.page_data import plan_page_data
from reports.ranking import ledger_figure, ranking_figure
from reports.tables import slowest_share


@dataclass
class ReportInput:
    model: ModelSpec
    train: TrainSpec
    cluster: ClusterSpec
    plan: Plan
    estimate: Estimate
    variants: list[Variant]   # the plan under each schedule, chosen first (planner.report_plans)
    runners_up: list[tuple[Plan, Estimate]] = field(default_factory=list)   # search only
    candidates: list[Estimate] = field(default_factory=list)                # search only
    runner_up_text: str = ""
    measured: MeasuredRun | None = None


def write_report(inp: ReportInput, out_dir: Path, map_draws: Callable[[Callable, list], list] | None = None) -> list[str]:
    """Returns the files written (relative to out_dir). `map_draws`: how the figures are drawn
    (Document.draw_figures: one after another unless it maps them over processes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = Document(f"Plan report: {inp.model.name} on {inp.cluster.name}")
    _summary(doc, inp)
    _where_time_goes(doc, inp, out_dir)
    variants = inp.variants
    _bubble(doc, inp, variants, out_dir)
    _memory(doc, inp, variants, out_dir)
    if inp.candidates:
        _ranking(doc, inp, out_dir)
    if inp.measured:
        _measured(doc, inp.measured)
        doc.figures(lambda: [measured_figure(inp.measured, out_dir)])
    _what_would_change_it(doc, inp, variants)
    doc.draw_figures(map_draws)
    (out_dir / "index.md").write_text(doc.markdown() + "\n")
    (out_dir / "index.html").write_text(page(plan_page_data(inp, variants), doc.html()) + "\n")
    return sorted(p.name for p in out_dir.iterdir())


def _summary(doc: Document, inp: ReportInput) -> None:
    e, p, t = inp.estimate, inp.plan, inp.train
    doc.text(f"Plan {p.short()} for {inp.model.name} ({t.seq_len} tokens x {t.global_batch_size} "
             f"sequences per step, {t.compute_dtype}) on {_devices(inp.cluster)}: "
             f"{e.step_time_s:.3f} s per step, {e.tokens_per_s:,.0f} tokens/s, MFU {100 * e.mfu:.1f}%, "
             f"peak {e.peak_memory_bytes[e.tightest_rank] / GIB:.1f} of "
             f"{e.capacity_per_rank_bytes[e.tightest_rank] / GIB:.0f} GiB per device"
             + (f", optimizer states offloaded: {max(e.host_memory_bytes) / GIB:,.1f} GiB of host memory per device "
                f"(of {e.host_capacity_bytes / GIB:,.0f}), stepped on the host" if p.offload_optimizer else "") + ". "
             f"Layers per virtual stage {list(p.layers_per_stage)}, recomputed layers per pipeline rank "
             f"{list(p.recompute_num_layers)} ({p.recompute}), mesh {' > '.join(p.mesh_axis_order)}.")
    lines = placement_lines(p, inp.cluster, t.global_batch_size)
    if lines and e.group_shares:
        doc.text("Replicas on the device groups (no pipeline: each data-parallel replica runs on one group with "
                 "its group's micro-batch size, the same number of micro-batches everywhere; the step is set by "
                 "the slowest group):")
    elif lines:
        doc.text("Placement on the device groups (each pipeline stage runs on one group; the layer split follows "
                 "each group's speed and memory, and the step is set by the slowest rank):")
    for line in lines:
        doc.text(line[0].upper() + line[1:] + ".")
    if lines:
        doc.table(*(_share_table(inp) if e.group_shares else _stage_table(inp)))


def _share_table(inp: ReportInput) -> tuple[list[str], list[list[str]]]:
    """Each group's replicas, share, step and memory: the slowest sets the step."""
    shares = inp.estimate.group_shares
    slowest = slowest_share(inp.estimate)
    rows = [[short_device_name(inp.cluster, s["group"]) + (" (slowest)" if s is slowest else ""), str(s["replicas"]),
             str(s["micro_batch_size"]), f"{s['samples']:,}", f"{s['step_time_s']:.3f}",
             f"{s['peak_memory_bytes'] / GIB:.1f} of {s['capacity_bytes'] / GIB:.1f}"] for s in shares]
    return ["group", "replicas", "micro-batch", "sequences per step", "step s", "peak GiB"], rows


def _stage_table(inp: ReportInput) -> tuple[list[str], list[list[str]]]:
    """Each pipeline rank's group, layers, time per micro-batch and memory: the slowest sets the step."""
    e, p = inp.estimate, inp.plan
    times = e.rank_time_per_micro_batch_s
    slowest = max(range(len(times)), key=times.__getitem__)
    rows = [[f"{r}" + (" (slowest)" if r == slowest else ""), short_device_name(inp.cluster, g),
             str(p.layers_on_rank(r)), f"{1e3 * times[r]:.1f}",
             f"{e.peak_memory_bytes[r] / GIB:.1f} of {e.capacity_per_rank_bytes[r] / GIB:.1f}"]
            for r, g in enumerate(e.rank_groups)]
    return ["pipeline rank", "device", "layers", "ms per micro-batch", "peak GiB"], rows


def _devices(cluster: ClusterSpec) -> str:
    if cluster.is_mixed:
        return f"{cluster.world_size} devices in {len(cluster.groups)} groups ({cluster.name})"
    return f"{cluster.world_size} x {cluster.device.name}"


def _where_time_goes(doc: Document, inp: ReportInput, out_dir: Path) -> None:
    e = inp.estimate
    doc.heading("Where the time goes")
    items = sorted(((v, k) for k, v in e.time_breakdown_s.items() if v > 0), reverse=True)
    top = ", ".join(f"{k} {100 * v / e.step_time_s:.0f}%" for v, k in items[:3])
    doc.text(f"On the critical pipeline rank ({e.critical_rank}) the step is {top} of its "
             f"{e.step_time_s:.3f} s; compute is {100 * _share(e, 'compute/'):.0f}%, exposed communication "
             f"{100 * _share(e, 'comm/'):.0f}%, the bubble {100 * e.bubble_fraction:.1f}%.")
    doc.table(["ledger item", "seconds", "% of step"],
              [[k, f"{v:.4f}", f"{100 * v / e.step_time_s:.1f}"] for k, v in e.time_breakdown_s.items() if v]
              + [["total", f"{e.step_time_s:.4f}", "100.0"]])
    doc.figures(lambda: [ledger_figure(e, out_dir)])


def _share(e: Estimate, prefix: str) -> float:
    return sum(v for k, v in e.time_breakdown_s.items() if k.startswith(prefix)) / e.step_time_s


def _bubble(doc: Document, inp: ReportInput, variants, out_dir: Path) -> None:
    doc.heading("Bubble report: the pipeline schedule")
    p, m = inp.plan.pp, inp.plan.num_micro_batches
    if p == 1:
        doc.text("No pipeline (pp = 1): micro-batches accumulate gradients one after another and no "
                 "rank waits for another, so there is no bubble.")
    else:
        e = inp.estimate
        doc.text(f"{p} pipeline ranks, {m} micro-batches per step. The bubble is a rank's idle time in the "
                 f"pipeline phase as a share of the step; the plan's is its critical rank's "
                 f"(rank {e.critical_rank}, the one the ledger adds up): {100 * e.bubble_fraction:.1f}%. "
                 f"For scale, the textbook fill of 1F1B on uniform stages idles each rank (p-1)/(m+p-1) = "
                 f"{100 * uniform_1f1b_bubble_fraction(p, m):.1f}% of the pipeline phase (not of the step); "
                 f"the simulation, with the real stage costs (embedding on the first stage, the LM head on "
                 f"the last) and torch's operation order, gives the figures below.")
    doc.table(*schedule_table(variants))
    if p > 1:
        doc.figures(lambda: bubble_figures(variants, out_dir))


def _memory(doc: Document, inp: ReportInput, variants, out_dir: Path) -> None:
    doc.heading("Memory report")
    # the whole step with its memory curves (a variant's `sim` may be the lean one without them)
    plans = [PlanMemory(label=label, plan=p, estimate=e,
                        sim=simulate_plan(inp.model, *representative(inp.train, inp.cluster, p), keep_events=True))
             for label, (p, e) in zip(["#1 (chosen)", "#2", "#3"],
                                      [(inp.plan, inp.estimate)] + list(inp.runners_up[:2]))]
    e = inp.estimate
    tight = e.tightest_rank
    parts = e.memory_breakdown_bytes[tight]
    doc.text(f"The fullest stage is {tight}: {e.peak_memory_bytes[tight] / GIB:.1f} of "
             f"{e.capacity_per_rank_bytes[tight] / GIB:.0f} GiB, of which activations {parts['activations'] / GIB:.1f} GiB "
             f"(peak of the simulated in-flight micro-batches), optimizer states {parts['optimizer'] / GIB:.1f}, "
             f"weights {parts['params'] / GIB:.1f}, gradients {parts['grads'] / GIB:.1f} GiB.")
    for line in _parallel_memory_notes(inp, tight):
        doc.text(line)
    doc.table(*memory_table(plans[0]))
    doc.figures(lambda: memory_figures(plans, out_dir))


def _parallel_memory_notes(inp: ReportInput, rank: int) -> list[str]:
    """What expert and context parallelism put in a stage's memory parts."""
    model, train, plan, traits = inp.model, inp.train, inp.plan, inp.cluster.framework
    lines = []
    if model.is_moe:
        experts = expert_state_bytes(model, train, plan, rank, traits)
        folded = folds_ep(plan, traits)
        tp = (f"; whole on each of the tp={plan.tp} ranks, which route their own sequence shards"
              if plan.tp > 1 and not folded else "")
        tp += "; the expert-parallel group folded over the TP, CP and DP ranks" if folded and plan.tp * plan.cp > 1 else ""
        lines.append(f"Routed experts: {experts / GIB:.1f} GiB of stage {rank}'s weights, gradients and optimizer "
                     f"states ({model.num_experts // plan.ep} of {model.num_experts} experts per layer on each "
                     f"device with ep={plan.ep}{f', each split over etp={plan.etp} ranks' if plan.etp > 1 else ''}, "
                     f"ZeRO-{plan.zero_stage} over {expert_dp(plan, traits)} devices holding "
                     f"the same ones{tp}).")
    kv = cp_gathered_kv_bytes(model, train, plan, traits)
    if kv:
        lines.append(f"Context parallelism (cp={plan.cp}): each layer that is not fully recomputed keeps the K "
                     f"and V gathered from the other CP ranks for its backward, {kv / MIB:.1f} MiB per micro-batch, "
                     f"part of the activations (a fully recomputed layer holds them during its backward only).")
    return lines


def _ranking(doc: Document, inp: ReportInput, out_dir: Path) -> None:
    doc.heading("Ranking")
    rows = [[str(i), p.short(), f"{e.step_time_s:.3f}", f"{e.tokens_per_s:,.0f}", f"{100 * e.mfu:.1f}",
             f"{e.max_peak_memory_bytes / GIB:.1f}", f"{100 * e.bubble_fraction:.1f}"]
            for i, (p, e) in enumerate([(inp.plan, inp.estimate)] + inp.runners_up, 1)]
    doc.table(["#", "plan", "step s", "tokens/s", "MFU %", "peak GiB", "bubble %"], rows)
    if inp.runner_up_text:
        doc.text(inp.runner_up_text)
    doc.figures(lambda: [ranking_figure(inp.candidates, [inp.estimate] + [e for _, e in inp.runners_up], out_dir)])


def _measured(doc: Document, m: MeasuredRun) -> None:
    doc.heading("Predicted and measured")
    est, err = m.predicted, m.error_pct
    pct = lambda v: "-" if v is None else f"{v:+.1f}%"  # noqa: E731
    rows = [["step time (s)", f"{est['step_time_s']:.4f}", f"{m.step_time_s:.4f}", pct(err["step_time_s"])],
            ["tokens/s", f"{est['tokens_per_s']:,.0f}", f"{m.tokens_per_s:,.0f}", pct(err["tokens_per_s"])],
            ["MFU", f"{100 * est['mfu']:.2f}%", shown_mfu(m.mfu, 2), pct(err["mfu"])]]
    for r, pred in enumerate(m.predicted_memory_compared_bytes):
        meas = m.peak_memory_bytes[r] if m.peak_memory_bytes else None
        rows.append([f"peak memory stage {r} (MiB)", f"{pred / MIB:,.1f}",
                     "-" if meas is None else f"{meas / MIB:,.1f}",
                     pct(err["peak_memory_bytes"][r] if err["peak_memory_bytes"] else None)])
    parts, predicted = m.stage_breakdown_s, m.predicted_stage_breakdown_s
    for stage in range(len(parts["work"]) if parts else 0):
        for key in ("work", "dp_sync", "optimizer", "wait"):
            rows.append([f"stage {stage} {key} (s)", f"{predicted[key][stage]:.4f}", f"{parts[key][stage]:.4f}",
                         part_error(predicted[key][stage], parts[key][stage], err["stage_breakdown_s"][key][stage],
                                    est["step_time_s"])])
    doc.table(["quantity", "predicted", "measured", "measured vs predicted"], rows)
    if not m.complete:   # the steps before the signal: fewer, and warm-up's effects weigh more
        cause = f"it diverged at step {m.diverged['step']}" if m.diverged else "it was interrupted"
        doc.text(f"An incomplete run: {cause}; these are the {m.steps} timed steps measured before.")
    doc.text(f"Measured on {m.device} over {m.steps} steps after {m.warmup_steps} warm-up; memory: "
             f"{m.memory_source}. Losses {shown_loss(m.losses[0])} -> {shown_loss(m.losses[-1])}. Per stage: its own "
             f"work (compute and TP/CP collectives), the DP gradient reduction after the pipeline (inside the "
             f"backward pass when there is no pipeline), the optimizer, and the wait (bubble and PP transfers).")


_GROUP_OF = {"comm/tp_exposed": "tp", "comm/cp_exposed": "cp", "comm/ep_exposed": "ep", "comm/pp_exposed": "pp",
             "comm/dp_exposed": "dp"}


def _comm_remedy(inp: ReportInput, worst: str) -> str:
    """What would shrink the exposed communication `worst`: a group that spans nodes could be
    placed inside one; one already inside a node needs a smaller degree (or a faster link)."""
    axis = _GROUP_OF.get(worst)
    if axis is None or inp.cluster.is_mixed:
        return "a faster link for that group"
    if getattr(spans(inp.plan, inp.cluster), axis).crosses_nodes:
        return "a faster link for that group or a placement that keeps it inside a node"
    return f"its group already lies inside a node: a smaller {axis.upper()} degree or a faster link"


def _what_would_change_it(doc: Document, inp: ReportInput, variants) -> None:
    doc.heading("What limits it, and what would change it")
    e, p = inp.estimate, inp.plan
    notes = []
    bubble = e.bubble_fraction
    if p.pp > 1 and bubble > 0.02:
        better = [v for v in variants[1:] if v.estimate is not None and v.estimate.step_time_s < e.step_time_s]
        tip = f"; {better[0].label} would take {better[0].estimate.step_time_s:.3f} s" if better else ""
        notes.append(f"The bubble is {100 * bubble:.1f}% of the step: more micro-batches per step "
                     f"(a smaller micro-batch or a larger global batch), more virtual stages, or a "
                     f"zero-bubble schedule shrink it{tip}.")
    headroom = e.min_headroom_fraction
    if headroom < 0.1:
        room = "more devices per model replica (TP or PP)" + (" or a higher ZeRO stage" if p.zero_stage < 3
                                                               and p.dp * p.cp > 1 else "")
        notes.append(f"Memory binds ({100 * headroom:.0f}% headroom): a larger micro-batch or less "
                     f"recomputation would not fit; {room} would free room.")
    comm = _share(e, "comm/")
    if comm > 0.1:
        worst = max((k for k in e.time_breakdown_s if k.startswith("comm/")), key=e.time_breakdown_s.get)
        notes.append(f"Exposed communication is {100 * comm:.0f}% of the step, mostly {worst}: "
                     f"{_comm_remedy(inp, worst)} would help.")
    if e.time_breakdown_s["compute/recompute"] > 0.02 * e.step_time_s:
        notes.append(f"Recomputation costs {100 * e.time_breakdown_s['compute/recompute'] / e.step_time_s:.0f}% "
                     f"of the step, the price of fitting in memory.")
    if not notes:
        notes.append("Compute dominates and the pipeline, communication and memory leave little to win: "
                     "a faster device or more of them is what would change it.")
    for n in notes:
        doc.text(n)
