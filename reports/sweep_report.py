"""`planner sweep --report DIR`: the sweep as a report directory: index.html (the interactive
page, reports.html: the scaling curve with hover, the sizes sortable), index.md, and the scaling
picture as PNG and SVG (reports.scaling)."""
from __future__ import annotations

from pathlib import Path

from reports.document import Document
from reports.html import page
from reports.page_data import sweep_page_data
from reports.scaling import draw_scaling


def write_sweep_report(result, out_dir: Path) -> list[str]:
    """Write the files into `out_dir` (planner.outputs.staged_dir publishes them); returns their names."""
    doc = Document("planner sweep: the best plan at each size")
    doc.text(_answer(result))
    if result.knees:
        doc.text("Knee of each device's curve (its largest size that keeps the smallest size's throughput per "
                 "GPU within the knee's efficiency): " + ", ".join(f"{d} at {g:,} GPUs" for d, g in result.knees.items())
                 + ".")
    limited = bool(result.limits())
    doc.table(["device", "GPUs", "plan", "step s", "tokens/s per GPU", "MFU %", "days", "GPU-hours", "cost $"]
              + (["within limits"] if limited else []),
              [_row(r.to_dict()) + ([result.outside(r) or "yes"] if limited else []) for r in result.rows])
    for fmt in ("png", "svg"):
        (out_dir / f"scaling.{fmt}").write_bytes(draw_scaling(result, fmt))
    doc.image("scaling", "Tokens/s per GPU and the run's cost (or GPU-hours) against GPUs, one line per device, "
                         "each device's knee marked, the sizes outside the limits hollow, the answer starred.")
    (out_dir / "index.md").write_text(doc.markdown() + "\n")
    (out_dir / "index.html").write_text(page(sweep_page_data(result), doc.html()) + "\n")
    return sorted(p.name for p in out_dir.iterdir())


def _answer(result) -> str:
    if result.best is None:
        return f"No size answers: {result.why_none}"
    b = result.best.to_dict()
    cost = "" if b["cost_usd"] is None else f", ${b['cost_usd']:,.0f}"
    within = f" within {result.limits()}" if result.limits() else ""
    return (f"Answer (objective {result.objective}{within}): {b['num_gpus']:,} x {b['device']}, "
            f"plan {b['plan_label']}, "
            f"{b['days']:,.1f} days, {b['gpu_hours']:,.0f} GPU-hours{cost}.")


def _row(d: dict) -> list[str]:
    if d["plan"] is None:
        return [d["device"], f"{d['num_gpus']:,}", d["reason"] or "-", "-", "-", "-", "-", "-", "-"]
    shown = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
    return [d["device"], f"{d['num_gpus']:,}", d["plan_label"], f"{d['step_time_s']:.3f}",
            f"{d['tokens_per_s_per_gpu']:,.0f}", f"{100 * d['mfu']:.1f}", shown(d["days"], ",.1f"),
            shown(d["gpu_hours"], ",.0f"), shown(d["cost_usd"], ",.0f")]
