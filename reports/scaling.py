"""The sweep's scaling curve: tokens/s per GPU and cost (or GPU-hours) against GPUs, one line
per device, each device's knee marked, sizes past the deadline or over the budget drawn hollow,
the answer starred (planner.sweep)."""
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
        _hollow_outside(result, rows, speed, money, priced, colour)
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
    if any(result.outside(r) for r in result.rows):   # one legend entry for every device's hollow points
        money.plot([], [], "o", color="grey", markerfacecolor="white", label=f"outside {result.limits()}")
    if result.best is not None:
        best = result.best
        limits = result.limits()
        money.plot([best.num_gpus], [best.cost.cost_usd if priced else best.cost.gpu_hours], "*", markersize=14,
                   color="black", label=("cheapest" if result.objective == "cost" else "ends soonest")
                   + (f" within {limits}" if limits else ""))
    speed.legend(fontsize=8)
    money.legend(fontsize=8)
    fig.suptitle("planner sweep: the best plan at each size")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format=fmt, dpi=130, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _hollow_outside(result, rows, speed, money, priced: bool, colour: str) -> None:
    """White-filled markers over the sizes that miss the deadline or the budget (not answers)."""
    outside = [r for r in rows if result.outside(r)]
    if not outside:
        return
    gpus = [r.num_gpus for r in outside]
    speed.plot(gpus, [r.found.estimate.tokens_per_s / r.num_gpus for r in outside], "o", color=colour,
               markerfacecolor="white")
    money.plot(gpus, [(r.cost.cost_usd if priced else r.cost.gpu_hours) for r in outside], "o", color=colour,
               markerfacecolor="white")
