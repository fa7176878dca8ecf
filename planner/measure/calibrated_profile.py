"""The profile `planner calibrate` writes: the base profile's document with the fitted values
set and the calibration's provenance on top (planner.measure.calibrate fits them)."""
from __future__ import annotations

import time
from pathlib import Path

from costmodel.estimate import estimate
from costmodel.hardware import DTYPE_FIELDS, DeviceProfile
from planner.measure.calibrate import RECOMPUTE_PARAM, comm_params, measured_fragmentation
from planner.measure.run_dirs import Run


def calibrated_profile(base_path: Path, device: DeviceProfile, params: dict[str, float], runs: list[Run],
                       before: dict[str, float], after: dict[str, float], command: str):
    """The base profile's document with [device] name, the fitted efficiencies (per dtype too)
    and the node tier's latencies set, and the calibration's provenance on top: every other
    datasheet or measured value and its source comment stays as it was."""
    from planner.measure import profile_file as pf_io
    eff, tier = device.efficiency, device.intra_node
    how = (f"calibrated {time.strftime('%Y-%m-%d')} by `{command}` on {len(runs)} runs: step-time MAPE "
           f"{before['mape_pct']:.1f}% -> {after['mape_pct']:.1f}%, max {before['max_abs_error_pct']:.1f}% -> "
           f"{after['max_abs_error_pct']:.1f}%")
    header = [how, "fitted factors: " + ", ".join(f"{k} {v:.4g}" for k, v in params.items()),
              f"base profile: {base_path}"]
    doc = pf_io.parse("".join(f"# {line}\n" for line in header) + "\n" + base_path.read_text())
    mark = "calibrated (see the top of this file)"
    pf_io.set_value(doc["device"], "name", device.name, "")
    pf_io.set_value(doc["device"], "aliases", [], "")
    table = doc["efficiency"]
    measured_memory = measured_fragmentation(runs) is not None   # else the profile's sourced value stays
    for key, value in (("gemm", eff.gemm), ("attention", eff.attention), ("memory", eff.memory),
                       ("kernel_overhead_s", eff.kernel_overhead_s), ("intra_node_comm", tier.efficiency),
                       *([("allocator_fragmentation", eff.allocator_fragmentation)] if measured_memory else []),
                       *([(RECOMPUTE_PARAM, eff.recompute_cost)] if RECOMPUTE_PARAM in params else []),
                       ("overlap", eff.overlap),
                       *([("dp_comm", eff.dp_comm)] if "dp_comm" in comm_params(device) else []),
                       *([("pp_stage", eff.pp_stage)] if "pp_stage" in params else [])):
        pf_io.set_value(table, key, value, mark)
    pf_io.set_value(table, "source", how, "")
    for dtype, e in device.dtype_efficiency:
        if dtype not in table:
            table.add(dtype, pf_io.table([], comment=mark))
        for key in DTYPE_FIELDS:
            pf_io.set_value(table[dtype], key, getattr(e, key), mark)
        if RECOMPUTE_PARAM in params and RECOMPUTE_PARAM in table[dtype]:   # a dtype's own overrides the device's
            pf_io.set_value(table[dtype], RECOMPUTE_PARAM, e.recompute_cost, mark)
    node = next(t for t in doc["network"] if t["scope"] == "node")
    for key, value in (("latency_s", tier.latency_s), ("p2p_latency_s", tier.p2p_latency_s)):
        if value is not None and key in node:
            pf_io.set_value(node, key, value, f"calibrated: measured x {params.get('comm_latency', 1.0):.3g}")
    if "probes" in doc:
        _reprice_probes(doc["probes"], device)
    return doc


def _reprice_probes(probes, device: DeviceProfile) -> None:
    """The stored probe steps' predictions under the calibrated device (the error a search on the
    profile quotes is theirs: costmodel.fidelity.error_band); a step no current probe plan is
    named by is dropped, its price under the calibration unknown."""
    from planner.measure.probes import probe_name, probe_plans
    accelerated = {d: True for d, _ in device.dtype_efficiency}
    plans = {probe_name(pf): pf for ranks in (1, 2) for pf in probe_plans(device, accelerated, ranks)}
    kept = [step for step in probes.get("steps", []) if step["plan"] in plans]
    for step in kept:
        pf = plans[step["plan"]]
        step["predicted_s"] = float(f"{estimate(pf.model, pf.train, pf.cluster, pf.plan).step_time_s:.6g}")
    probes["steps"] = kept
