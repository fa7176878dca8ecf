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
