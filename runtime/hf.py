"""Weights in Hugging Face `transformers` names and layouts, both ways.

A model trained by `planner run` can be handed to the ecosystem, and a published checkpoint
loaded into the runtime: `to_hf(model)` gives a state dict `LlamaForCausalLM` /
`MistralForCausalLM` / `GPT2LMHeadModel` load, `from_hf(model, state)` the reverse. Llama's
projections map one to one (transformers' q/k weights are already in the rotate-half order the
runtime's RoPE uses). GPT-2 stores its projections as Conv1D (transposed) and its fused QKV as
[all queries; all keys; all values], where the runtime keeps each head's query, key and value
together (Megatron's layout, costmodel.layout), so the rows are regrouped.
"""
from __future__ import annotations

import torch

from costmodel.specs import Arch
from runtime.model import Transformer

_LLAMA_LAYER = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
                "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
                "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj",
                "attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                # mixtures of experts (transformers 5: Mixtral, Qwen2-MoE)
                "mlp.router": "mlp.gate", "mlp.shared.w1": "mlp.shared_expert.gate_proj",
                "mlp.shared.w3": "mlp.shared_expert.up_proj", "mlp.shared.w2": "mlp.shared_expert.down_proj",
                "mlp.shared_gate": "mlp.shared_expert_gate"}
# stacked expert weights: transformers 5 keeps each expert's gate and up projections in one
# (experts, 2f, h) tensor, gate first
_EXPERTS = {"mlp.w1": ("mlp.experts.gate_up_proj", 0), "mlp.w3": ("mlp.experts.gate_up_proj", 1),
            "mlp.w2": ("mlp.experts.down_proj", None)}
_GPT_LAYER = {"attention.qkv": "attn.c_attn", "attention.proj": "attn.c_proj", "mlp.fc1": "mlp.c_fc",
              "mlp.fc2": "mlp.c_proj", "attention_norm": "ln_1", "mlp_norm": "ln_2"}
_GPT_CONV1D = ("attention.qkv", "attention.proj", "mlp.fc1", "mlp.fc2")   # stored transposed


def _names(model: Transformer) -> dict[str, str]:
    """runtime name -> transformers name, for every parameter of the whole model."""
    llama = model.spec.arch is Arch.LLAMA
    top = ({"embed.tok.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"} if llama else
           {"embed.tok.weight": "transformer.wte.weight", "embed.pos.weight": "transformer.wpe.weight",
            "norm.weight": "transformer.ln_f.weight", "norm.bias": "transformer.ln_f.bias",
            "output.weight": "lm_head.weight"})
    layer_map, prefix = (_LLAMA_LAYER, "model.layers") if llama else (_GPT_LAYER, "transformer.h")
    out = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name in top:
            out[name] = top[name]
            continue
        _, index, rest = name.split(".", 2)          # layers.<i>.<module path>.<weight|bias>
        if model.spec.is_moe and rest in _EXPERTS:
            out[name] = f"{prefix}.{index}.{_EXPERTS[rest][0]}"
            continue
        module, kind = rest.rsplit(".", 1)
        out[name] = f"{prefix}.{index}.{layer_map[module]}.{kind}"
    return out


def _gpt_qkv_order(model: Transformer) -> torch.Tensor:
    """Row i of the runtime's fused QKV is row order[i] of transformers' c_attn output."""
    h, d = model.spec.hidden_size, model.spec.head_dim
    heads = model.spec.num_heads
    rows = [part * h + head * d + torch.arange(d) for head in range(heads) for part in range(3)]
    return torch.cat(rows)


def to_hf(model: Transformer) -> dict[str, torch.Tensor]:
    """The whole model's weights under transformers' names and layouts."""
    own = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, torch.Tensor] = {}
    halves: dict[str, list[torch.Tensor | None]] = {}
    for name, hf_name in _names(model).items():
        w = own[name].detach()
        half = _expert_half(model, name)
        if half is not None:   # gate and up of every expert, joined below
            halves.setdefault(hf_name, [None, None])[half] = w
            continue
        if model.spec.arch is Arch.GPT:
            module = name.split(".", 2)[-1].rsplit(".", 1)[0] if name.startswith("layers.") else ""
            if module == "attention.qkv":
                w = w[torch.argsort(_gpt_qkv_order(model))]   # back to [queries; keys; values]
            if module in _GPT_CONV1D and name.endswith("weight"):
                w = w.t()
        out[hf_name] = w.contiguous()
    out.update({hf_name: torch.cat(pair, dim=1) for hf_name, pair in halves.items()})
    return out


def _expert_half(model: Transformer, name: str) -> int | None:
    """0 or 1 for a stacked gate or up projection (one half of transformers' gate_up_proj)."""
    if not model.spec.is_moe or not name.startswith("layers."):
        return None
    entry = _EXPERTS.get(name.split(".", 2)[2])
    return None if entry is None else entry[1]


@torch.no_grad()
def from_hf(model: Transformer, state: dict[str, torch.Tensor]) -> None:
    """Copy transformers' weights into the runtime's model (same spec); every parameter must be
    found, with its shape, or this raises naming it."""
    own = dict(model.named_parameters(remove_duplicate=False))
    for name, hf_name in _names(model).items():
        if hf_name not in state:
            if name == "output.weight" and model.spec.tied_embeddings:
                continue   # tied: the embedding is the output layer
            raise KeyError(f"{hf_name} (for {name}) is not in the state dict")
        w = state[hf_name]
        if (half := _expert_half(model, name)) is not None:
            f = model.spec.moe_ffn_hidden_size
            w = w[:, half * f:(half + 1) * f]
        if model.spec.arch is Arch.GPT and name.startswith("layers."):
            module = name.split(".", 2)[-1].rsplit(".", 1)[0]
            if module in _GPT_CONV1D and name.endswith("weight"):
                w = w.t()
            if module == "attention.qkv":
                w = w[_gpt_qkv_order(model)]
        if w.shape != own[name].shape:
            raise ValueError(f"{hf_name}: shape {tuple(w.shape)}, but {name} is {tuple(own[name].shape)}")
        own[name].copy_(w)
