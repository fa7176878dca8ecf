"""The data of the interactive report page (reports.html) as one JSON-ready dict: the figures the
cost model computed, in its own units (seconds, bytes); the page converts them to ms and GiB only
to show them. Nothing here derives a number."""
from __future__ import annotations

from typing import Any

from costmodel.estimate import Estimate
from costmodel.pipeline_simulation import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RECOMPUTE, SEND
from reports.style import KIND_COLOURS, MEMORY_COLOURS

KINDS = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, RECOMPUTE, SEND)
BUBBLE_DEFINITION = ("bubble: a pipeline rank's idle time in the pipeline phase as a share of the step; "
                     "the plan's is its critical rank's (the rank the time ledger adds up)")


def plan_page_data(inp, variants) -> dict[str, Any]:
    """What the page shows of one plan report (reports.build.ReportInput and its schedule variants)."""
    e = inp.estimate
    return {
        "title": f"Plan report: {inp.model.name} on {inp.cluster.name}",
        "summary": {"plan": inp.plan.short(), "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s,
                    "mfu": e.mfu, "bubble_fraction": e.bubble_fraction, "critical_rank": e.critical_rank,
                    "peak_memory_bytes": e.peak_memory_bytes[e.tightest_rank],
                    "capacity_bytes": e.capacity_per_rank_bytes[e.tightest_rank]},
        "bubble_definition": BUBBLE_DEFINITION,
        "ranking": _ranking(inp),
        "kinds": {k: KIND_COLOURS[k] for k in KINDS + ("idle",)},   # events' kinds index it; idle last
        "timelines": [_timeline(v) for v in variants if v.drawn is not None],
        "memory": _memory(e),
        "memory_colours": MEMORY_COLOURS,
        "sweep": None,
    }


def _ranking(inp) -> list[dict[str, Any]]:
    """The chosen plan first, then the search's runners-up (none for `planner report`)."""
    return [_ranked(i, p.short(), e) for i, (p, e) in enumerate([(inp.plan, inp.estimate)] + inp.runners_up, 1)]


def _ranked(rank: int, label: str, e: Estimate) -> dict[str, Any]:
    return {"rank": rank, "plan": label, "step_time_s": e.step_time_s, "tokens_per_s": e.tokens_per_s,
            "mfu": e.mfu, "peak_memory_bytes": e.max_peak_memory_bytes, "bubble_fraction": e.bubble_fraction,
            "fits": e.fits}


def _timeline(v) -> dict[str, Any]:
    """One schedule's simulated events as [rank, stage, kind index, micro-batch, start_s, end_s]."""
    sim, e = v.drawn, v.estimate
    index = {k: i for i, k in enumerate(KINDS)}
    return {"label": v.drawn_label, "step_time_s": e.step_time_s, "bubble_fraction": e.bubble_fraction,
            "bubble_fraction_per_rank": e.bubble_fraction_per_rank, "drawn_time_s": sim.time_s,
            "num_ranks": len(sim.busy_s), "drawn_micro_batches": len({ev[3] for ev in sim.events}),
            "num_micro_batches": v.plan.num_micro_batches,
            # to the nanosecond: what a page can show, at a third of the characters
            "events": [[r, stage, index[kind], mb, round(start, 9), round(end, 9)]
                       for r, stage, kind, mb, start, end in sim.events]}


def _memory(e: Estimate) -> list[dict[str, Any]]:
    return [{"stage": r, "parts_bytes": parts, "peak_bytes": peak, "capacity_bytes": cap}
            for r, (parts, peak, cap) in enumerate(zip(e.memory_breakdown_bytes, e.peak_memory_bytes,
                                                       e.capacity_per_rank_bytes))]


def sweep_page_data(result) -> dict[str, Any]:
    """What the page shows of a sweep (planner.sweep.SweepResult): its rows and each device's knee."""
    whole = result.to_dict()   # the rows as --json prints them, each marked if outside the limits
    rows, best = whole["rows"], whole["best"]
    return {"title": "planner sweep: the best plan at each size", "summary": None, "bubble_definition": None,
            "ranking": [], "kinds": {}, "timelines": [], "memory": [], "memory_colours": {},
            "sweep": {"rows": rows, "knees": result.knees, "best": best,
                      "deadline_days": result.deadline_days, "budget_usd": result.budget_usd,
                      "objective": result.objective}}
