"""Sequence-parallel input projections that keep only the sequence shard for backward.

Under sequence parallelism a block (attention, MLP) receives this rank's sequence shard. torch's
DTensor styles (`PrepareModuleInput` from `Shard(1)` to `Replicate()`, then `ColwiseParallel`)
all-gather it and every column-parallel projection saves the gathered, whole-sequence tensor for
its weight gradient: t times what Megatron-LM keeps. Megatron keeps the shard and all-gathers it
again in backward (Korthikanti et al. 2022, arXiv 2205.05198, Sec. 4.2.2;
`LinearWithGradAccumulationAndAsyncCommunication` with `sequence_parallel`). `GatheredColumns` does
the same for all of a block's column-parallel projections at once (Q, K, V; gate and up), so the
block gathers once forward and once backward, and its input gradient is one reduce-scatter.

The projections' weights stay `ColwiseParallel`'s DTensors (`Shard(0)` over the TP mesh), so
FSDP2, checkpoints and the optimizer see what they saw before; only the forward goes through
`GatheredColumns` (`ColwiseWeights` shards the weights and adds no input or output hooks).
Counted by costmodel.memory (`tp_keeps_gathered_input` off for our runtime), measured tensor by
tensor by tests/runtime/test_activation_memory.py.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence from every rank's shard of dim 1 (ranks in group order)."""
    t = dist.get_world_size(group)
    parts = x.new_empty((t * x.shape[0], *x.shape[1:]))   # the shards stacked on dim 0
    dist.all_gather_single(parts, x.contiguous(), group=group)
    return parts.unflatten(0, (t, x.shape[0])).movedim(0, 1).flatten(1, 2)


def scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over the group, each rank keeping its shard of dim 1."""
    t = dist.get_world_size(group)
    chunks = x.unflatten(1, (t, x.shape[1] // t)).movedim(1, 0)   # rank r's shard at [r]
    out = x.new_empty(chunks.shape[1:])
    dist.reduce_scatter_single(out, chunks.flatten(0, 1).contiguous(), group=group)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class _GatheredColumns(torch.autograd.Function):
    """y_i = gather(x) W_i^T + b_i for a block's projections; saves x (the shard) and the W_i."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, num: int, *params: torch.Tensor | None):
        weights, biases = params[:num], params[num:]
        ctx.group, ctx.has_bias = group, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        whole = gather_sequence(x, group)
        return tuple(F.linear(whole, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        x, *weights = ctx.saved_tensors
        whole = gather_sequence(x, ctx.group).flatten(0, -2)   # again, for the weight gradients
        grad_whole = None
        weight_grads, bias_grads = [], []
        for g, w, has_bias in zip(grads, weights, ctx.has_bias):
            part = g @ w
            grad_whole = part if grad_whole is None else grad_whole.add_(part)
            rows = g.flatten(0, -2)
            weight_grads.append(rows.t() @ whole)
            bias_grads.append(rows.sum(0) if has_bias else None)
        return (scatter_sequence(grad_whole, ctx.group), None, None, *weight_grads, *bias_grads)


class GatheredColumns:
    """A block's `project_in` (runtime.model.each_linear) under sequence parallelism."""

    def __init__(self, group) -> None:
        self.group = group

    def __call__(self, block: nn.Module, x: torch.Tensor, names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        linears = [getattr(block, name) for name in names]
        weights = [_local(lin.weight) for lin in linears]
        biases = [None if lin.bias is None else _local(lin.bias) for lin in linears]
        return _GatheredColumns.apply(_local(x), self.group, len(linears), *weights, *biases)


class ColwiseWeights(ColwiseParallel):
    """`ColwiseParallel`'s weight (and bias) sharding on dim 0, without its input and output
    hooks: the block's forward reaches the weights through `GatheredColumns`."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition_linear_fn)
