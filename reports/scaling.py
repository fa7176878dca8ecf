"""The sweep's scaling curve: tokens/s per GPU and cost (or GPU-hours) against GPUs, one line
per device, each device's knee marked (planner.sweep)."""
from __future__ import annotations

import io

from reports.style import BLUE, GREEN, ORANGE, PINK, SKY, VERMILLION, plt

COLOURS = (BLUE, VERMILLION, GREEN, ORANGE, PINK, SKY)


def draw_scaling(result, fmt: str) -> bytes:
    """The picture as a `fmt` ("png" or "svg") file's bytes (planner.outputs.write_file writes it)."""
    fig, (speed, money) = plt.subplots(1, 2, figsize=(10, 4))
    priced = any(r.cost is not None and r.cost.cost_usd is not None for r in result.rows)
    devices = list(dict.fromkeys(r.device for r in result.rows))
    for colour, device in zip(COLOURS * len(devices), devices):
        rows = [r for r in result.rows if r.device == device and r.found is not None and r.cost is not None]
        if not rows:
            continue
        gpus = [r.num_gpus for r in rows]
        speed.plot(gpus, [r.found.estimate.tokens_per_s / r.num_gpus for r in rows], "o-", color=colour, label=device)
        money.plot(gpus, [(r.cost.cost_usd if priced else r.cost.gpu_hours) for r in rows], "o-", color=colour,
                   label=device)
        knee = result.knees.get(device)
        for r in rows:
            if r.num_gpus == knee:
                speed.axvline(knee, color=colour, linestyle=":", linewidth=1)
                speed.annotate(f"knee {knee:,}", (knee, r.found.estimate.tokens_per_s / knee),
                               textcoords="offset points", xytext=(4, 6), fontsize=8, color=colour)
    for ax in (speed, money):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("GPUs")
        ax.grid(True, alpha=0.3)
    speed.set_ylabel("tokens/s per GPU (predicted)")
    money.set_ylabel("cost of the run, USD" if priced else "GPU-hours of the run")
    if result.best is not None:
        best = result.best
        money.plot([best.num_gpus], [best.cost.cost_usd if priced else best.cost.gpu_hours], "*", markersize=14,
                   color="black", label="cheapest" + ("" if result.deadline_days is None
                                                      else f" within {result.deadline_days:g} days"))
    speed.legend(fontsize=8)
    money.legend(fontsize=8)
    fig.suptitle("planner sweep: the best plan at each size")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()
