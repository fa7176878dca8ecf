"""Predicted beside measured (from `planner run`'s measured.json), as a picture."""
from __future__ import annotations

from pathlib import Path

from costmodel.measured import MeasuredRun
from costmodel.units import MIB
from reports.style import BLUE, VERMILLION, plt, save


def measured_figure(m: MeasuredRun, out_dir: Path) -> tuple[str, str]:
    est = m.predicted
    predicted_mem = m.predicted_memory_compared_bytes
    measured_mem = m.peak_memory_bytes or [0.0] * len(predicted_mem)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw={"width_ratios": [1, 2]})
    ax_t.bar([0, 1], [1e3 * est["step_time_s"], 1e3 * m.step_time_s], color=[BLUE, VERMILLION])
    ax_t.set_xticks([0, 1], ["predicted", "measured"])
    ax_t.set_ylabel("step time (ms)")
    stages = range(len(predicted_mem))
    ax_m.bar([s - 0.2 for s in stages], [b / MIB for b in predicted_mem], width=0.4, color=BLUE, label="predicted")
    ax_m.bar([s + 0.2 for s in stages], [b / MIB for b in measured_mem], width=0.4, color=VERMILLION,
             label="measured")
    ax_m.set_xticks(list(stages), [f"stage {s}" for s in stages])
    ax_m.set_ylabel("peak memory per device (MiB)")
    ax_m.legend(fontsize=8)
    fig.tight_layout()
    save(fig, out_dir, "measured")
    return ("measured", f"Predicted (blue) and measured (vermillion) step time and peak memory per stage; "
            f"memory measured as {m.memory_source}.")
