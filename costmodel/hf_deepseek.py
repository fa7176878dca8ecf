"""Hugging Face `deepseek_v2` / `deepseek_v3` configs -> ModelSpec (costmodel.hf_config's reader:
every key read, inert or refused by name).

transformers' DeepseekV2/V3ForCausalLM and DeepSeek's own modeling_deepseek.py: latent attention
(costmodel.deepseek), `first_k_dense_replace` dense first layers of `intermediate_size`, then in
every layer (`moe_layer_freq` 1) `n_routed_experts` experts of `moe_intermediate_size` and
`n_shared_experts` of that width side by side (one MLP n_shared x as wide), routed by
`scoring_func` within the best `topk_group` of `n_group` groups (`topk_method`), and
`num_nextn_predict_layers` MTP modules (which transformers' model does not build).
"""
from __future__ import annotations

from typing import Any

from costmodel import inputs
from costmodel.inputs import UserError
from costmodel.registry import llama_spec
from costmodel.specs import ModelSpec, RouterScoring

# topk_method -> whether it limits routing to the best groups (DeepSeek's modeling_deepseek.py:
# "greedy" over all experts; "group_limited_greedy" (V2) and "noaux_tc" (V3) within groups)
_TOPK_METHODS = {"greedy": False, "group_limited_greedy": True, "noaux_tc": True}
# YaRN's parameters (DeepSeek's long-context extension): numerics, no cost; the runtime trains
# with plain RoPE at 1/sqrt(head dim), as DeepSeek-V3 pre-trained at 4K before extending (Sec. 4.3)
_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "original_max_position_embeddings"}
# keys that change neither the cost nor the numerics: the expert-parallel size of DeepSeek's
# inference code, the aux loss computed per sequence (its cost is the router's), RoPE on
# interleaved pairs (a permutation of the heads' RoPE dimensions), transformers' generic keys
_INERT = ("ep_size", "seq_aux", "rope_interleave", "is_encoder_decoder", "chunk_size_feed_forward")


def deepseek(name: str, r: Any, *, version: int) -> ModelSpec:
    """`r`: costmodel.hf_config's reader of the config's keys; `version` 2 or 3."""
    where = r.where
    if (act := r.value("hidden_act", str, "silu")) != "silu":
        raise UserError(f"{where}: hidden_act {act!r} is not SwiGLU (silu)")
    if r.value("attention_bias", bool, False) or r.value("mlp_bias", bool, False):
        raise UserError(f"{where}: attention_bias / mlp_bias in a DeepSeek model are not supported")
    if r.value("attention_dropout", float, 0.0):
        raise UserError(f"{where}: attention_dropout in a DeepSeek model is not supported")
    if r.value("moe_layer_freq", int, 1) != 1:
        raise UserError(f"{where}: moe_layer_freq other than 1 (dense layers among the expert layers) is not supported")
    r.read.update(_INERT)
    heads = r.positive("num_attention_heads")
    mla = _mla(r)
    experts = r.positive("n_routed_experts", None) or 0
    moe = r.positive("moe_intermediate_size", None) or 0 if experts else 0
    r.read.add("moe_intermediate_size")
    spec = llama_spec(name, layers=r.positive("num_hidden_layers"), hidden=r.positive("hidden_size"), heads=heads,
                      kv_heads=r.positive("num_key_value_heads", None) or heads, ffn=r.positive("intermediate_size"),
                      vocab=r.positive("vocab_size"), max_pos=r.positive("max_position_embeddings", 4096),
                      source=where, norm_eps=r.value("rms_norm_eps", float, 1e-6), **_rope(r), **mla,
                      **(_experts(r, version, experts, moe) if experts else {}),
                      mtp_depth=r.value("num_nextn_predict_layers", int, 0))
    if r.value("tie_word_embeddings", bool, False):
        raise UserError(f"{where}: tie_word_embeddings in a DeepSeek model is not supported")
    return spec


def _mla(r: Any) -> dict[str, Any]:
    """The latent attention's ranks and head sizes; transformers 5's derived head_dim (the RoPE
    part) and qk_head_dim (both parts) must agree with them."""
    out = {"q_lora_rank": r.value("q_lora_rank", int | None, None) or 0,
           "kv_lora_rank": r.positive("kv_lora_rank"), "qk_nope_head_dim": r.positive("qk_nope_head_dim"),
           "qk_rope_head_dim": r.positive("qk_rope_head_dim"), "v_head_dim": r.positive("v_head_dim")}
    for key, expected in (("head_dim", out["qk_rope_head_dim"]),
                          ("qk_head_dim", out["qk_nope_head_dim"] + out["qk_rope_head_dim"])):
        if (got := r.value(key, int, expected)) != expected:
            raise UserError(f"{r.where}: {key} {got} disagrees with the head sizes (expected {expected})")
    return out


def _experts(r: Any, version: int, experts: int, moe: int) -> dict[str, Any]:
    method = r.value("topk_method", str, "noaux_tc" if version == 3 else "greedy")
    if method not in _TOPK_METHODS:
        raise UserError(f"{r.where}: topk_method {method!r} is not supported ({', '.join(_TOPK_METHODS)} are)")
    scoring = r.value("scoring_func", str, "sigmoid" if version == 3 else "softmax")
    if scoring not in ("softmax", "sigmoid"):
        raise UserError(f"{r.where}: scoring_func {scoring!r} is not supported (softmax and sigmoid are)")
    if method == "noaux_tc" and scoring != "sigmoid":
        raise UserError(f"{r.where}: topk_method noaux_tc needs scoring_func sigmoid")
    groups, topk_groups = r.value("n_group", int | None, None) or 1, r.value("topk_group", int | None, None) or 1
    if not _TOPK_METHODS[method]:
        groups = topk_groups = 1
    return dict(num_experts=experts, experts_per_token=r.positive("num_experts_per_tok"), moe_ffn_hidden_size=moe,
                # required: transformers' default (1, or 2 for V2) and DeepSeek's own (none) differ;
                # null is DeepSeek's none
                shared_expert_ffn_hidden_size=(r.value("n_shared_experts", int | None) or 0) * moe,
                first_k_dense=r.value("first_k_dense_replace", int, 0),
                router_scoring=RouterScoring(scoring), num_expert_groups=groups, topk_groups=topk_groups,
                routed_scaling_factor=r.value("routed_scaling_factor", float, 1.0),
                moe_norm_topk_prob=r.value("norm_topk_prob", bool, False),
                router_aux_loss_coef=r.value("aux_loss_alpha", float, 0.001))


def _rope(r: Any) -> dict[str, Any]:
    """rope_theta, and rope_scaling (transformers 4) or rope_parameters (5): default or YaRN."""
    params = r.value("rope_parameters", dict[str, Any], None)
    scaling = params if params is not None else r.value("rope_scaling", dict[str, Any], None)
    r.read.add("rope_scaling")
    theta = r.value("rope_theta", float, None)
    if scaling is not None:
        at = f"{r.where}: {'rope_parameters' if params is not None else 'rope_scaling'}"
        if unknown := sorted(set(scaling) - _ROPE_KEYS):
            raise UserError(f"{at}: keys this planner does not know: {', '.join(unknown)}")
        if (kind := scaling.get("rope_type", scaling.get("type", "default"))) not in ("default", "yarn"):
            raise UserError(f"{at}: rope_type {kind!r} is not supported (default and yarn are)")
        theta = inputs.value(scaling, "rope_theta", float, at, theta)
        if kind == "yarn":
            return {"rope_theta": theta if theta is not None else 10_000.0,
                    "yarn_factor": inputs.value(scaling, "factor", float, at, 1.0),
                    "yarn_mscale": inputs.value(scaling, "mscale", float, at, 1.0),
                    "yarn_mscale_all_dim": inputs.value(scaling, "mscale_all_dim", float, at, 0.0)}
    return {"rope_theta": theta if theta is not None else 10_000.0}
