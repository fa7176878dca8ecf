"""Figure conventions: the Okabe-Ito colour-blind-safe palette, one meaning per colour across
every picture, and every figure written as PNG (to look at) and SVG (to paste into a doc)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")   # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402

# Okabe & Ito (2008), "Color Universal Design": distinguishable under the common colour blindnesses.
BLUE, ORANGE, SKY, GREEN, YELLOW, NAVY, VERMILLION, PINK = (
    "#0072B2", "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#00467A", "#D55E00", "#CC79A7")
GREY, LIGHT = "#7F7F7F", "#E8E8E8"

KIND_COLOURS = {   # timeline operations (costmodel.pipeline_simulation kinds)
    "forward": BLUE, "backward": VERMILLION, "backward-input": ORANGE, "backward-weight": GREEN,
    "recompute": PINK, "send": SKY, "idle": LIGHT,
}
MEMORY_COLOURS = {   # memory ledger parts (costmodel.memory.StageMemory)
    "params": BLUE, "grads": ORANGE, "optimizer": GREEN, "activations": VERMILLION,
    "buffers": SKY, "reserved": GREY,
}


def save(fig, out_dir: Path, name: str) -> list[str]:
    """Write NAME.png and NAME.svg; returns the file names (relative to out_dir)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for ext in ("png", "svg"):
        fig.savefig(out_dir / f"{name}.{ext}", dpi=130, bbox_inches="tight")
        names.append(f"{name}.{ext}")
    plt.close(fig)
    return names


def figure(width: float, height: float):
    return plt.subplots(figsize=(width, height))
