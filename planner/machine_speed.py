"""How fast this machine runs now against the moment its profile was measured.

A shared machine's speed moves: on a 2-core EPYC a whole profile has come out 20-30 % slow (fp32
GEMMs at 52-67 GFLOP/s where other profiles of the same machine measured 64-98), and every plan
predicted from it then ran 10-45 % faster than predicted (closed loop CG, 2026-11-28). Nothing
inside one profile tells such a moment from the machine's normal speed. A CPU profile keeps the
seconds of its probe layer's kernels ([measured] layer_ops, runtime.layer_ops); `planner run`
times the same layer again after its steps, so each run says how fast the machine went beside
how far its step was from the prediction.
"""
from __future__ import annotations

import tomllib
from pathlib import Path

from costmodel.plan import PlanFile
from runtime.layer_ops import KINDS

# a moment this far from the profile's (either way) is named beside the run's error
NOTABLE_PCT = 10.0


def profiled_entry(pf: PlanFile) -> dict | None:
    """The profile's [measured] layer_ops entry for the plan's compute dtype: None for a
    datasheet or GPU profile, or one measured before the layer was (2026-11-28)."""
    dev = pf.cluster.device
    if dev.kind != "cpu" or not dev.path or not Path(dev.path).is_file():
        return None
    entry = tomllib.loads(Path(dev.path).read_text()).get("measured", {}).get("layer_ops", {}) \
        .get(str(pf.train.compute_dtype))
    return entry if isinstance(entry, dict) else None


def probe_layer_s(pf: PlanFile, threads: int) -> list[float] | None:
    """[now, in the profile]: the plan's profile's probe layer timed again in the plan's dtype,
    with a rank's threads (the profile timed it with all its ranks at once, each on its own
    cores), and as the profile holds it. None where the profile has no such entry."""
    entry = profiled_entry(pf)
    if entry is None:
        return None
    import torch

    from planner.probes import PROBE_MODELS
    from runtime.layer_ops import layer_op_seconds
    from runtime.profiler import DTYPES
    model = PROBE_MODELS.get(entry.get("model"))
    if model is None:
        return None
    torch.set_num_threads(threads)
    now = layer_op_seconds(model, DTYPES[str(pf.train.compute_dtype)], int(entry["micro_batch_size"]),
                           int(entry["seq_len"]))
    return [sum(now.values()), sum(float(entry[f"{k}_s"]) for k in KINDS)]


def describe(probe: list[float]) -> str:
    """One line for a run's output: the layer's time after the run against the profile's."""
    now_s, then_s = probe
    pct = 100 * (now_s / then_s - 1)
    line = (f"machine: the profile's probe layer took {1e3 * now_s:.1f} ms after the run, "
            f"{1e3 * then_s:.1f} ms when profiled ({pct:+.0f} %)")
    if abs(pct) >= NOTABLE_PCT:
        line += ("; the machine ran " + ("slower" if pct > 0 else "faster") + " than when profiled, and the "
                 "step's error carries some of that (`planner profile` measures it again)")
    return line
