"""Memory report: per pipeline stage, what the peak is made of against the device capacity, and
how activation memory rises and falls through the simulated step, for the chosen plan and its
runners-up."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from costmodel.estimate import Estimate
from costmodel.pipeline_simulation import Simulation
from costmodel.plan import Plan
from costmodel.units import GIB
from reports.style import MEMORY_COLOURS, plt, save

STATIC = ("params", "grads", "optimizer", "buffers", "reserved")


@dataclass(frozen=True)
class PlanMemory:
    label: str
    plan: Plan
    estimate: Estimate
    sim: Simulation


def memory_table(pm: PlanMemory) -> tuple[list[str], list[list[str]]]:
    keys = list(pm.estimate.memory_breakdown_bytes[0])
    rows = []
    for r, (parts, peak, cap) in enumerate(zip(pm.estimate.memory_breakdown_bytes, pm.estimate.peak_memory_bytes,
                                               pm.estimate.capacity_per_rank_bytes)):
        rows.append([f"stage {r}"] + [f"{parts[k] / GIB:.2f}" for k in keys]
                    + [f"{peak / GIB:.2f}", f"{100 * (cap - peak) / cap:.0f}%"])
    return ["GiB per device"] + keys + ["peak", "headroom"], rows


def memory_figures(plans: list[PlanMemory], out_dir: Path) -> list[tuple[str, str]]:
    fig, axes = plt.subplots(1, len(plans), figsize=(4.2 * len(plans) + 1, 4), squeeze=False, sharey=True)
    for ax, pm in zip(axes[0], plans):
        parts = pm.estimate.memory_breakdown_bytes
        x = range(len(parts))
        bottom = [0.0] * len(parts)
        for key, colour in MEMORY_COLOURS.items():
            values = [p[key] / GIB for p in parts]
            ax.bar(x, values, bottom=bottom, color=colour, label=key, width=0.7)
            bottom = [b + v for b, v in zip(bottom, values)]
        _capacity_lines(ax, pm)
        ax.set_xticks(list(x), [str(r) for r in x], fontsize=7)
        ax.set_xlabel("pipeline stage")
        ax.set_title(f"{pm.label}\n{pm.plan.short()}", fontsize=8, loc="left")
    axes[0, 0].set_ylabel("GiB per device")
    axes[0, -1].legend(fontsize=7, loc="upper right", bbox_to_anchor=(1.0, 0.93))
    fig.tight_layout()
    save(fig, out_dir, "memory_stages")

    fig, axes = plt.subplots(1, len(plans), figsize=(4.2 * len(plans) + 1, 4), squeeze=False, sharey=True)
    for ax, pm in zip(axes[0], plans):
        _curves(ax, pm)
    axes[0, 0].set_ylabel("GiB per device")
    fig.tight_layout()
    save(fig, out_dir, "memory_over_time")
    return [("memory_stages", "Peak memory per device of every pipeline stage, by part, against the "
             "device capacity (dashed): the chosen plan, then the runners-up."),
            ("memory_over_time", "Memory per device through the simulated step, per pipeline stage "
             "(states are constant; activations rise with in-flight micro-batches and fall as "
             "their backward passes run).")]


def _envelope(curve: tuple[tuple[float, float], ...], end_s: float, bins: int = 300) -> tuple[list, list]:
    """Highest level in each time bin: every micro-batch allocates and frees, so the raw step
    curve is a solid band at this scale; its upper envelope shows fill, plateau and drain."""
    top = [0.0] * bins
    points = list(curve)
    for i, (t, level) in enumerate(points):
        until = points[i + 1][0] if i + 1 < len(points) else end_s
        first, last = int(t / end_s * bins), int(until / end_s * bins)
        for b in range(max(first, 0), min(last, bins - 1) + 1):
            top[b] = max(top[b], level)
    return [end_s * (b + 0.5) / bins for b in range(bins)], top


def _capacity_lines(ax, pm: PlanMemory) -> None:
    """The capacity each stage's bar stands against: one line, or on a mixed cluster one per
    stage at its own group's budget."""
    caps = [c / GIB for c in pm.estimate.capacity_per_rank_bytes]
    if len(set(caps)) == 1:
        ax.axhline(caps[0], color="black", linestyle="--", linewidth=1)
        ax.text(len(caps) - 0.5, caps[0], f" capacity {caps[0]:.0f} GiB", va="bottom", ha="right", fontsize=7)
        return
    ax.hlines(caps, [r - 0.45 for r in range(len(caps))], [r + 0.45 for r in range(len(caps))],
              color="black", linestyle="--", linewidth=1)
    ax.text(len(caps) - 0.5, max(caps), " capacity of each stage's group", va="bottom", ha="right", fontsize=7)


def _curves(ax, pm: PlanMemory) -> None:
    p = len(pm.sim.memory_curves)
    shown = sorted({0, p // 2, p - 1}) if p > 8 else range(p)
    cmap = plt.get_cmap("cividis")
    for r in shown:
        static = sum(pm.estimate.memory_breakdown_bytes[r][k] for k in STATIC)
        ts, top = _envelope(pm.sim.memory_curves[r], pm.sim.time_s)
        ax.plot(ts, [(static + b) / GIB for b in top], color=cmap(r / max(p - 1, 1)),
                label=f"stage {r}", linewidth=1.3)
    for cap in sorted({c / GIB for c in pm.estimate.capacity_per_rank_bytes}):
        ax.axhline(cap, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("seconds into the step (upper envelope)")
    ax.set_title(f"{pm.label}\n{pm.plan.short()}", fontsize=8, loc="left")
    ax.legend(fontsize=6, loc="lower center", ncol=4)
