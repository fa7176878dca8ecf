"""A training layer's kernels timed one by one, by kind: what `planner profile` measures of how
fast a layer's GEMMs, attention and memory-bound kernels run inside a training step, against
the curves that time each kind alone.

A curve times one kernel called again and again on the same operands; in a training step a
kernel reads what other kernels wrote long before and writes fresh memory. A dispatch mode sees
every aten op of one layer's forward and backward (the runtime's own layer, runtime.model) and
times each one where it runs; the cost model prices the same layer at the curves
(costmodel.kernels.layer_parts_s), and the two give each kind's in-training share of its curve
(planner.measure.probes.layer_factors; `planner profile` writes them as [efficiency.<dtype>] gemm and
memory). On a CPU a training layer's GEMMs and memory-bound kernels run near their curves, a
small probe layer's and a larger model's alike; a memory-bound factor fitted to the probes'
step times instead lands far below, taking what the step spends between kernels.
"""
from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from costmodel.kernels import LAYER_KINDS
from costmodel.specs import ModelSpec

GEMM_OPS = frozenset({"mm", "addmm", "bmm"})
SDPA_OPS = frozenset({"_scaled_dot_product_flash_attention_for_cpu",
                      "_scaled_dot_product_flash_attention_for_cpu_backward"})
# ops that move no data (views, allocations, fills of fresh buffers): priced nowhere as a kernel
MOVES_NOTHING = frozenset({
    "view", "_unsafe_view", "t", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze",
    "permute", "as_strided", "detach", "alias", "reshape", "split", "unbind", "split_with_sizes",
    "_reshape_alias", "lift_fresh", "empty", "empty_like", "zeros", "ones", "arange", "empty_strided",
    "new_empty_strided", "new_zeros", "new_empty", "fill_", "zero_", "ones_like", "zeros_like"})
# timed forward + backward passes after one warm-up; each kind keeps its fastest, as each curve
# point is the best of its repetitions: a median set against the curves' best reads a busy
# machine's moment (a profile taken beside the test suite) as the layer's speed
LAYER_OP_REPEATS = 5


def op_kind(name: str) -> str | None:
    """An aten op's kind as the cost model prices it: "gemm", "sdpa", "memory" (every other op
    that moves data), or None for one that moves none."""
    if name in GEMM_OPS:
        return "gemm"
    if name in SDPA_OPS:
        return "sdpa"
    return None if name in MOVES_NOTHING else "memory"


class OpTimer(TorchDispatchMode):
    """Seconds per kind of the aten ops run under it. Each op's time is its call below the Python
    mode: the kernel, its output's allocation and the C++ dispatch, as a memory curve's point
    times a call (so a small kernel's dispatch is in the memory factor, as in the curve); the
    autograd engine's and the modules' Python work between ops is outside, left to the probes'
    fitted per-kernel cost."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = dict.fromkeys(LAYER_KINDS, 0.0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        elapsed = time.perf_counter() - start
        kind = op_kind(func._schema.name.split("::")[-1])
        if kind is not None:
            self.seconds[kind] += elapsed
        return out


def layer_op_seconds(model: ModelSpec, dtype: torch.dtype, micro_batch_size: int, seq_len: int,
                     repeats: int = LAYER_OP_REPEATS) -> dict[str, float]:
    """Seconds per kind of one layer's forward and backward (each kind's fastest of `repeats` passes),
    the layer as the runtime builds it (runtime.model.Transformer's first), in `dtype`, on this
    thread's CPU."""
    from runtime.model import Transformer
    net = Transformer(model)
    net.init_weights(0)
    layer = net.layers["0"].to(dtype)
    x = torch.randn(micro_batch_size, seq_len, model.hidden_size, dtype=dtype)
    passes = []
    for i in range(repeats + 1):
        # each pass from fresh gradients, as the cost model counts a layer's kernels (no accumulation)
        layer.zero_grad(set_to_none=True)
        h, dy = x.clone().requires_grad_(), torch.ones_like(x)
        with OpTimer() as timer:
            layer(h).backward(dy)
        if i:   # the first pass allocates and warms: not a training step's steady state
            passes.append(timer.seconds)
    return {k: min(p[k] for p in passes) for k in LAYER_KINDS}
