"""The runtime's optimizer step: torch's fused AdamW (one kernel per device and dtype for the
whole update) wherever torch runs it for the parameters, else foreach AdamW (a kernel per
operation per group of tensors), named in the run log.

torch decides at the first step whether `fused=True` can serve the parameters (floating point, on
a device with fused kernels: CUDA and CPU among them); the same rule is asked here, before the
optimizer is made, so that a refusal is a foreach optimizer said so rather than a failed step.
FSDP2's sharded parameters and tensor/expert parallelism's DTensors pass it: the fused kernel runs
on each rank's local shards (DTensor's sharding rule for `_fused_adamw_`), in every parallel layout
the runtime builds (tests/runtime/test_optimizer.py). runtime.profiler times the same optimizer.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.optim.optimizer import _device_dtype_check_for_fused  # torch's own rule for fused=True


def fused_refusal(params: Iterable[torch.Tensor]) -> str | None:
    """Why torch would refuse fused AdamW for these parameters (None: it runs them)."""
    for p in params:
        try:
            _device_dtype_check_for_fused(p)
        except RuntimeError as exc:
            return str(exc).splitlines()[0]
    return None


def adamw(params: list[torch.Tensor], lr: float) -> tuple[torch.optim.AdamW, str | None]:
    """AdamW over `params`, fused where torch runs it; returns it and, for a foreach one, why."""
    if refusal := fused_refusal(params):
        return torch.optim.AdamW(params, lr=lr, foreach=True), f"foreach AdamW, not fused: {refusal}"
    return torch.optim.AdamW(params, lr=lr, fused=True), None
