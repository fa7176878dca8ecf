"""Where a plan's predicted step goes between memory-bound work and the rest, beside what its run
measured: for each plan.json (a closed-loop plan directory's, with measured.json beside it where
`planner run` wrote one),

    python benchmarks/price_parts.py DIR/single_bf16/plan.json [...]

the predicted step; its memory-bound part (the step at the profile's memory factor less the step
with memory-bound work free) at that factor and at factor 1; one layer's forward as priced
(costmodel.compute.layer_kernel_times), and of it the part outside memory-bound work; and the
run's measured layer forwards per layer and micro-batch (measured.json `rank_forward_s`, rank 0).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from costmodel.compute import layer_kernel_times
from costmodel.estimate import estimate
from costmodel.plan import PlanFile

FREE = 1e6   # a memory factor at which memory-bound work costs nothing


def with_memory(dev, factor: float | None):
    """The device with every efficiency table's memory factor at `factor` (None: as it is)."""
    if factor is None:
        return dev
    return replace(dev, efficiency=replace(dev.efficiency, memory=factor),
                   dtype_efficiency=tuple((k, replace(e, memory=factor)) for k, e in dev.dtype_efficiency))


def report(path: Path) -> str:
    pf = PlanFile.load(path)
    dev = pf.cluster.device

    def step_ms(factor: float | None) -> float:
        return 1e3 * estimate(pf.model, pf.train, replace(pf.cluster, device=with_memory(dev, factor)),
                              pf.plan).step_time_s

    def layer_forward_ms(factor: float | None) -> float:
        own = with_memory(dev, factor).for_dtype(pf.train.compute_dtype)
        return 1e3 * layer_kernel_times(pf.model, pf.train, pf.plan, own, False, False,
                                        pf.cluster.framework.cpu_kernels).forward_s
    factor = dev.for_dtype(pf.train.compute_dtype).efficiency.memory
    free = step_ms(FREE)
    line = (f"{path}: step {step_ms(None):.0f} ms, memory-bound {step_ms(None) - free:.0f} ms at factor "
            f"{factor:.3f} ({step_ms(1.0) - free:.0f} at 1); a layer's forward {layer_forward_ms(None):.2f} ms, "
            f"{layer_forward_ms(FREE):.2f} outside memory-bound work")
    measured = path.parent / "measured.json"
    if measured.exists() and (forward := json.loads(measured.read_text()).get("rank_forward_s")):
        per = forward[0] / (pf.model.num_layers / pf.plan.pp * pf.plan.num_micro_batches)
        line += f"; measured {1e3 * per:.2f} ms per layer and micro-batch"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plans", type=Path, nargs="+", help="plan.json files")
    args = parser.parse_args()
    for path in args.plans:
        try:
            print(report(path))
        except (OSError, ValueError) as err:
            sys.exit(f"price_parts: {err}")


if __name__ == "__main__":
    main()
