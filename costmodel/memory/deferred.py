"""What a zero-bubble schedule's deferred weight-gradient passes keep per layer and micro-batch
(ZB-H1, ZBV): each projection's input and output gradient between the input-gradient pass and
the weight pass (costmodel.memory.stage counts them per deferred pass)."""
from __future__ import annotations

from costmodel.frameworks import RUNTIME, FrameworkTraits, shared_expert_split
from costmodel.kernels import expert_rows, moe_tokens
from costmodel.layout import Style, layer_blocks
from costmodel.memory.activations import layer_activation_bytes, local_tokens, proj_input_split
from costmodel.params import ceil_div
from costmodel.plan import Plan
from costmodel.specs import ModelSpec, TrainSpec


def weight_grad_input_bytes(model: ModelSpec, train: TrainSpec, plan: Plan,
                            traits: FrameworkTraits = RUNTIME) -> float:
    """Per layer and micro-batch, what a deferred weight-gradient pass (ZB-H1, ZBV) still needs
    once the input-gradient pass has freed the rest: the input of every projection (the two
    norm outputs feeding QKV and the MLP, the attention output, the MLP's activated product);
    the whole layer where the framework keeps the graph (frameworks.deferred_w_keeps_graph).
    A mixture's projections are its experts': each routed row's input and activated product
    (costmodel.kernels.expert_rows), and the shared expert's product."""
    if traits.deferred_w_keeps_graph:
        return (layer_activation_bytes(model, train, plan, plan.recompute, traits)
                + weight_grad_output_bytes(model, train, plan, traits))
    a, t = train.compute_dtype.num_bytes, plan.tp
    tokens = local_tokens(train, plan)
    if model.is_moe:
        routed = moe_tokens(tokens, t)
        mlp = (plan.etp * expert_rows(model, train, routed, plan.ep)
               * (model.hidden_size + model.moe_ffn_hidden_size // plan.etp)
               + routed * model.shared_expert_ffn_hidden_size)
    else:
        mlp = tokens * model.ffn_hidden_size / t
    return a * (tokens * (2 * model.hidden_size / proj_input_split(plan, traits) + model.attention_output_size / t)
                + mlp)


def weight_grad_output_bytes(model: ModelSpec, train: TrainSpec, plan: Plan,
                             traits: FrameworkTraits = RUNTIME) -> float:
    """Per layer and micro-batch, the output gradients torch pipelining's input pass captures
    for a deferred weight pass (`stage_backward_input` hooks): every projection's (a column-
    parallel one's 1/t slice, a row-parallel one's whole partial output) and the two norm scales'.
    A mixture's in place of the MLP's (runtime.moe, whole on each TP rank over its shard): the
    router's logits, each routed row's three expert projections (costmodel.kernels.expert_rows),
    the shared expert's three (split over TP where the framework splits it: _moe_output_grad_elements)
    and its gate's. Measured on a 2-stage ZB-H1 run: 232 MiB held per
    micro-batch, 228 MiB by this count; per tensor, what `stage_backward_input` captures of one
    layer equals this count for debug-small, debug-moe and a Mixtral-style layer
    (tests/runtime/test_schedule_memory.py)."""
    sp = plan.tp if plan.sequence_parallel else 1
    width = model.layer_norms * model.hidden_size / sp
    for block in layer_blocks(model):
        if not (model.is_moe and block.name == "mlp"):
            width += sum(lin.out_features / plan.tp if lin.style is Style.COLWISE else lin.out_features
                         for lin in block.linears)
    tokens = local_tokens(train, plan)
    return train.compute_dtype.num_bytes * (tokens * width
                                            + _moe_output_grad_elements(model, train, plan, tokens, traits))


def _moe_output_grad_elements(model: ModelSpec, train: TrainSpec, plan: Plan, tokens: int,
                              traits: FrameworkTraits = RUNTIME) -> float:
    """The elements of a mixture's projection outputs per micro-batch (weight_grad_output_bytes).
    A shared expert split over TP (frameworks `shared_expert_tp`) runs over the shards gathered:
    its column-parallel outputs at 1/split of its width, its row-parallel one a whole partial sum."""
    if not model.is_moe:
        return 0.0
    h, fs, routed = model.hidden_size, model.shared_expert_ffn_hidden_size, moe_tokens(tokens, plan.tp)
    split = shared_expert_split(plan.tp, traits.shared_expert_tp)
    shared = routed * split * (2 * ceil_div(fs, split) + h) if fs else 0
    return (shared + routed * (model.num_experts + (1 if model.shared_expert_gate else 0))
            + plan.etp * expert_rows(model, train, routed, plan.ep) * (2 * model.moe_ffn_hidden_size // plan.etp + h))


def edge_weight_grad_output_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, first: bool,
                                   last: bool) -> float:
    """The same for the embedding (its whole output) and the final norm and output projection
    (its vocabulary slice)."""
    sp = plan.tp if plan.sequence_parallel else 1
    width = (model.hidden_size if first else 0) + \
        (model.hidden_size / sp + ceil_div(model.vocab_size, plan.tp) if last else 0)
    return train.compute_dtype.num_bytes * local_tokens(train, plan) * width
