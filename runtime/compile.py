"""Regional compilation (`planner run --compile`): each transformer layer's forward through
`torch.compile`, as torchtitan compiles its blocks, not the whole model or pipeline stage.

Applied after tensor parallelism and activation checkpointing and before FSDP2 (torchtitan's
order): the compiled region holds the layer's DTensor collectives and its checkpoint, while
FSDP2's gathers and reductions, the pipeline's sends and the train loop's timing hooks stay
eager around it (they are module hooks, and only the forward is compiled; the parameters keep
their names). Every layer runs the same code, so Dynamo compiles it once and reuses the graph
for the other layers of the same shapes. Inductor generates C++ on a CPU and Triton on a GPU.

A compiled layer never falls back to eager silently: a dense layer compiles as one graph or
fails (`_whole_graph`), Dynamo's recompile limit raises (`fail_on_recompile_limit_hit`), and a
plan whose mechanism compilation cannot serve is refused by name (`compile_problem`) before any
rank starts.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from costmodel.plan import Plan, Recompute
from runtime.moe import MoE

# A mixture's routing gives its experts a different number of tokens each micro-batch: Dynamo
# marks those sizes dynamic after the first recompile, and this bounds the recompiles of one
# layer's code before a run stops (instead of running the layer eagerly, as Dynamo would).
RECOMPILE_LIMIT = 16


def compile_problem(plan: Plan) -> str | None:
    """Why `--compile` cannot run this plan's layers (None: it can)."""
    if plan.offload_activations:
        # runtime.offload's host copies are contiguous, and a compiled backward asserts the
        # strides of every tensor it saved (inductor's assert_size_stride fails on a transposed one)
        return ("--compile: activation offloading (runtime.offload) cannot run under a compiled layer, whose "
                "backward needs its saved tensors' strides, which the host copies do not keep; run it without --compile")
    if plan.recompute is not Recompute.NONE and plan.tp > 1:
        # a checkpoint inside a compiled layer under TP (the attention core's or the whole layer's):
        # torch 2.13's AOTAutograd lists the TP mesh among the region's saved tensors and asserts
        # (measured, with or without SP)
        return (f"--compile: {plan.recompute} recomputation under tensor parallelism fails in torch's compiled "
                "autograd (the TP mesh among the checkpointed region's saved tensors); use --recompute none, or run "
                "it without --compile")
    if plan.schedule.traits.defers_weight_grad:
        # a compiled layer's backward is one autograd node (input and weight gradients together,
        # its saved buffers donated to it), which the split backward cannot run twice
        return (f"--compile: the {plan.schedule} schedule splits each backward into an input pass and a deferred "
                "weight pass, which a compiled layer's single backward cannot serve; use 1f1b or "
                "interleaved-1f1b, or run it without --compile")
    return None


def apply_compile(stage: nn.Module, plan: Plan) -> int:
    """Compile each of the stage's layers' forward in place; returns how many."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    for layer in stage.layers.values():
        layer.forward = _settled(torch.compile(layer.forward, fullgraph=_whole_graph(layer, plan)))
    return len(stage.layers)


def _whole_graph(layer: nn.Module, plan: Plan) -> bool:
    """Whether the layer must compile as one graph (fullgraph): a dense layer without CP can,
    so a construct Dynamo cannot trace fails the run instead of leaving the layer eager. A side
    effect inside a checkpointed layer once did: Dynamo ran the whole checkpoint eagerly, every
    step, without a word (measured on an H200: a full-recompute run no faster than eager, no
    Triton kernel in its trace). Where Dynamo must break, it may: CP's ring attention builds a
    CausalBias, and a mixture's experts take their token counts to the host."""
    return plan.cp == 1 and not any(isinstance(m, MoE) for m in layer.modules())


def _settled(compiled):
    """The compiled forward given a plain tensor. Under TP the embedding's output reaches the first
    layer as the pending result of its reduce-scatter (an AsyncCollectiveTensor); the graph
    compiled for it returns its input's gradient as a plain tensor where the eager redistribute
    behind it expects a DTensor. One op outside the graph completes the collective first."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, AsyncCollectiveTensor):
            x = x.clone()
        return compiled(x)
    return forward
