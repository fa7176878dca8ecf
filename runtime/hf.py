"""Weights in Hugging Face `transformers` names and layouts, both ways.

A model trained by `planner run` can be handed to the ecosystem, and a published checkpoint
loaded into the runtime: `to_hf(model)` gives a state dict `LlamaForCausalLM` /
`MistralForCausalLM` / `GPT2LMHeadModel` / `GPTNeoXForCausalLM` (and the other types
costmodel.hf_config reads) load, `from_hf(model, state)` the reverse. Llama's
projections map one to one (transformers' q/k weights are already in the rotate-half order the
runtime's RoPE uses). GPT-2 stores its projections as Conv1D (transposed) and its fused QKV as
[all queries; all keys; all values], where the runtime keeps each head's query, key and value
together (Megatron's layout, costmodel.layout), so the rows are regrouped.
"""
from __future__ import annotations

import torch

from costmodel.inputs import UserError
from costmodel.specs import Arch, PositionKind
from runtime.model import Transformer

_LLAMA_LAYER = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj",
                "attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",   # Qwen3
                # mixtures of experts (transformers 5: Mixtral, Qwen2-MoE)
                "mlp.router": "mlp.gate", "mlp.shared.w1": "mlp.shared_expert.gate_proj",
                "mlp.shared.w3": "mlp.shared_expert.up_proj", "mlp.shared.w2": "mlp.shared_expert.down_proj",
                "mlp.shared_gate": "mlp.shared_expert_gate"}
_GPT_LAYER = {"attention.qkv": "attn.c_attn", "attention.proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc",
              "mlp.fc2": "mlp.c_proj", "attention_norm": "ln_1", "mlp_norm": "ln_2"}
_GPT_CONV1D = ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2")   # stored transposed
# GPT-NeoX: plain Linear layers, its fused QKV already [q, k, v] per head as the runtime keeps it
_NEOX_LAYER = {"attention.qkv": "attention.query_key_value", "attention.proj": "attention.dense",
               "mlp.fc1": "mlp.dense_h_to_4h", "mlp.fc2": "mlp.dense_4h_to_h", "attention_norm": "input_layernorm",
               "mlp_norm": "post_attention_layernorm"}


# Falcon: one norm for both branches (7B), two (ln_attn/ln_mlp, the new decoder architecture), or
# two in sequence; its fused QKV is grouped per key/value head, as the runtime keeps it
_FALCON_LAYER = {"attention.qkv": "self_attention.query_key_value", "attention.proj": "self_attention.dense",
                 "mlp.fc1": "mlp.dense_h_to_4h", "mlp.fc2": "mlp.dense_4h_to_h"}


def _falcon_norms(model: Transformer) -> dict[str, str]:
    spec = model.spec
    if spec.shared_norm:
        return {"attention_norm": "input_layernorm"}
    if spec.parallel_residual:
        return {"attention_norm": "ln_attn", "mlp_norm": "ln_mlp"}
    return {"attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


def _gpt2(model: Transformer) -> bool:
    """GPT-2's names and Conv1D layouts (the gpt-arch types with rotary positions are GPT-NeoX's
    names by default, Falcon's with model_type="falcon")."""
    return model.spec.arch is Arch.GPT and model.spec.position_kind is not PositionKind.ROPE


def _fused(model: Transformer, fused_projections: bool) -> dict[str, tuple[str, int, int, tuple[int, ...]]]:
    """Runtime tensors that are a part of one transformers tensor: module path -> (its name there,
    the dimension the parts are stacked on, which part, every part's width). Transformers 5
    stacks experts ((experts, 2f, h) with gate first, and (experts, h, f)); Phi-3 fuses Q, K and V
    into qkv_proj and gate and up into gate_up_proj."""
    spec, out = model.spec, {}
    if spec.is_moe:
        f = spec.moe_ffn_hidden_size
        out.update({"mlp.experts.w1": ("mlp.experts.gate_up_proj", 1, 0, (f, f)),
                    "mlp.experts.w3": ("mlp.experts.gate_up_proj", 1, 1, (f, f)),
                    "mlp.experts.w2": ("mlp.experts.down_proj", 0, 0, (spec.num_experts,))})
    if fused_projections:
        qkv, gate_up = (spec.q_hidden_size, spec.kv_hidden_size, spec.kv_hidden_size), (spec.ffn_hidden_size,) * 2
        out.update({"attention.wq.weight": ("self_attn.qkv_proj.weight", 0, 0, qkv),
                    "attention.wk.weight": ("self_attn.qkv_proj.weight", 0, 1, qkv),
                    "attention.wv.weight": ("self_attn.qkv_proj.weight", 0, 2, qkv),
                    "mlp.w1.weight": ("mlp.gate_up_proj.weight", 0, 0, gate_up),
                    "mlp.w3.weight": ("mlp.gate_up_proj.weight", 0, 1, gate_up)})
    return out


def _names(model: Transformer, fused_projections: bool = False,
           model_type: str | None = None) -> dict[str, tuple[str, tuple | None]]:
    """runtime name -> (transformers name, the part it is of a fused tensor or None), for every
    parameter of the whole model (`model_type` "falcon": Falcon's names for a gpt-arch model)."""
    if model.spec.is_mla or model.spec.first_k_dense or model.spec.router_scoring == "sigmoid":
        # their names, the routers' balancing biases (buffers) and RoPE's interleaved pairs are not mapped
        raise UserError(f"model {model.spec.name}: DeepSeek checkpoints are not converted to or from transformers' names")
    if model_type == "falcon":
        top = {"embed.tok.weight": "transformer.word_embeddings.weight", "norm.weight": "transformer.ln_f.weight",
               "norm.bias": "transformer.ln_f.bias", "output.weight": "lm_head.weight"}
        layer_map, prefix = {**_FALCON_LAYER, **_falcon_norms(model)}, "transformer.h"
    elif model.spec.arch is Arch.LLAMA:
        top = {"embed.tok.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}
        layer_map, prefix = _LLAMA_LAYER, "model.layers"
    elif _gpt2(model):
        top = {"embed.tok.weight": "transformer.wte.weight", "embed.pos.weight": "transformer.wpe.weight",
               "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias",
               "output.weight": "lm_head.weight"}
        layer_map, prefix = _GPT_LAYER, "transformer.h"
    else:
        top = {"embed.tok.weight": "gpt_neox.embed_in.weight", "norm.weight": "gpt_neox.final_layer_norm.weight",
               "norm.bias": "gpt_neox.final_layer_norm.bias", "output.weight": "lm_head.weight"}
        layer_map, prefix = _NEOX_LAYER, "gpt_neox.layers"
    fused = _fused(model, fused_projections)
    out = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name in top:
            out[name] = (top[name], None)
            continue
        _, index, rest = name.split(".", 2)          # layers.<i>.<module path>.<weight|bias>
        if rest in fused:
            out[name] = (f"{prefix}.{index}.{fused[rest][0]}", fused[rest][1:])
            continue
        module, kind = rest.rsplit(".", 1)
        out[name] = (f"{prefix}.{index}.{layer_map[module]}.{kind}", None)
    return out


def _gpt_qkv_order(model: Transformer) -> torch.Tensor:
    """Row i of the runtime's fused QKV is row order[i] of transformers' c_attn output."""
    h, d = model.spec.hidden_size, model.spec.head_dim
    heads = model.spec.num_heads
    rows = [part * h + head * d + torch.arange(d) for head in range(heads) for part in range(3)]
    return torch.cat(rows)


def to_hf(model: Transformer, *, fused_projections: bool = False, model_type: str | None = None) -> dict[str, torch.Tensor]:
    """The whole model's weights under transformers' names and layouts (`fused_projections`:
    Phi-3's qkv_proj and gate_up_proj; `model_type` "falcon": Falcon's names)."""
    own = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, tuple[int, dict[int, torch.Tensor]]] = {}
    for name, (hf_name, part) in _names(model, fused_projections, model_type).items():
        w = own[name].detach()
        if part is not None:   # joined below
            dim, which, _ = part
            parts.setdefault(hf_name, (dim, {}))[1][which] = w
            continue
        if _gpt2(model):
            module = name.split(".", 2)[-1].rsplit(".", 1)[0] if name.startswith("layers.") else ""
            if module == "attention.qkv":
                w = w[torch.argsort(_gpt_qkv_order(model))]   # back to [queries; keys; values]
            if module in _GPT_CONV1D and name.endswith("weight"):
                w = w.t()
        out[hf_name] = w.contiguous()
    out.update({hf_name: torch.cat([pieces[i] for i in sorted(pieces)], dim=dim)
                for hf_name, (dim, pieces) in parts.items()})
    return out


@torch.no_grad()
def from_hf(model: Transformer, state: dict[str, torch.Tensor]) -> None:
    """Copy transformers' weights into the runtime's model (same spec; Phi-3's fused projections
    are recognised by name); every parameter must be found, with its shape, or this raises naming it."""
    own = dict(model.named_parameters(remove_duplicate=False))
    fused_projections = any(k.endswith("self_attn.qkv_proj.weight") for k in state)
    model_type = "falcon" if "transformer.word_embeddings.weight" in state else None
    for name, (hf_name, part) in _names(model, fused_projections, model_type).items():
        if hf_name not in state:
            if name == "output.weight" and model.spec.tied_embeddings:
                continue   # tied: the embedding is the output layer
            raise KeyError(f"{hf_name} (for {name}) is not in the state dict")
        w = state[hf_name]
        if part is not None:
            dim, which, widths = part
            w = w.split(list(widths), dim=dim)[which] if len(widths) > 1 else w
        if _gpt2(model) and name.startswith("layers."):
            module = name.split(".", 2)[-1].rsplit(".", 1)[0]
            if module in _GPT_CONV1D and name.endswith("weight"):
                w = w.t()
            if module == "attention.qkv":
                w = w[_gpt_qkv_order(model)]
        if w.shape != own[name].shape:
            raise UserError(f"{hf_name}: shape {tuple(w.shape)}, but {name} is {tuple(own[name].shape)}")
        own[name].copy_(w)
