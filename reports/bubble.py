"""Bubble report: the simulated timeline of the chosen plan, and of the same plan under every
other pipeline schedule, with the bubble per pipeline rank and the step time.

The bubble is one figure everywhere: a rank's idle time in the pipeline phase as a share of the
step, the plan's being its critical rank's (costmodel.estimate.Estimate.bubble_fraction)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from matplotlib.patches import Patch

from costmodel.estimate import Estimate
from costmodel.pipeline_simulation import Simulation
from costmodel.plan import Plan
from costmodel.units import GIB
from reports.style import KIND_COLOURS, LIGHT, plt, save

MAX_LABELLED_BARS = 600   # beyond this, micro-batch numbers would be unreadable


@dataclass(frozen=True)
class Variant:
    label: str
    plan: Plan | None
    reason: str = ""                  # why this schedule cannot run the plan
    estimate: Estimate | None = None
    sim: Simulation | None = None      # the whole step: the table's figures
    timeline: Simulation | None = None  # what is drawn when fewer micro-batches are (None: sim)

    @property
    def drawn(self) -> Simulation | None:
        return self.timeline or self.sim

    @property
    def drawn_label(self) -> str:
        if self.timeline is None or self.plan is None:
            return self.label
        shown = len({e[3] for e in self.timeline.events if e[2] == "forward"})
        return f"{self.label} (drawn: the first {shown} of {self.plan.num_micro_batches} micro-batches)"


def schedule_table(variants: list[Variant]) -> tuple[list[str], list[list[str]]]:
    headers = ["schedule", "step s", "pipeline s", "bubble % of step", "bubble % of step per rank",
               "peak GiB per rank", "fits"]
    rows = []
    for v in variants:
        if v.plan is None:
            rows.append([v.label, "-", "-", "-", "not runnable: " + v.reason, "-", "-"])
            continue
        e, s = v.estimate, v.sim
        rows.append([v.label, f"{e.step_time_s:.3f}", f"{s.time_s:.3f}", f"{100 * e.bubble_fraction:.1f}",
                     " ".join(f"{100 * b:.1f}" for b in e.bubble_fraction_per_rank),
                     " ".join(f"{p / GIB:.1f}" for p in e.peak_memory_bytes), "yes" if e.fits else "NO"])
    return headers, rows


def _draw(ax, sim: Simulation, title: str, t_max: float, labels: bool) -> None:
    p = len(sim.busy_s)
    for r in range(p):
        ax.broken_barh([(0, sim.time_s)], (r - 0.4, 0.8), facecolors=LIGHT, rasterized=True)
    by_kind: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for r, _, kind, _, start, end in sim.events:
        by_kind.setdefault((r, kind), []).append((start, end - start))
    for (r, kind), bars in by_kind.items():
        # thousands of bars: rasterised inside the SVG (text and axes stay vector)
        ax.broken_barh(bars, (r - 0.4, 0.8), facecolors=KIND_COLOURS[kind], linewidth=0, rasterized=True)
    if labels:
        visible = [e for e in sim.events if e[2] != "send" and e[4] < t_max]
        wide = [e for e in visible if (e[5] - e[4]) > 0.012 * t_max]
        for r, _, kind, mb, start, end in wide[:MAX_LABELLED_BARS]:
            ax.text((start + min(end, t_max)) / 2, r, str(mb), ha="center", va="center", fontsize=6,
                    color="white" if kind in ("forward", "backward", "recompute") else "black")
    ax.set_xlim(0, t_max)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p), [f"rank {r}" for r in range(p)], fontsize=7)
    ax.set_title(title, fontsize=9, loc="left")


def _figures(v: Variant) -> str:
    """The whole step's figures (those of the table), whatever part of it is drawn."""
    return f"step {v.estimate.step_time_s:.3f} s, bubble {100 * v.estimate.bubble_fraction:.1f}% of the step"


def _legend(fig) -> None:
    fig.legend(handles=[Patch(color=c, label=k) for k, c in KIND_COLOURS.items()], loc="lower center",
               ncol=len(KIND_COLOURS), fontsize=8, frameon=False)


def bubble_figures(variants: list[Variant], out_dir: Path) -> list[tuple[str, str]]:
    """(file stem, caption) of the timeline comparison and of the chosen plan's warm-up detail."""
    runnable = [v for v in variants if v.drawn is not None]
    t_max = max(v.drawn.time_s for v in runnable)
    fig, axes = plt.subplots(len(runnable), 1, figsize=(12, 0.9 + 0.32 * len(runnable[0].drawn.busy_s) * len(runnable)),
                             sharex=True, squeeze=False)
    for ax, v in zip(axes[:, 0], runnable):
        _draw(ax, v.drawn, f"{v.drawn_label}: {_figures(v)}", t_max, labels=len(v.drawn.events) < 400)
    axes[-1, 0].set_xlabel("seconds into the step (pipeline phase)")
    _legend(fig)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    save(fig, out_dir, "bubble_schedules")
    chosen = runnable[0]
    first_backward = min(e[4] for e in chosen.drawn.events if e[0] == 0 and e[2] != "forward" and e[2] != "send")
    window = min(chosen.drawn.time_s, 1.25 * max(first_backward, 1e-12))
    fig, ax = plt.subplots(figsize=(12, 0.9 + 0.32 * len(chosen.drawn.busy_s)))
    _draw(ax, chosen.drawn, f"{chosen.drawn_label}: warm-up, the first {window:.3f} s (numbers: micro-batch); "
          f"{_figures(chosen)}",
          window, labels=True)
    ax.set_xlabel("seconds into the step")
    _legend(fig)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    save(fig, out_dir, "bubble_warmup")
    return [("bubble_schedules", "Simulated timeline of one step's pipeline phase per rank, the chosen "
             "schedule first and the same plan under the other schedules below it (same time axis; "
             "grey is idle). Each panel draws every micro-batch unless its title names the ones it draws; "
             "the step and bubble in its title are the whole step's, as in the table."),
            ("bubble_warmup", "The chosen plan's warm-up in detail, micro-batch numbers on the bars: "
             "the fill that the bubble is made of.")]
