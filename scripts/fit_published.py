"""Fit each device's efficiency parameters on the published runs table.

    python scripts/fit_published.py [RUNS.csv]
    python scripts/fit_published.py [RUNS.csv] --evaluate  (no fit: the profiles' current values)

Per device, a handful of physically meaningful parameters, each bounded to a plausible range:
large-GEMM efficiency, fused-attention efficiency, memory-bound kernel bandwidth efficiency,
NVLink and InfiniBand collective efficiency. One set per device for every row of that device,
never per row, source or model. The objective is the mean squared log error of predicted step
time (plans for empty cells re-chosen at every evaluation, as `planner validate` does). Prints
the fitted values and the per-row errors; copying them into profiles/*.toml is a deliberate,
reviewed step.
"""
from __future__ import annotations

import dataclasses
import math
import sys
from collections import defaultdict
from pathlib import Path

from scipy.optimize import minimize

from planner.validate import best_plan_for_row, read_runs, row_specs

PARAMS = {  # name: (lower, upper) bounds
    "gemm": (0.45, 0.9),
    "attention": (0.2, 0.8),
    "memory": (0.4, 0.95),
    "intra_node_comm": (0.4, 1.0),
    "inter_node_comm": (0.4, 1.0),
}


def with_params(cluster, values):
    dev = cluster.device
    eff = dataclasses.replace(dev.efficiency, gemm=values["gemm"], attention=values["attention"],
                              memory=values["memory"])
    dev = dataclasses.replace(
        dev, efficiency=eff,
        intra_node=dataclasses.replace(dev.intra_node, efficiency=values["intra_node_comm"]),
        inter_node=dataclasses.replace(dev.inter_node, efficiency=values["inter_node_comm"]))
    return dataclasses.replace(cluster, device=dev)


def row_log_errors(rows, specs, values):
    out = []
    for row, (model, train, cluster) in zip(rows, specs):
        _, est, _ = best_plan_for_row(row, model, train, cluster_p := with_params(cluster, values))
        pub = float(row["metric_value"])
        pred = est.step_time_s if row["metric_name"] == "iteration_time_s" \
            else est.tokens_per_s / cluster_p.world_size
        # tokens/s is the inverse of time: flip so a positive error always means "too slow"
        err = math.log(pred / pub)
        out.append(err if row["metric_name"] == "iteration_time_s" else -err)
    return out


def fit_device(name, rows):
    specs = [row_specs(r) for r in rows]
    start = {k: getattr(specs[0][2].device.efficiency, k, None) for k in ("gemm", "attention", "memory")}
    start["intra_node_comm"] = specs[0][2].device.intra_node.efficiency
    start["inter_node_comm"] = specs[0][2].device.inter_node.efficiency
    # Only what the rows can identify: fused-attention efficiency needs rows that use flash.
    uses_flash = any(train.attention_kernel == "flash" for _, train, _ in specs)
    keys = [k for k in PARAMS if k != "attention" or uses_flash]

    def loss(x):
        errs = row_log_errors(rows, specs, {**start, **dict(zip(keys, x))})
        return sum(e * e for e in errs) / len(errs)

    res = minimize(loss, [start[k] for k in keys], method="Powell",
                   bounds=[PARAMS[k] for k in keys], options={"xtol": 1e-3, "ftol": 1e-5, "maxfev": 600})
    values = {**start, **dict(zip(keys, res.x))}
    print(f"\n== {name}: {len(rows)} rows, rms log error {math.sqrt(res.fun):.4f} ({res.nfev} evaluations)")
    for k, v in values.items():
        print(f"  {k} = {v:.3f}{'' if k in keys else '  (not identifiable from these rows: kept)'}")
    for row, e in zip(rows, row_log_errors(rows, specs, values)):
        print(f"    {row['id']:32s} {100 * (math.exp(e) - 1):+6.1f}% step time")
    return values


def evaluate_device(name, rows):
    """Fit quality of the values the profile holds now, under the current cost model."""
    specs = [row_specs(r) for r in rows]
    dev = specs[0][2].device
    values = {"gemm": dev.efficiency.gemm, "attention": dev.efficiency.attention,
              "memory": dev.efficiency.memory, "intra_node_comm": dev.intra_node.efficiency,
              "inter_node_comm": dev.inter_node.efficiency}
    errs = row_log_errors(rows, specs, values)
    worst = max(zip(errs, rows), key=lambda item: abs(item[0]))
    print(f"{name}: {len(rows)} rows, rms log error {math.sqrt(sum(e * e for e in errs) / len(errs)):.3f}, "
          f"worst {worst[1]['id']} {100 * (math.exp(worst[0]) - 1):+.1f}% step time")


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--evaluate"]
    path = Path(args[0] if args else "../shared/reference/published_runs.csv")
    by_device = defaultdict(list)
    for row in read_runs(path):
        if row["metric_name"] != "status":
            by_device[row["gpu"]].append(row)
    for name, rows in sorted(by_device.items()):
        (evaluate_device if "--evaluate" in sys.argv else fit_device)(name, rows)


if __name__ == "__main__":
    main()
