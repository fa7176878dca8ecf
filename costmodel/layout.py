"""The tensor-parallel layout as data (Megatron-LM, Shoeybi et al. 2019, Sec. 3).

Each block starts with column-parallel projections (output features split across TP ranks,
input replicated) and ends with one row-parallel projection (input features split, output
partial sums). So a block needs one collective on its input (identity forward / all-reduce
backward; all-gather with sequence parallelism) and one on its output (all-reduce; reduce-scatter
with sequence parallelism). The cost model counts collectives from this table and the runtime
applies `ColwiseParallel` / `RowwiseParallel` from it, so both agree by construction.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from costmodel.selective_modules import OP_POLICY
from costmodel.specs import Arch, ModelSpec


class Style(StrEnum):
    COLWISE = "colwise"
    ROWWISE = "rowwise"
    # whole on every TP rank over the rank's tokens: MLA's down-projections to its latents, as
    # Megatron-Core's MLASelfAttention holds them (linear_q_down_proj / linear_kv_down_proj)
    REPLICATED = "replicated"


@dataclass(frozen=True, kw_only=True, slots=True)
class Linear:
    name: str           # module name inside the block (the runtime uses the same names)
    in_features: int
    out_features: int
    style: Style
    bias: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    name: str                 # "attention" or "mlp"
    linears: tuple[Linear, ...]  # column-parallel ones first, the row-parallel one last


@lru_cache(maxsize=256)
def layer_blocks(model: ModelSpec) -> tuple[Block, ...]:
    h, q, kv, f, b = model.hidden_size, model.q_hidden_size, model.kv_hidden_size, model.ffn_hidden_size, model.bias
    qkv_b = b or model.qkv_bias   # Qwen2: biases on the query, key and value projections only
    col, row = Style.COLWISE, Style.ROWWISE
    if model.arch is Arch.LLAMA:
        attn = (Linear(name="wq", in_features=h, out_features=q, style=col, bias=qkv_b),
                Linear(name="wk", in_features=h, out_features=kv, style=col, bias=qkv_b),
                Linear(name="wv", in_features=h, out_features=kv, style=col, bias=qkv_b),
                Linear(name="wo", in_features=q, out_features=h, style=row, bias=b))
        mlp = (Linear(name="w1", in_features=h, out_features=f, style=col, bias=b),
               Linear(name="w3", in_features=h, out_features=f, style=col, bias=b),
               Linear(name="w2", in_features=f, out_features=h, style=row, bias=b))
    else:
        attn = (Linear(name="qkv", in_features=h, out_features=q + 2 * kv, style=col, bias=b),
                Linear(name="proj", in_features=q, out_features=h, style=row, bias=b))
        mlp = (Linear(name="fc1", in_features=h, out_features=f, style=col, bias=b),
               Linear(name="fc2", in_features=f, out_features=h, style=row, bias=b))
    if model.is_mla:
        attn = mla_linears(model)
    return (Block(name="attention", linears=attn), Block(name="mlp", linears=mlp))


# the latent attention's up-projections (`wq` without query compression), which Megatron-Core's
# `mla_up_proj` recomputation re-runs
MLA_UP_PROJECTIONS = ("wq", "wq_b", "wkv_b")


def recomputed_linears(model: ModelSpec, module: str) -> tuple[Linear, ...]:
    """The projections a selectively recomputed module re-runs (Megatron-Core's names,
    costmodel.selective_modules): mla_up_proj the latent attention's up-projections, mlp a dense
    MLP's (none in a mixture's layer, whose MLP dense_blocks leaves out), op_policy torchtitan's
    every second projection in forward order; none for the others."""
    if module == OP_POLICY:   # torchtitan's per-op policy: every second one in forward order
        return dense_linears(model)[1::2]
    wanted = {"mla_up_proj": ("attention", MLA_UP_PROJECTIONS), "mlp": ("mlp", None)}.get(module)
    if wanted is None:
        return ()
    block_name, names = wanted
    return tuple(lin for block in dense_blocks(model) if block.name == block_name
                 for lin in block.linears if names is None or lin.name in names)


def mla_linears(model: ModelSpec) -> tuple[Linear, ...]:
    """Multi-head latent attention in its training (non-absorbed) form, DeepSeek-V2 Sec. 2.1.2
    and transformers' DeepseekV3Attention: the input down to the query latent (q_lora_rank; none
    without query compression) and up to each head's query (no-RoPE and RoPE parts); the input
    down to the key/value latent plus the RoPE key shared by all heads; that latent up to each
    head's no-RoPE key and value; the heads' values back to hidden. Heads split over TP (the
    up-projections column-parallel, the output row-parallel), the down-projections whole on every
    TP rank (Megatron-Core). The latents' RMSNorms: costmodel.params.mla_norm_params."""
    h, heads, qk = model.hidden_size, model.num_heads, model.head_dim
    col, row, rep = Style.COLWISE, Style.ROWWISE, Style.REPLICATED
    if model.q_lora_rank:
        q = (Linear(name="wq_a", in_features=h, out_features=model.q_lora_rank, style=rep, bias=False),
             Linear(name="wq_b", in_features=model.q_lora_rank, out_features=heads * qk, style=col, bias=False))
    else:
        q = (Linear(name="wq", in_features=h, out_features=heads * qk, style=col, bias=False),)
    kv_up = heads * (model.qk_nope_head_dim + model.v_head_dim)
    return (*q, Linear(name="wkv_a", in_features=h, out_features=model.kv_lora_rank + model.qk_rope_head_dim,
                       style=rep, bias=False),
            Linear(name="wkv_b", in_features=model.kv_lora_rank, out_features=kv_up, style=col, bias=False),
            Linear(name="wo", in_features=model.attention_output_size, out_features=h, style=row, bias=False))


@lru_cache(maxsize=256)
def dense_linears(model: ModelSpec) -> tuple[Linear, ...]:
    """The dense projections of a layer in the order its forward runs them (attention, then a
    dense MLP)."""
    return tuple(lin for block in dense_blocks(model) for lin in block.linears)


@lru_cache(maxsize=256)   # asked per kernel, count and FLOP formula: thousands of times per search
def dense_blocks(model: ModelSpec) -> tuple[Block, ...]:
    """The blocks this model has as dense projections: a mixture of experts replaces the MLP
    (its router, experts and shared expert: costmodel.params.moe_params)."""
    return tuple(b for b in layer_blocks(model) if not (model.is_moe and b.name == "mlp"))
