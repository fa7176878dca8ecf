"""DeepSeek-V3 and DeepSeek-V2-Lite: their published config.json files read whole and counted
exactly as transformers builds them (on the meta device); the MTP module, which transformers'
model does not build, counted apart to DeepSeek's published 11.5B (14B with the embedding and
head it shares). (`transformers` is in the test extra; without it these tests are skipped.)"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from costmodel.hf_config import model_from_hf_dict
from costmodel.params import active_params, mtp_params, mtp_stored_params, total_params
from costmodel.registry import resolve_model
from runtime.model import Transformer

transformers = pytest.importorskip("transformers")

# deepseek-ai/DeepSeek-V3's config.json (quantization_config and auto_map as published: inert)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280}

# deepseek-ai/DeepSeek-V2-Lite's config.json
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                 "AutoModel": "modeling_deepseek.DeepseekV2Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 100000, "eos_token_id": 100001, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64,
    "n_shared_experts": 2, "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
    "num_hidden_layers": 27, "num_key_value_heads": 16, "pretraining_tp": 1, "q_lora_rank": None,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400}


def _theirs(cfg: dict, cls_name: str):
    """transformers' model of `cfg` on the meta device (no weights allocated)."""
    kind = cfg["model_type"]
    config = transformers.AutoConfig.for_model(kind, **{k: v for k, v in cfg.items()
                                                        if k not in ("model_type", "auto_map", "quantization_config")})
    with torch.device("meta"):
        return getattr(transformers, cls_name)(config)


@pytest.mark.parametrize("cfg, cls_name, registry", [
    (DEEPSEEK_V3, "DeepseekV3ForCausalLM", "deepseek-v3"),
    (DEEPSEEK_V2_LITE, "DeepseekV2ForCausalLM", "deepseek-v2-lite"),
], ids=["deepseek_v3", "deepseek_v2_lite"])
def test_deepseek_configs_count_exactly_as_transformers(tmp_path, cfg, cls_name, registry):
    """MLA, dense first layers, shared and routed experts: read whole, counted exactly."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    spec = resolve_model(str(path))
    theirs = _theirs(cfg, cls_name)
    assert total_params(spec) == theirs.num_parameters()
    ours = resolve_model(registry)
    assert dataclasses.replace(spec, name=ours.name, source=ours.source) == ours
    # as transformers 5 writes it back (rope_parameters, head_dim = the RoPE part, qk_head_dim, ...)
    written = json.loads(theirs.config.to_json_string())
    assert dataclasses.replace(model_from_hf_dict(written, "written"), name=ours.name, source=ours.source) == ours


def test_deepseek_totals_are_deepseeks():
    """DeepSeek-V3's README_WEIGHTS.md: 671B in the main model, 36.6B of them active without the
    embedding; the MTP module "11.5B unique parameters" (its layer, 11.51B, and 0.10B of
    projection: 11.61B here), stored with a copy of the embedding and head (0.93B each) for the
    685B the checkpoint holds (with its float8 scales, 671/128² = 0.04B)."""
    v3 = resolve_model("deepseek-v3")
    embedding = v3.vocab_size * v3.hidden_size
    assert round(total_params(v3) / 1e9) == 671
    assert round((active_params(v3) - embedding) / 1e9, 1) == 36.6
    assert abs(mtp_params(v3) / 11.5e9 - 1) < 0.01
    assert round((total_params(v3) + mtp_stored_params(v3)) / 1e9 + 0.04) == 685
    # V2-Lite: "15.7B total parameters, of which 2.4B are activated for each token" (arXiv 2405.04434 App. B)
    lite = resolve_model("deepseek-v2-lite")
    assert round(total_params(lite) / 1e9, 1) == 15.7
    assert abs((active_params(lite) - lite.vocab_size * lite.hidden_size) / 2.4e9 - 1) < 0.03


def _mapped(ours: torch.nn.Module, spec) -> dict[str, torch.Tensor]:
    """Our debug model's weights (and routing biases) under DeepseekV3ForCausalLM's names."""
    layer = {"attention_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
             "attention.wq_a": "self_attn.q_a_proj", "attention.q_latent_norm": "self_attn.q_a_layernorm",
             "attention.wq_b": "self_attn.q_b_proj", "attention.wq": "self_attn.q_proj",
             "attention.wkv_a": "self_attn.kv_a_proj_with_mqa", "attention.kv_latent_norm": "self_attn.kv_a_layernorm",
             "attention.wkv_b": "self_attn.kv_b_proj", "attention.wo": "self_attn.o_proj",
             "mlp.w1": "mlp.gate_proj", "mlp.w3": "mlp.up_proj", "mlp.w2": "mlp.down_proj",
             "mlp.router": "mlp.gate", "mlp.shared.w1": "mlp.shared_experts.gate_proj",
             "mlp.shared.w3": "mlp.shared_experts.up_proj", "mlp.shared.w2": "mlp.shared_experts.down_proj"}
    top = {"embed.tok.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    own = dict(ours.state_dict())
    out = {}
    for name, w in own.items():
        if name in top:
            out[top[name]] = w
            continue
        _, i, rest = name.split(".", 2)
        prefix = f"model.layers.{i}"
        if rest == "mlp.experts.w1":
            out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.cat((w, own[f"layers.{i}.mlp.experts.w3"]), 1)
        elif rest == "mlp.experts.w2":
            out[f"{prefix}.mlp.experts.down_proj"] = w
        elif rest == "mlp.expert_bias":
            out[f"{prefix}.mlp.gate.e_score_correction_bias"] = w
        elif rest not in ("mlp.experts.w3", "mlp.routed_counts"):
            module, kind = rest.rsplit(".", 1)
            out[f"{prefix}.{layer[module]}.{kind}"] = w
    return out


@pytest.mark.parametrize("changes", [{}, {"q_lora_rank": 0}], ids=["q_compressed", "q_whole"])
def test_latent_attention_and_sigmoid_routing_give_transformers_logits(changes):
    """debug-mla (without the MTP module, which transformers does not build either): latent
    attention, a dense first layer, grouped sigmoid routing with a balancing bias that changes
    the choice, routed scaling and a shared expert; logits equal DeepseekV3ForCausalLM's (RoPE on
    rotate-half pairs: rope_interleave off)."""
    spec = dataclasses.replace(resolve_model("debug-mla"), mtp_depth=0, **changes)
    ours = Transformer(spec)
    ours.init_weights(5)
    with torch.no_grad():
        for name, buf in ours.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(torch.linspace(-0.3, 0.3, spec.num_experts))   # enough to change choices
    config = transformers.DeepseekV3Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.ffn_hidden_size,
        moe_intermediate_size=spec.moe_ffn_hidden_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        n_shared_experts=spec.shared_expert_ffn_hidden_size // spec.moe_ffn_hidden_size,
        n_routed_experts=spec.num_experts, routed_scaling_factor=spec.routed_scaling_factor,
        kv_lora_rank=spec.kv_lora_rank, q_lora_rank=spec.q_lora_rank or None,
        qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim, qk_nope_head_dim=spec.qk_nope_head_dim,
        n_group=spec.num_expert_groups, topk_group=spec.topk_groups, num_experts_per_tok=spec.experts_per_token,
        first_k_dense_replace=spec.first_k_dense, norm_topk_prob=spec.moe_norm_topk_prob,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=spec.norm_eps,
        rope_theta=spec.rope_theta, rope_interleave=False, tie_word_embeddings=False, attn_implementation="eager")
    theirs = transformers.DeepseekV3ForCausalLM(config).eval()
    theirs.load_state_dict(_mapped(ours, spec), strict=True)
    tokens = torch.randint(0, spec.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(tokens).logits
        got = ours.eval()(tokens)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()


def test_deepseek_checkpoints_are_refused_by_name():
    """runtime.hf does not map DeepSeek's names, routing biases or interleaved RoPE pairs: one line."""
    from costmodel.inputs import UserError
    from runtime.hf import from_hf, to_hf
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(resolve_model("debug-mla"), mtp_depth=0))
    for convert in (lambda: to_hf(model), lambda: from_hf(model, {})):
        with pytest.raises(UserError, match="DeepSeek checkpoints are not converted"):
            convert()
