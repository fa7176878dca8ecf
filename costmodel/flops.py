"""FLOP counts (2 FLOPs per multiply-add), per layer, per step, model vs executed.

Source: Narayanan et al. SC'21 (arXiv 2104.04473) Sec. 5.1, generalised to GQA and SwiGLU by
counting each projection of costmodel.layout: a linear of shape (in, out) over T tokens costs
2·T·in·out forward and twice that backward (input and weight gradients). Attention scores and
their weighted sum cost 2·2·b·s²·h forward, counted over the full s x s square as Megatron's
Eq. 7 does (model FLOPs convention); a causal flash kernel executes only half of it, which
`costmodel.kernels` accounts for in time, not in these counts. For a GPT layer with ffn = 4h
this gives Megatron's 72·B·s·l·h²·(1 + s/6h + V/12lh) per step (tested).
"""
from __future__ import annotations

from costmodel.deepseek import dense_layer_model
from costmodel.layout import Linear, dense_blocks, recomputed_linears
from costmodel.params import active_moe_params
from costmodel.plan import Plan, Recompute
from costmodel.selective_modules import DEFAULT_SELECTIVE_MODULES
from costmodel.specs import ModelSpec, TrainSpec

BACKWARD_FACTOR = 2  # dX and dW each cost one forward's FLOPs (SC'21 Sec. 5.1)


def linear_forward_flops(lin: Linear, num_tokens: int) -> int:
    """One projection's forward GEMM over num_tokens tokens."""
    return 2 * num_tokens * lin.in_features * lin.out_features


def layer_linear_forward_flops(model: ModelSpec, num_tokens: int) -> int:
    """All projections of one layer (QKV, output, MLP) over num_tokens tokens. A mixture of
    experts counts what a token passes through (active parameters): the router, its
    `experts_per_token` experts, the shared expert and its gate."""
    dense = sum(linear_forward_flops(lin, num_tokens) for block in dense_blocks(model) for lin in block.linears)
    return dense + 2 * num_tokens * active_moe_params(model)


def attention_core_forward_flops(model: ModelSpec, num_sequences: int, seq_len: int) -> int:
    """Q·K^T and P·V over the full s x s square: 2·b·s²·heads·(head_dim + value head dim), 4·b·s²·h
    for most models (independent of GQA: every query head still attends over s keys of head_dim;
    MLA in its non-absorbed training form: keys of no-RoPE + RoPE size, values of v_head_dim)."""
    return 2 * num_sequences * seq_len * seq_len * model.num_heads * (model.head_dim + model.value_head_dim)


def layer_forward_flops(model: ModelSpec, num_sequences: int, seq_len: int) -> int:
    tokens = num_sequences * seq_len
    return (layer_linear_forward_flops(model, tokens)
            + attention_core_forward_flops(model, num_sequences, seq_len))


def stops_before_final_linear(model: ModelSpec, plan: Plan) -> bool:
    """Whether a recomputation that stops early skips the layer's last projection (the MLP's
    row-parallel w2 / fc2). torch's non-reentrant checkpoint stops recomputing once every tensor
    the backward needs is saved again, and a linear saves its input and weight before its GEMM
    runs: the GEMM, the collective after it under TP and the residual add are skipped (nothing in
    backward needs their output). Not so where the layer ends in something that saves what the
    GEMM makes: a dropout's mask, a float8 linear (a custom autograd function, saved after it
    runs), a mixture of experts (its combine saves the routing). tests/runtime/
    test_recompute_early_stop.py lists the GEMMs a recomputation runs with a dispatch mode for the
    dense, dropout and MoE layers; float8 (torchao 0.18 on CPU: all seven recomputed) and TP with
    and without SP (one collective fewer) were checked by hand, not by a test. A float8 plan
    whose last projection is too small to be float8 still stops early; priced whole (cautious)."""
    return not (model.is_moe or model.dropout or plan.fp8_linears)


def final_linear(model: ModelSpec) -> Linear:
    """The layer's last projection (costmodel.layout: the MLP block's row-parallel one)."""
    return next(b for b in dense_blocks(model) if b.name == "mlp").linears[-1]


def skipped_recompute_flops(model: ModelSpec, num_tokens: int, plan: Plan, early_stop: bool) -> int:
    """Forward FLOPs an early-stopping full recomputation never runs (`recompute_early_stop`)."""
    if not (early_stop and plan.recompute is Recompute.FULL and stops_before_final_linear(model, plan)):
        return 0
    return linear_forward_flops(final_linear(model), num_tokens)


def lm_head_forward_flops(model: ModelSpec, num_tokens: int) -> int:
    return 2 * num_tokens * model.hidden_size * model.vocab_size


def layers_forward_flops(model: ModelSpec, num_sequences: int, seq_len: int) -> int:
    """Every layer's forward: the expert layers' and the dense first layers' (their own MLP)."""
    dense = model.first_k_dense
    return ((model.num_layers - dense) * layer_forward_flops(model, num_sequences, seq_len)
            + (dense * layer_forward_flops(dense_layer_model(model), num_sequences, seq_len) if dense else 0))


def mtp_forward_flops(model: ModelSpec, num_sequences: int, seq_len: int) -> int:
    """The MTP modules' forward (DeepSeek-V3 Sec. 2.2; costmodel.params.mtp_params): per module the
    2h -> h projection, one more expert layer, and a pass through the shared output head."""
    tokens = num_sequences * seq_len
    projection = 2 * tokens * 2 * model.hidden_size * model.hidden_size
    return model.mtp_depth * (projection + layer_forward_flops(model, num_sequences, seq_len)
                              + lm_head_forward_flops(model, tokens))


def model_flops_per_step(model: ModelSpec, train: TrainSpec) -> int:
    """Forward + backward of every layer, the LM head and any MTP modules, no recomputation (MFU
    numerator)."""
    b, s = train.global_batch_size, train.seq_len
    forward = layers_forward_flops(model, b, s) + lm_head_forward_flops(model, b * s) + mtp_forward_flops(model, b, s)
    return (1 + BACKWARD_FACTOR) * forward


def recompute_flops_per_step(model: ModelSpec, train: TrainSpec, plan: Plan, early_stop: bool = False,
                             modules: tuple[str, ...] = DEFAULT_SELECTIVE_MODULES) -> int:
    """Extra forward work re-done in backward: whole layers (full; less the last projection where
    the recomputation stops early) or, selective, the framework's modules (`modules`:
    selective_layer_flops), for the layers the plan recomputes on each pipeline rank, over all DP
    replicas."""
    if plan.recompute is Recompute.NONE:
        return 0
    b, s = train.global_batch_size, train.seq_len
    if plan.recompute is Recompute.FULL:
        per_layer = layer_forward_flops(model, b, s) - skipped_recompute_flops(model, b * s, plan, early_stop)
        dense = 0
    else:   # the dense first layers' modules beyond an expert layer's (a dense MLP: mlp)
        per_layer = selective_layer_flops(model, b, s, modules)
        dense = (model.first_k_dense * (selective_layer_flops(dense_layer_model(model), b, s, modules) - per_layer)
                 if model.first_k_dense else 0)
    # recompute_num_layers counts layers of one pipeline rank; every rank sees the whole batch.
    return per_layer * sum(plan.recompute_num_layers) + dense


def selective_layer_flops(model: ModelSpec, num_sequences: int, seq_len: int, modules: tuple[str, ...]) -> int:
    """A layer's forward FLOPs its selective recomputation re-runs: the attention core
    (core_attn), the projections of mla_up_proj and mlp where the layer has them; the norms and
    the experts' activation are memory-bound, no FLOPs."""
    tokens = num_sequences * seq_len
    total = attention_core_forward_flops(model, num_sequences, seq_len) if "core_attn" in modules else 0
    return total + sum(linear_forward_flops(lin, tokens) for name in modules for lin in recomputed_linears(model, name))


def executed_flops_per_step(model: ModelSpec, train: TrainSpec, plan: Plan, early_stop: bool = False,
                            modules: tuple[str, ...] = DEFAULT_SELECTIVE_MODULES) -> int:
    """Hardware FLOPs (HFU numerator): model FLOPs plus recomputation, as the framework runs it
    (`early_stop`: costmodel.frameworks `recompute_early_stop`; `modules`: its `selective_modules`)."""
    return model_flops_per_step(model, train) + recompute_flops_per_step(model, train, plan, early_stop, modules)


def utilization(flops: float, step_s: float, world_size: int, peak_flops_per_s: float) -> float:
    """MFU (model FLOPs) or HFU (executed FLOPs): achieved over the peak of every device."""
    return flops / (step_s * world_size * peak_flops_per_s)
