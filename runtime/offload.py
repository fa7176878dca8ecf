"""Offloaded activations (Plan.offload_activations): what a transformer layer saves for backward
is copied to host memory as it is saved and back when backward reads it.

torch's `save_on_cpu` copies every saved tensor, the layer's weights too (F.linear saves its
weight): these hooks leave parameters where they are, as costmodel.memory prices it (the layers'
activations only). The copies run on the compute stream (pinned host memory on CUDA), as
costmodel.rank_time prices them: exposed. Plans with recomputation or a zero-bubble schedule never
get here (costmodel.check.activation_offload_problems).
"""
from __future__ import annotations

import torch
from torch import nn


def _pack(pin: bool):
    def pack(t: torch.Tensor):
        if isinstance(t, nn.Parameter):   # a weight stays on the device (FSDP2 keeps it gathered)
            return t
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
        host.copy_(t, non_blocking=pin)
        return t.device, host
    return pack


def _unpack(pin: bool):
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=pin)
    return unpack


def apply_activation_offload(stage: nn.Module, pin: bool) -> None:
    """Run each of the stage's layers under hooks that keep its saved activations on the host."""
    for layer in stage.layers.values():
        inner = layer.forward

        def forward(*args, _inner=inner, **kwargs):
            with torch.autograd.graph.saved_tensors_hooks(_pack(pin), _unpack(pin)):
                return _inner(*args, **kwargs)
        layer.forward = forward
