"""DeepSeek-V2/V3 mechanisms' checks: multi-head latent attention (MLA), dense first layers,
grouped (node-limited) routing and multi-token prediction (ModelSpec's fields of that name).

DeepSeek-V2 (arXiv 2405.04434) Sec. 2.1: K and V come from a d_c-wide latent (kv_lora_rank), Q
from a d_c'-wide one (q_lora_rank), each head's query and key a no-RoPE part (qk_nope_head_dim)
and a RoPE part (qk_rope_head_dim) whose key is one for all heads. DeepSeek-V3 (arXiv
2412.19437) Sec. 2.1.2: sigmoid affinities with a bias for the choice, top-k within the best
groups; Sec. 2.2: MTP modules.
"""
from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from typing import TYPE_CHECKING

from costmodel.inputs import MAX_WIDTH, UserError, check_limit

if TYPE_CHECKING:
    from costmodel.specs import ModelSpec

_MLA_FIELDS = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def check_deepseek(m: "ModelSpec") -> None:
    """One line naming the field for each inconsistency (UserError)."""
    where = f"model {m.name!r}"
    for name in (*_MLA_FIELDS, "kv_lora_rank", "first_k_dense", "mtp_depth"):
        if getattr(m, name) < 0:
            raise UserError(f"{where}: {name} must not be negative")
        check_limit(where, name, getattr(m, name), MAX_WIDTH)
    _check_mla(m, where)
    if m.first_k_dense:
        if not m.is_moe:
            raise UserError(f"{where}: first_k_dense {m.first_k_dense} without experts (a dense model's "
                             "layers are all dense)")
        if m.first_k_dense >= m.num_layers:
            raise UserError(f"{where}: first_k_dense {m.first_k_dense} leaves no expert layer of "
                             f"num_layers {m.num_layers}")
    _check_routing(m, where)
    if m.mtp_depth and m.arch != "llama":
        raise UserError(f"{where}: mtp_depth is built for the llama layout only")


def _check_mla(m: "ModelSpec", where: str) -> None:
    if not m.is_mla:
        if set_fields := [n for n in _MLA_FIELDS if getattr(m, n)]:
            raise UserError(f"{where}: {set_fields[0]} is set but kv_lora_rank is 0 (no latent attention)")
        return
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if getattr(m, name) <= 0:
            raise UserError(f"{where}: {name} must be positive with latent attention (kv_lora_rank > 0)")
    if m.qk_rope_head_dim % 2:
        raise UserError(f"{where}: qk_rope_head_dim {m.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    if m.kv_lora_rank >= m.hidden_size:
        raise UserError(f"{where}: kv_lora_rank {m.kv_lora_rank} must be below hidden_size {m.hidden_size} "
                         "(a latent no smaller than its input compresses nothing)")
    if m.q_lora_rank >= m.hidden_size:
        raise UserError(f"{where}: q_lora_rank {m.q_lora_rank} must be below hidden_size {m.hidden_size} "
                         "(0: no query compression)")
    if m.num_kv_heads != m.num_heads:
        raise UserError(f"{where}: num_kv_heads {m.num_kv_heads} must equal num_heads {m.num_heads} "
                         "under latent attention (every head has its own K and V)")
    if m.arch != "llama" or m.qk_norm or m.explicit_head_dim is not None or m.rotary_fraction != 1:
        raise UserError(f"{where}: latent attention is built for the llama layout without qk_norm, "
                         "head_dim or rotary_fraction")


def _check_routing(m: "ModelSpec", where: str) -> None:
    if m.router_scoring != "softmax" or m.num_expert_groups != 1 or m.topk_groups != 1:
        if not m.is_moe:
            raise UserError(f"{where}: router_scoring / num_expert_groups / topk_groups without experts")
    if m.num_expert_groups < 1 or m.topk_groups < 1:
        raise UserError(f"{where}: num_expert_groups and topk_groups must be positive")
    if m.is_moe and m.num_experts % m.num_expert_groups:
        raise UserError(f"{where}: num_expert_groups {m.num_expert_groups} does not divide "
                         f"num_experts {m.num_experts}")
    if m.topk_groups > m.num_expert_groups:
        raise UserError(f"{where}: topk_groups {m.topk_groups} exceeds num_expert_groups {m.num_expert_groups}")
    if m.is_moe and m.experts_per_token > m.topk_groups * (m.num_experts // m.num_expert_groups):
        raise UserError(f"{where}: experts_per_token {m.experts_per_token} exceeds the experts of "
                         f"topk_groups {m.topk_groups} groups")
    if not m.routed_scaling_factor > 0:
        raise UserError(f"{where}: routed_scaling_factor must be positive")


def deepseek_mechanisms(m: "ModelSpec") -> list[str]:
    """`m`'s DeepSeek mechanisms by name (what a llama-shaped job file, such as torchtitan's
    export, would leave out)."""
    out = ["latent attention (kv_lora_rank)"] if m.is_mla else []
    out += ["dense first layers (first_k_dense)"] if m.first_k_dense else []
    out += ["sigmoid routing with a balancing bias (router_scoring)"] if m.router_scoring == "sigmoid" else []
    out += ["group-limited routing (num_expert_groups)"] if m.num_expert_groups > 1 else []
    out += ["scaled routed outputs (routed_scaling_factor)"] if m.routed_scaling_factor != 1.0 else []
    out += ["multi-token prediction (mtp_depth)"] if m.mtp_depth else []
    return out


@lru_cache(maxsize=64)
def dense_layer_model(m: "ModelSpec") -> "ModelSpec":
    """The model whose every layer is one of `m`'s dense first layers (its attention, a dense
    SwiGLU MLP of ffn_hidden_size, no MTP): each per-layer formula prices that layer unchanged."""
    return replace(m, name=f"{m.name} (dense layer)", num_experts=0, experts_per_token=0, moe_ffn_hidden_size=0,
                   shared_expert_ffn_hidden_size=0, shared_expert_gate=False, first_k_dense=0,
                   router_scoring=type(m.router_scoring)("softmax"), num_expert_groups=1, topk_groups=1, mtp_depth=0)
