"""Ranking report: every feasible candidate the search priced (step time against peak memory,
Pareto front marked), and the chosen plan's time ledger."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from costmodel.estimate import Estimate
from costmodel.units import GIB
from reports.style import BLUE, GREY, VERMILLION, plt, save

ZOOM = 1.6   # the scatter shows plans up to 1.6x the best time: the choice is made there


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of points no other point beats on both time and memory, by increasing time."""
    order = sorted(range(len(points)), key=lambda i: points[i])
    front, best_mem = [], float("inf")
    for i in order:
        if points[i][1] < best_mem:
            front.append(i)
            best_mem = points[i][1]
    return front


def ranking_figure(estimates: Sequence[Estimate], top: Sequence[Estimate], out_dir: Path) -> tuple[str, str]:
    points = [(e.step_time_s, e.max_peak_memory_bytes / GIB) for e in estimates]
    front = pareto_front(points)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.scatter([p[0] for p in points], [p[1] for p in points], s=10, color=GREY, alpha=0.5,
               label=f"feasible candidates ({len(points)})")
    ax.plot([points[i][0] for i in front], [points[i][1] for i in front], "-o", color=BLUE, markersize=4,
            label="Pareto front (faster or smaller than all others)")
    for k, e in enumerate(top, 1):   # ties sit on one point: fan the labels out
        ax.annotate(f"#{k}", (e.step_time_s, e.max_peak_memory_bytes / GIB), fontsize=7, color=VERMILLION,
                    xytext=(6 + 14 * (k - 1), -12), textcoords="offset points",
                    arrowprops=dict(arrowstyle="-", color=VERMILLION, linewidth=0.5))
    best = top[0]
    ax.scatter([best.step_time_s], [best.max_peak_memory_bytes / GIB], marker="*", s=160, color=VERMILLION,
               label="chosen", zorder=3)
    ax.axhline(best.memory_capacity_bytes / GIB, color="black", linestyle="--", linewidth=1)
    right = ZOOM * best.step_time_s
    off_scale = sum(1 for t, _ in points if t > right)
    ax.set_xlim(0.98 * best.step_time_s, right)
    ax.set_xlabel(f"predicted step time (s); {off_scale} slower candidates beyond the right edge"
                  if off_scale else "predicted step time (s)")
    ax.set_ylabel("peak memory per device (GiB)")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    save(fig, out_dir, "ranking_scatter")
    return ("ranking_scatter", "Every feasible plan the search solved: step time against peak memory per "
            "device (closed-form pipeline; the best ones re-priced by simulation); the numbers are the top "
            "plans of the table, the dashed line the capacity.")


def ledger_figure(est: Estimate, out_dir: Path) -> tuple[str, str]:
    items = [(k, v) for k, v in est.time_breakdown_s.items() if v > 0]
    fig, ax = plt.subplots(figsize=(7, 0.6 + 0.3 * len(items)))
    ax.barh([k for k, _ in items], [v for _, v in items], color=BLUE)
    for y, (_, v) in enumerate(items):
        ax.text(v, y, f" {v:.3f} s ({100 * v / est.step_time_s:.1f}%)", va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per step (critical rank)")
    ax.set_xlim(0, 1.3 * max(v for _, v in items))
    fig.tight_layout()
    save(fig, out_dir, "ledger")
    return ("ledger", "Where the chosen plan's step time goes, on its critical pipeline rank (the items "
            "sum to the step time).")
