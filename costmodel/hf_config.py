"""Hugging Face `config.json` -> ModelSpec, strictly.

Every key is either read (and checked), known to change nothing the planner prices or the
runtime computes (token ids, dtype, cache flags, ...), or named in an error: a key this reader
does not know may change the cost, so it is never skipped in silence. What the planner does not
model (biases on some projections but Qwen2's Q/K/V, RoPE scalings other than Llama 3.1's, dropout in a
Llama-style model) is refused by name.
"""
from __future__ import annotations

import re
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from costmodel import inputs
from costmodel.hf_deepseek import deepseek
from costmodel.inputs import UserError, read_json_object
from costmodel.registry import gpt_spec, llama_spec
from costmodel.specs import Arch, FfnKind, ModelSpec, NormKind, PositionKind

# keys that change neither the cost nor the runtime's numerics (besides *_token_id(s))
_INERT = {"_name_or_path", "output_router_logits", "architectures", "model_type", "transformers_version", "torch_dtype", "dtype",
          "use_cache", "initializer_range", "pretraining_tp", "output_attentions", "output_hidden_states",
          "return_dict", "_attn_implementation_autoset", "attn_implementation", "id2label", "label2id",
          "tokenizer_class", "problem_type", "auto_map", "quantization_config"}


# the spec's names for the config keys its own checks name (costmodel.specs.ModelSpec)
_CONFIG_KEYS = {"num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
                "experts_per_token": "num_experts_per_tok", "num_layers": "num_hidden_layers",
                "ffn_hidden_size": "intermediate_size"}


def model_from_hf_config(path: Path) -> ModelSpec:
    """A config.json file; the model is named after its folder (a Hugging Face snapshot's), or
    after the file where it is not called config.json."""
    name = path.parent.name if path.stem == "config" else path.stem
    return model_from_hf_dict(read_json_object(path, "model config"), str(path), name or path.stem)


def model_from_hf_dict(cfg: dict[str, Any], where: str = "model config", name: str = "") -> ModelSpec:
    """A Hugging Face config (config.json's object); `where` names it in errors, `name` is the
    model's name when the config has no `_name_or_path`."""
    if not isinstance(cfg, dict):
        raise UserError(f"{where}: expected a JSON object (a Hugging Face config), got {type(cfg).__name__}")
    kind = inputs.value(cfg, "model_type", str, where, "")
    name = inputs.value(cfg, "_name_or_path", str, where, "") or name or kind or "model"
    readers = {"llama": _llama, "mistral": _llama, "mixtral": _mixtral, "qwen2": _qwen2, "qwen2_moe": _qwen2_moe,
               "phi3": _phi3, "gemma": _gemma, "gpt2": _gpt2, "gpt_neox": _gpt_neox, "falcon": _falcon,
               "qwen3": _qwen3, "qwen3_moe": _qwen3_moe,
               "deepseek_v2": partial(deepseek, version=2), "deepseek_v3": partial(deepseek, version=3)}
    if not kind:
        raise UserError(f"{where}: no model_type (a Hugging Face config names its architecture there; "
                        f"supported: {', '.join(readers)})")
    if kind not in readers:
        raise UserError(f"{where}: model_type {kind!r} is not supported (supported: {', '.join(readers)})")
    reader = _Reader(cfg, where)
    try:
        spec = readers[kind](name, reader)
    except ValueError as exc:   # the readers' own errors name the file; the spec's checks do not
        text = str(exc)
        if text.startswith(where):
            raise
        for field, key in _CONFIG_KEYS.items():
            text = re.sub(rf"\b{field}\b", key, text)
        raise UserError(f"{where}: {text}") from None
    reader.refuse_unread()
    return spec


class _Reader:
    """The config's keys, remembering which were read so that the rest can be named."""

    def __init__(self, cfg: dict[str, Any], where: str) -> None:
        self.cfg, self.where, self.read = cfg, where, set()

    def value(self, key: str, kind: Any, default: Any = inputs.MISSING) -> Any:
        self.read.add(key)
        return inputs.value(self.cfg, key, kind, self.where, default)

    def positive(self, key: str, default: Any = inputs.MISSING) -> int | None:
        self.read.add(key)
        return inputs.positive_field(self.cfg, key, self.where, default)

    def refuse_unread(self) -> None:
        unknown = sorted(k for k in self.cfg if k not in self.read and k not in _INERT
                         and not k.endswith(("_token_id", "_token_ids")))
        if unknown:
            raise UserError(f"{self.where}: keys this planner does not know, which may change the cost: "
                             f"{', '.join(unknown)} (remove those that change nothing)")


def _llama(name: str, r: _Reader, *, window: bool = True, gated_act: str = "silu") -> ModelSpec:
    """`gated_act`: the gate's activation the caller has read and checked itself (Gemma's)."""
    where = r.where
    if gated_act == "silu" and (act := r.value("hidden_act", str, "silu")) != "silu":
        raise UserError(f"{where}: hidden_act {act!r} is not SwiGLU (silu)")
    if r.value("attention_bias", bool, False) or r.value("mlp_bias", bool, False):
        raise UserError(f"{where}: llama-style models with biases are not supported")
    if r.value("attention_dropout", float, 0.0):
        raise UserError(f"{where}: attention_dropout in a llama-style model is not supported")
    heads, hidden = r.positive("num_attention_heads"), r.positive("hidden_size")
    head_dim = r.positive("head_dim", None)
    sized_apart = head_dim if head_dim is not None and head_dim * heads != hidden else None
    spec = llama_spec(name, layers=r.positive("num_hidden_layers"), hidden=hidden, heads=heads,
                      kv_heads=r.positive("num_key_value_heads", None) or heads,
                      ffn=r.positive("intermediate_size"), vocab=r.positive("vocab_size"),
                      max_pos=r.positive("max_position_embeddings", 4096), source=where,
                      # transformers' LlamaConfig / MistralConfig default
                      norm_eps=r.value("rms_norm_eps", float, 1e-6), **_rope(r),
                      sliding_window=_sliding_window(r) if window else None, explicit_head_dim=sized_apart)
    if r.value("tie_word_embeddings", bool, False):
        spec = replace(spec, tied_embeddings=True)
    return spec


def _qwen2(name: str, r: _Reader) -> ModelSpec:
    """Llama's layout with biases on the Q, K and V projections (transformers' Qwen2Attention);
    its sliding window is off unless `use_sliding_window`."""
    r.read.add("max_window_layers")   # which layers would use the window: only with use_sliding_window
    if (kinds := r.value("layer_types", list[str], None)) and set(kinds) != {"full_attention"}:
        raise UserError(f"{r.where}: layer_types other than full_attention are not supported")
    if r.value("use_sliding_window", bool, False):
        raise UserError(f"{r.where}: use_sliding_window (per-layer windows) is not supported")
    r.read.add("sliding_window")
    return replace(_llama(name, r, window=False), qkv_bias=True)


def _gemma(name: str, r: _Reader) -> ModelSpec:
    """Llama's layout with a tanh-GeLU gate (GeGLU), embeddings scaled by sqrt(hidden), RMSNorm
    scales stored as w and applied as 1 + w, and tied embeddings (transformers' GemmaForCausalLM)."""
    act = r.value("hidden_activation", str, None) or r.value("hidden_act", str, "gelu_pytorch_tanh")
    r.read.update({"hidden_act", "hidden_activation"})
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UserError(f"{r.where}: hidden_activation {act!r} is not the tanh GeLU Gemma uses")
    spec = _llama(name, r, gated_act=act)
    return replace(spec, ffn_kind=FfnKind.GEGLU, scale_embeddings=True, norm_unit_offset=True,
                   tied_embeddings=r.value("tie_word_embeddings", bool, True))


def _phi3(name: str, r: _Reader) -> ModelSpec:
    """Llama's computation with Q, K, V fused into one projection and gate and up into another
    (runtime/hf.py splits them); its dropout rates must be zero (the runtime has none for it)."""
    for key in ("resid_pdrop", "embd_pdrop"):
        if r.value(key, float, 0.0):
            raise UserError(f"{r.where}: {key} in a Phi-3 model is not supported")
    # the context length before RoPE scaling: only a scaling reads it, and _rope refuses those
    r.read.add("original_max_position_embeddings")
    return _llama(name, r)


def _mixtral(name: str, r: _Reader) -> ModelSpec:
    """Mistral's layout with `num_local_experts` experts of `intermediate_size` in every layer."""
    if r.value("router_jitter_noise", float, 0.0):
        raise UserError(f"{r.where}: router_jitter_noise is not supported")
    spec = _llama(name, r)
    return replace(spec, num_experts=r.positive("num_local_experts"), experts_per_token=r.positive("num_experts_per_tok"),
                   moe_ffn_hidden_size=spec.ffn_hidden_size,
                   router_aux_loss_coef=r.value("router_aux_loss_coef", float, 0.001))


def _qwen2_moe(name: str, r: _Reader) -> ModelSpec:
    """Qwen2 with a mixture in every layer: routed experts of `moe_intermediate_size`, a shared
    expert of `shared_expert_intermediate_size` behind a sigmoid gate, top-k weights kept as
    probabilities unless `norm_topk_prob`. `intermediate_size` is the width of dense layers,
    which a config with every layer sparse (decoder_sparse_step 1, no mlp_only_layers) has none of."""
    if r.value("decoder_sparse_step", int, 1) != 1 or r.value("mlp_only_layers", list[int], []):
        raise UserError(f"{r.where}: dense layers among the expert layers (decoder_sparse_step, "
                         "mlp_only_layers) are not supported")
    if not r.value("qkv_bias", bool, True):
        raise UserError(f"{r.where}: qkv_bias false is not supported")
    moe = r.positive("moe_intermediate_size")
    # transformers' Qwen2MoeSparseMoeBlock always builds the shared expert, its width defaulting
    # to 5632 where a config leaves it out: read as stated, never as none
    shared = r.positive("shared_expert_intermediate_size")
    spec = _qwen2(name, r)
    return replace(spec, ffn_hidden_size=moe, num_experts=r.positive("num_experts"),
                   experts_per_token=r.positive("num_experts_per_tok"), moe_ffn_hidden_size=moe,
                   shared_expert_ffn_hidden_size=shared, shared_expert_gate=bool(shared),
                   moe_norm_topk_prob=r.value("norm_topk_prob", bool, False),
                   router_aux_loss_coef=r.value("router_aux_loss_coef", float, 0.001))


def _rope(r: _Reader) -> dict[str, Any]:
    """rope_theta and rope_scaling (transformers 4), or rope_parameters (transformers 5)."""
    params = r.value("rope_parameters", dict[str, Any], None)
    scaling = r.value("rope_scaling", dict[str, Any], None)
    theta = r.value("rope_theta", float, None)
    if params is not None:
        theta = inputs.value(params, "rope_theta", float, f"{r.where}: rope_parameters", theta)
        scaling = params
    out: dict[str, Any] = {"rope_theta": theta if theta is not None else 10_000.0}
    if scaling is None:
        return out
    at = f"{r.where}: {'rope_parameters' if params is not None else 'rope_scaling'}"
    known = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "partial_rotary_factor"}
    if unknown := sorted(set(scaling) - known):
        raise UserError(f"{at}: keys this planner does not know: {', '.join(unknown)}")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise UserError(f"{at}: partial_rotary_factor {scaling['partial_rotary_factor']} (RoPE on part of "
                         "each head) is not supported")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return out
    if kind != "llama3":
        raise UserError(f"{at}: rope_type {kind!r} is not supported (default and llama3 are)")
    return {**out, "rope_scaling_factor": inputs.value(scaling, "factor", float, at),
            "rope_low_freq_factor": inputs.value(scaling, "low_freq_factor", float, at),
            "rope_high_freq_factor": inputs.value(scaling, "high_freq_factor", float, at),
            "rope_original_max_positions": inputs.positive_field(scaling, "original_max_position_embeddings", at)}


def _sliding_window(r: _Reader) -> int | None:
    return r.positive("sliding_window", None)


def _gpt2(name: str, r: _Reader) -> ModelSpec:
    hidden = r.positive("n_embd")
    if (act := r.value("activation_function", str, "gelu_new")) not in ("gelu_new", "gelu_pytorch_tanh"):
        raise UserError(f"{r.where}: activation_function {act!r} is not the tanh GeLU the runtime uses")
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if r.value(key, bool, False):
            raise UserError(f"{r.where}: {key} is not supported")
    if not r.value("scale_attn_weights", bool, True):
        raise UserError(f"{r.where}: attention without 1/sqrt(head size) scaling is not supported")
    # dropout rates (the runtime uses Megatron's 0.1 for GPT), the classification summary head
    # and n_ctx (n_positions is read) change neither the cost nor the language model
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_type", "summary_use_proj",
                "summary_activation", "summary_proj_to_labels", "summary_first_dropout", "n_ctx"):
        r.read.add(key)
    spec = gpt_spec(name, layers=r.positive("n_layer"), hidden=hidden, heads=r.positive("n_head"),
                    vocab=r.positive("vocab_size"), max_pos=r.positive("n_positions"),
                    ffn=r.positive("n_inner", None) or 4 * hidden, source=r.where)
    return replace(spec, norm_eps=r.value("layer_norm_epsilon", float, 1e-5))


def _gpt_neox(name: str, r: _Reader) -> ModelSpec:
    """transformers' GPTNeoXForCausalLM (Pythia, GPT-NeoX-20B): LayerNorm, biases, fused QKV per
    head, a GeLU MLP, untied embeddings, attention and MLP in parallel on the layer input, RoPE
    on part of each head."""
    act = r.value("hidden_act", str, "gelu")
    kinds = {"gelu": FfnKind.GELU_ERF, "gelu_new": FfnKind.GELU, "gelu_pytorch_tanh": FfnKind.GELU}
    if act not in kinds:
        raise UserError(f"{r.where}: hidden_act {act!r} is not supported ({', '.join(kinds)} are)")
    for key in ("attention_dropout", "hidden_dropout"):
        if r.value(key, float, 0.0):
            raise UserError(f"{r.where}: {key} in a GPT-NeoX model is not supported")
    r.read.add("classifier_dropout")   # the sequence-classification head's
    if not r.value("attention_bias", bool, True):
        raise UserError(f"{r.where}: attention_bias false is not supported")
    if r.value("rope_scaling", dict[str, Any], None):
        raise UserError(f"{r.where}: rope_scaling in a GPT-NeoX model is not supported")
    fraction, theta = r.value("rotary_pct", float, 0.25), r.value("rotary_emb_base", float, 10_000.0)
    if (params := r.value("rope_parameters", dict[str, Any], None)) is not None:   # transformers 5
        at = f"{r.where}: rope_parameters"
        if unknown := sorted(set(params) - {"rope_type", "rope_theta", "partial_rotary_factor"}):
            raise UserError(f"{at}: keys this planner does not know: {', '.join(unknown)}")
        if params.get("rope_type", "default") != "default":
            raise UserError(f"{at}: rope_type {params['rope_type']!r} is not supported (default is)")
        fraction = inputs.value(params, "partial_rotary_factor", float, at, fraction)
        theta = inputs.value(params, "rope_theta", float, at, theta)
    heads = r.positive("num_attention_heads")
    return ModelSpec(name=name, arch=Arch.GPT, num_layers=r.positive("num_hidden_layers"),
                     hidden_size=r.positive("hidden_size"), num_heads=heads, num_kv_heads=heads,
                     ffn_hidden_size=r.positive("intermediate_size"), ffn_kind=kinds[act],
                     vocab_size=r.positive("vocab_size"), tied_embeddings=r.value("tie_word_embeddings", bool, False),
                     norm_kind=NormKind.LAYERNORM, position_kind=PositionKind.ROPE,
                     max_position_embeddings=r.positive("max_position_embeddings", 2048), bias=True, dropout=False,
                     source=r.where, rope_theta=theta, norm_eps=r.value("layer_norm_eps", float, 1e-5),
                     parallel_residual=r.value("use_parallel_residual", bool, True), rotary_fraction=fraction)


def _falcon(name: str, r: _Reader) -> ModelSpec:
    """transformers' FalconForCausalLM: LayerNorm, no biases on the projections, a fused QKV
    grouped per key/value head (multi-query: one), exact GeLU, tied embeddings, RoPE; attention
    and MLP in parallel from one norm (Falcon-7B), from two (the new decoder architecture of
    40B/180B), or in sequence (parallel_attn false)."""
    where = r.where
    if r.value("alibi", bool, False):
        raise UserError(f"{where}: alibi positions are not supported (RoPE is)")
    if (act := r.value("activation", str, "gelu")) != "gelu":
        raise UserError(f"{where}: activation {act!r} is not supported (gelu is)")
    for key in ("attention_dropout", "hidden_dropout"):
        if r.value(key, float, 0.0):
            raise UserError(f"{where}: {key} in a Falcon model is not supported")
    if r.value("bias", bool, False):
        raise UserError(f"{where}: bias true (biases on every projection) is not supported for Falcon")
    if r.value("apply_residual_connection_post_layernorm", bool, False):
        raise UserError(f"{where}: apply_residual_connection_post_layernorm is not supported")
    theta = _rope(r)["rope_theta"]   # refuses scalings
    heads, hidden = r.positive("num_attention_heads"), r.positive("hidden_size")
    new_arch = r.value("new_decoder_architecture", bool, False)
    multi_query = r.value("multi_query", bool, True)
    kv = r.positive("num_kv_heads", None) if new_arch else (1 if multi_query else heads)
    r.read.add("num_kv_heads")
    parallel = r.value("parallel_attn", bool, True) or new_arch
    norms = r.value("num_ln_in_parallel_attn", int, None)
    shared = parallel and ((not new_arch) or norms == 1)
    return ModelSpec(name=name, arch=Arch.GPT, num_layers=r.positive("num_hidden_layers"), hidden_size=hidden,
                     num_heads=heads, num_kv_heads=kv or heads, ffn_hidden_size=r.positive("ffn_hidden_size", None) or 4 * hidden,
                     ffn_kind=FfnKind.GELU_ERF, vocab_size=r.positive("vocab_size"),
                     tied_embeddings=r.value("tie_word_embeddings", bool, True), norm_kind=NormKind.LAYERNORM,
                     position_kind=PositionKind.ROPE, max_position_embeddings=r.positive("max_position_embeddings", 2048),
                     bias=False, dropout=False, source=where, rope_theta=theta,
                     norm_eps=r.value("layer_norm_epsilon", float, 1e-5), parallel_residual=parallel,
                     shared_norm=shared)


def _qwen3(name: str, r: _Reader) -> ModelSpec:
    """Qwen2's layout without Q/K/V biases, with an RMSNorm over each head's queries and keys
    (transformers' Qwen3Attention q_norm / k_norm) and heads of `head_dim` (128 unless said)."""
    r.read.add("max_window_layers")
    if (kinds := r.value("layer_types", list[str], None)) and set(kinds) != {"full_attention"}:
        raise UserError(f"{r.where}: layer_types other than full_attention are not supported")
    if r.value("use_sliding_window", bool, False):
        raise UserError(f"{r.where}: use_sliding_window (per-layer windows) is not supported")
    r.read.add("sliding_window")
    if "head_dim" not in r.cfg:   # Qwen3Config's default
        r.cfg = {**r.cfg, "head_dim": 128}
    return replace(_llama(name, r, window=False), qk_norm=True)


def _qwen3_moe(name: str, r: _Reader) -> ModelSpec:
    """Qwen3 with a mixture in every layer: routed experts of `moe_intermediate_size`, no shared
    expert, top-k weights renormalised where `norm_topk_prob`."""
    if r.value("decoder_sparse_step", int, 1) != 1 or r.value("mlp_only_layers", list[int], []):
        raise UserError(f"{r.where}: dense layers among the expert layers (decoder_sparse_step, "
                         "mlp_only_layers) are not supported")
    moe = r.positive("moe_intermediate_size")
    experts = r.positive("num_experts", None) or r.positive("num_local_experts")
    r.read.update({"num_experts", "num_local_experts"})
    spec = _qwen3(name, r)
    return replace(spec, ffn_hidden_size=moe, num_experts=experts, experts_per_token=r.positive("num_experts_per_tok"),
                   moe_ffn_hidden_size=moe, moe_norm_topk_prob=r.value("norm_topk_prob", bool, False),
                   router_aux_loss_coef=r.value("router_aux_loss_coef", float, 0.001))
