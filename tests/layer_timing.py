"""A probe layer's timing ([measured] layer_ops) as a profile would hold it, made so that
planner.measure.probes.layer_factors finds the given factors on `base`'s curves: for tests of the
probes' fit that need a CPU profile's measured factors without measuring a layer."""
from __future__ import annotations

from planner.measure import probes

WIDE_AT_128 = {"model": probes.LAYER_PROBE.model.name, "micro_batch_size": probes.LAYER_PROBE.micro_batch_size,
               "seq_len": probes.LAYER_PROBE.seq_len}


def layer_ops_at(base, factors: dict[str, dict[str, float]]) -> dict:
    """{dtype: {"gemm": f, "memory": f}} -> [measured] layer_ops; SDPA at its price."""
    out = {}
    for dtype, f in factors.items():
        probe = probes.LAYER_PROBE
        priced = probes.layer_priced_s(probe.model, dtype, probe.micro_batch_size, probe.seq_len, base)
        out[dtype] = {**WIDE_AT_128, "gemm_s": priced["gemm"] / f["gemm"], "sdpa_s": priced["sdpa"],
                      "memory_s": priced["memory"] / f["memory"]}
    return out
