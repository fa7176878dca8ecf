"""How fast this machine runs now against the moment its profile was measured.

A shared machine's speed moves: a whole profile taken in a slow moment comes out slow (its GEMM
curves below what other profiles of the same machine measure), and every plan predicted from it
then runs faster than predicted. Nothing inside one profile tells such a moment from the
machine's normal speed. A CPU profile keeps the seconds of its probe layer's kernels ([measured]
layer_ops, runtime.layer_ops); `planner run` times the same layer again after its steps, so each
run says how fast the machine went beside how far its step was from the prediction. The profile
timed the layer on all its ranks at once, the run times it in one process: where ranks share
memory bandwidth, the run's timing can come out a few percent faster for that alone.
"""
from __future__ import annotations

import tomllib
from pathlib import Path

from costmodel.inputs import UserError
from costmodel.plan import PlanFile

# a moment this far from the profile's (either way) is named beside the run's error
NOTABLE_PCT = 10.0


def profiled_timing(pf: PlanFile):
    """The profile's checked [measured] layer_ops timing for the plan's compute dtype
    (planner.measure.probes.LayerTiming): None for a datasheet or GPU profile, or one without that
    timing; ValueError naming the file and field for a malformed one."""
    from planner.measure.probes import LayerTiming
    dev = pf.cluster.device
    if dev.kind != "cpu" or not dev.path or not Path(dev.path).is_file():
        return None
    ops = tomllib.loads(Path(dev.path).read_text()).get("measured", {}).get("layer_ops")
    where = f"{dev.path}: [measured] layer_ops"
    if ops is None:
        return None
    if not isinstance(ops, dict):
        raise UserError(f"{where}: not a table of the probe layer's timings by dtype")
    dtype = str(pf.train.compute_dtype)
    return None if dtype not in ops else LayerTiming.parse(ops[dtype], f"{where}.{dtype}")


def probe_layer_s(pf: PlanFile, threads: int) -> tuple[float, float] | None:
    """(now, in the profile): the plan's profile's probe layer timed again in the plan's dtype,
    with a rank's threads, and as the profile holds it. None where the profile has no timing."""
    timing = profiled_timing(pf)
    if timing is None:
        return None
    import torch

    from runtime.layer_ops import layer_op_seconds
    from runtime.profiler import DTYPES
    torch.set_num_threads(threads)
    now = layer_op_seconds(timing.model, DTYPES[str(pf.train.compute_dtype)], timing.micro_batch_size,
                           timing.seq_len)
    return sum(now.values()), timing.total_s


def moment_pct(now_s: float, profiled_s: float) -> float:
    """How much longer (+) or shorter (-) the layer took now than in the profile, in percent."""
    return 100 * (now_s / profiled_s - 1)


def describe(now_s: float, profiled_s: float) -> str:
    """One line for a run's output: the layer's time after the run against the profile's."""
    pct = moment_pct(now_s, profiled_s)
    line = (f"machine: the profile's probe layer took {1e3 * now_s:.1f} ms after the run, "
            f"{1e3 * profiled_s:.1f} ms when profiled ({pct:+.0f} %)")
    if abs(pct) >= NOTABLE_PCT:
        line += ("; the machine ran " + ("slower" if pct > 0 else "faster") + " than when profiled, and the "
                 "step's error carries some of that (`planner profile` measures it again)")
    return line
