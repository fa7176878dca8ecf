"""The runtime's model is the real thing: with the same weights its logits equal `transformers'`
(Llama 3.1 with its RoPE base, norm epsilon and llama3 RoPE scaling; Mistral with a sliding
window; GPT-2), weights move both ways, and parameter counts agree. Configs are the published
ones with their numerics kept and their widths cut so a CPU runs them in a second.
(`transformers` is in the test extra; without it these tests are skipped.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from costmodel.registry import resolve_model
from runtime.hf import from_hf, to_hf
from runtime.model import Transformer, count_params

transformers = pytest.importorskip("transformers")

SMALL = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 256}
# meta-llama/Llama-3.1-8B's config.json, widths cut (SMALL)
LLAMA31 = {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
           "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "initializer_range": 0.02,
           "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
           "pretraining_tp": 1, "rms_norm_eps": 1e-05,
           "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
           "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
           "transformers_version": "4.43.0.dev0", "use_cache": True, **SMALL}
# mistralai/Mistral-7B-v0.1's config.json, widths cut
MISTRAL = {"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
           "initializer_range": 0.02, "max_position_embeddings": 32768, "model_type": "mistral",
           "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "transformers_version": "4.34.0.dev0", "use_cache": True, **SMALL}
# openai-community/gpt2's config.json, widths cut
GPT2 = {"activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"], "attn_pdrop": 0.1,
        "bos_token_id": 50256, "embd_pdrop": 0.1, "eos_token_id": 50256, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "model_type": "gpt2", "n_ctx": 1024, "n_embd": 64, "n_head": 4,
        "n_layer": 2, "n_positions": 1024, "resid_pdrop": 0.1, "summary_activation": None,
        "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
        "summary_use_proj": True, "vocab_size": 256}
# Qwen/Qwen2-0.5B's config.json, widths cut: biases on Q, K and V, tied embeddings
QWEN2 = {"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
         "eos_token_id": 151643, "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 131072,
         "max_window_layers": 24, "model_type": "qwen2", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
         "sliding_window": 131072, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
         "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False, **SMALL}
# mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen1.5-MoE-A2.7B, widths and expert counts cut
MIXTRAL_SMALL = {"architectures": ["MixtralForCausalLM"], "hidden_act": "silu", "model_type": "mixtral",
                 "max_position_embeddings": 32768, "num_local_experts": 4, "num_experts_per_tok": 2,
                 "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
                 "sliding_window": None, "tie_word_embeddings": False, **SMALL}
QWEN_MOE_SMALL = {"architectures": ["Qwen2MoeForCausalLM"], "decoder_sparse_step": 1, "hidden_act": "silu",
                  "model_type": "qwen2_moe", "max_position_embeddings": 8192, "max_window_layers": 21,
                  "moe_intermediate_size": 48, "norm_topk_prob": False, "num_experts": 6, "num_experts_per_tok": 2,
                  "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
                  "shared_expert_intermediate_size": 96, "sliding_window": 32768, "tie_word_embeddings": False,
                  "use_sliding_window": False, **SMALL}
# microsoft/Phi-3-mini-4k-instruct's config.json, widths cut (the pad token moved into the cut vocabulary)
PHI3 = {"architectures": ["Phi3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
        "embd_pdrop": 0.0, "eos_token_id": 2, "hidden_act": "silu", "initializer_range": 0.02,
        "max_position_embeddings": 4096, "model_type": "phi3", "original_max_position_embeddings": 4096,
        "pad_token_id": 255, "resid_pdrop": 0.0, "rms_norm_eps": 1e-05, "rope_scaling": None,
        "rope_theta": 10000.0, "sliding_window": 2047, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "transformers_version": "4.40.2", "use_cache": True, **SMALL}
# google/gemma-2b's config.json, widths cut (MQA, head_dim = hidden / heads as there), with the
# activation as transformers names it (the hub file says "gelu"; Gemma uses the tanh form)
GEMMA = {"architectures": ["GemmaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2,
         "eos_token_id": 1, "head_dim": 16, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 64,
         "initializer_range": 0.02, "intermediate_size": 160, "max_position_embeddings": 8192, "model_type": "gemma",
         "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 1, "pad_token_id": 0,
         "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
         "transformers_version": "4.38.0.dev0", "use_cache": True, "vocab_size": 256}
# EleutherAI/pythia-160m's config.json, widths cut: parallel residual, RoPE on a quarter of each head
NEOX = {"architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
        "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 256, "layer_norm_eps": 1e-05,
        "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 4, "num_hidden_layers": 2,
        "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False, "torch_dtype": "float16",
        "transformers_version": "4.24.0", "use_cache": True, "use_parallel_residual": True, "vocab_size": 256}
# google/gemma-7b's config.json, widths cut: 4 heads of 32 over a 96-wide model (16 of 256 over
# 3072 there), so the queries are wider than the model
GEMMA7B = {**GEMMA, "hidden_size": 96, "head_dim": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
           "intermediate_size": 192}
# tiiuae/falcon-7b's config.json (transformers 4 keys), widths cut: multi-query attention, one
# norm feeding attention and MLP in parallel; and the new decoder architecture (40B/180B): KV
# groups and a norm per branch
FALCON = {"alibi": False, "apply_residual_connection_post_layernorm": False, "architectures": ["FalconForCausalLM"],
          "attention_dropout": 0.0, "bias": False, "bos_token_id": 11, "eos_token_id": 11, "hidden_dropout": 0.0,
          "hidden_size": 64, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "model_type": "falcon",
          "multi_query": True, "new_decoder_architecture": False, "num_attention_heads": 4, "num_hidden_layers": 2,
          "parallel_attn": True, "torch_dtype": "bfloat16", "transformers_version": "4.27.4", "use_cache": True,
          "vocab_size": 256}
FALCON_NEW = {**FALCON, "new_decoder_architecture": True, "num_kv_heads": 2, "multi_query": True}
# Qwen/Qwen3-8B's config.json, widths cut (head_dim 32 over a 64-wide model with 4 heads: queries
# twice as wide, as 128 x 32 over 4096 there), and Qwen/Qwen3-30B-A3B's, widths and experts cut
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
         "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 32, "hidden_act": "silu",
         "initializer_range": 0.02, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
         "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
         "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
         "use_cache": True, "use_sliding_window": False, **SMALL}
QWEN3_MOE = {**QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "decoder_sparse_step": 1,
             "mlp_only_layers": [], "moe_intermediate_size": 48, "norm_topk_prob": True, "num_experts": 8,
             "num_experts_per_tok": 2, "output_router_logits": False, "router_aux_loss_coef": 0.001}
CASES = {"qwen3": (QWEN3, "Qwen3ForCausalLM"), "qwen3_moe": (QWEN3_MOE, "Qwen3MoeForCausalLM"),
         "falcon7b": (FALCON, "FalconForCausalLM"), "falcon_new_arch": (FALCON_NEW, "FalconForCausalLM"),
         "gemma7b_head_dim": (GEMMA7B, "GemmaForCausalLM"), "gpt_neox": (NEOX, "GPTNeoXForCausalLM"), "llama3.1": (LLAMA31, "LlamaForCausalLM"), "phi3": (PHI3, "Phi3ForCausalLM"), "gemma": (GEMMA, "GemmaForCausalLM"), "mistral": (MISTRAL, "MistralForCausalLM"),
         "qwen2": (QWEN2, "Qwen2ForCausalLM"), "gpt2": (GPT2, "GPT2LMHeadModel"),
         "mixtral": (MIXTRAL_SMALL, "MixtralForCausalLM"), "qwen2_moe": (QWEN_MOE_SMALL, "Qwen2MoeForCausalLM")}


def _config(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return path


def _theirs(cfg: dict, cls_name: str):
    config = transformers.AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    model = getattr(transformers, cls_name)(config).eval()
    return model


def _tokens(seq: int = 96) -> torch.Tensor:
    return torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(0))


def _same_logits(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Equal to fp32 rounding: within 2e-4 of the logits' largest magnitude. The same model in two
    codebases sums in other orders (GEMM blocking by thread count, oneDNN's AMX paths on some
    CPUs): up to 5e-5 of it seen on an AMX Xeon in the full suite, 0 alone; a wrong mapping of
    one weight errs by the logits' own size."""
    return (got - expected).abs().max().item() < 2e-4 * expected.abs().max().item()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_equal_transformers_on_shared_weights(tmp_path, name):
    cfg, cls_name = CASES[name]
    torch.manual_seed(0)
    theirs = _theirs(cfg, cls_name)
    spec = resolve_model(str(_config(tmp_path, cfg)))
    ours = Transformer(spec).eval()
    from_hf(ours, theirs.state_dict())
    x = _tokens()
    with torch.no_grad():
        expected = theirs(x).logits
        got = ours(x)
    assert _same_logits(got, expected)
    assert count_params(ours) == theirs.num_parameters()


@pytest.mark.parametrize("name", list(CASES))
def test_weights_go_back_to_transformers(tmp_path, name):
    """A model the runtime trained, handed to transformers: its state dict loads strictly."""
    cfg, cls_name = CASES[name]
    spec = resolve_model(str(_config(tmp_path, cfg)))
    ours = Transformer(spec).eval()
    ours.init_weights(seed=3)
    theirs = _theirs(cfg, cls_name)
    theirs.load_state_dict(to_hf(ours, fused_projections=cfg["model_type"] == "phi3",
                                 model_type="falcon" if cfg["model_type"] == "falcon" else None), strict=True)
    x = _tokens()
    with torch.no_grad():
        assert _same_logits(ours(x), theirs(x).logits)


def test_the_numerics_matter(tmp_path):
    """Read and used, not decoration: without Llama 3.1's RoPE base and scaling the logits move."""
    theirs = _theirs(LLAMA31, "LlamaForCausalLM")
    plain = {**LLAMA31, "rope_theta": 10000.0, "rope_scaling": None, "rms_norm_eps": 1e-6}
    ours = Transformer(resolve_model(str(_config(tmp_path, plain)))).eval()
    from_hf(ours, theirs.state_dict())
    x = _tokens(512)
    with torch.no_grad():
        assert (ours(x) - theirs(x).logits).abs().max().item() > 1e-3


# Published configs, whole (counted on the meta device): mistralai/Mixtral-8x7B-v0.1 and
# Qwen/Qwen1.5-MoE-A2.7B
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
           "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
           "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32,
           "num_experts_per_tok": 2, "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8,
           "output_router_logits": False, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0,
           "router_aux_loss_coef": 0.02, "sliding_window": None, "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "transformers_version": "4.36.0.dev0", "use_cache": True, "vocab_size": 32000}
QWEN_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
            "decoder_sparse_step": 1, "eos_token_id": 151643, "hidden_act": "silu", "hidden_size": 2048,
            "initializer_range": 0.02, "intermediate_size": 5632, "max_position_embeddings": 8192,
            "max_window_layers": 21, "model_type": "qwen2_moe", "moe_intermediate_size": 1408,
            "norm_topk_prob": False, "num_attention_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
            "num_hidden_layers": 24, "num_key_value_heads": 16, "output_router_logits": False,
            "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 5632, "sliding_window": 32768, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "transformers_version": "4.39.0.dev0", "use_cache": True,
            "use_sliding_window": False, "vocab_size": 151936}


@pytest.mark.parametrize("cfg, cls_name, registry", [
    (MIXTRAL, "MixtralForCausalLM", "mixtral-8x7b"), (QWEN_MOE, "Qwen2MoeForCausalLM", "qwen1.5-moe-a2.7b"),
], ids=["mixtral", "qwen2_moe"])
def test_moe_configs_count_exactly_as_transformers(tmp_path, cfg, cls_name, registry):
    """Mixtures of experts are read and counted exactly, whole published configs on the meta device."""
    from costmodel.params import total_params
    spec = resolve_model(str(_config(tmp_path, cfg)))
    with torch.device("meta"):
        theirs = _theirs(cfg, cls_name)
    assert total_params(spec) == theirs.num_parameters()
    assert total_params(resolve_model(registry)) == total_params(spec)


# EleutherAI/gpt-neox-20b's config.json (transformers 4 keys), whole
NEOX_20B = {"architectures": ["GPTNeoXForCausalLM"], "bos_token_id": 0, "eos_token_id": 0, "hidden_act": "gelu",
            "hidden_size": 6144, "initializer_range": 0.02, "intermediate_size": 24576, "layer_norm_eps": 1e-05,
            "max_position_embeddings": 2048, "model_type": "gpt_neox", "num_attention_heads": 64,
            "num_hidden_layers": 44, "rotary_emb_base": 10000, "rotary_pct": 0.25, "tie_word_embeddings": False,
            "torch_dtype": "float16", "transformers_version": "4.24.0", "use_cache": True,
            "use_parallel_residual": True, "vocab_size": 50432}


def test_gpt_neox_counts_exactly_as_transformers_and_prices_its_mechanisms(tmp_path):
    """GPT-NeoX-20B read whole and counted as transformers does (on the meta device); its parallel
    residual and partial rotary reach the spec, and transformers 5's rope_parameters read alike."""
    from costmodel.params import total_params
    spec = resolve_model(str(_config(tmp_path, NEOX_20B)))
    with torch.device("meta"):
        theirs = _theirs(NEOX_20B, "GPTNeoXForCausalLM")
    assert total_params(spec) == theirs.num_parameters()
    assert total_params(spec) == 20_554_567_680   # GPT-NeoX-20B's published count (Black et al. 2022)
    assert spec.parallel_residual and spec.rotary_dims == 24 and not spec.tied_embeddings
    v5 = {k: v for k, v in NEOX_20B.items() if k not in ("rotary_pct", "rotary_emb_base")}
    v5["rope_parameters"] = {"rope_theta": 10000.0, "partial_rotary_factor": 0.25, "rope_type": "default"}
    assert resolve_model(str(_config(tmp_path, v5))) == spec
    bad = {**NEOX_20B, "hidden_dropout": 0.1}
    from costmodel.inputs import UserError
    with pytest.raises(UserError, match="hidden_dropout in a GPT-NeoX model is not supported"):
        resolve_model(str(_config(tmp_path, bad)))
    unnamed = {k: v for k, v in NEOX_20B.items() if k != "model_type"}
    with pytest.raises(UserError, match=r"config.json: no model_type \(a Hugging Face config names"):
        resolve_model(str(_config(tmp_path, unnamed)))


def test_gemma_7b_heads_sized_apart_count_exactly_as_transformers(tmp_path):
    """google/gemma-7b: 16 heads of 256 over a 3072-wide model (queries 4096 wide), whole, on
    the meta device."""
    from costmodel.params import total_params
    cfg = {**GEMMA, "hidden_size": 3072, "head_dim": 256, "num_attention_heads": 16, "num_key_value_heads": 16,
           "intermediate_size": 24576, "num_hidden_layers": 28, "vocab_size": 256000}
    spec = resolve_model(str(_config(tmp_path, cfg)))
    with torch.device("meta"):
        theirs = _theirs(cfg, "GemmaForCausalLM")
    assert spec.q_hidden_size == 4096 and total_params(spec) == theirs.num_parameters() == 8_537_680_896


def test_falcon_7b_counts_exactly_as_transformers(tmp_path):
    """tiiuae/falcon-7b whole on the meta device: 71 heads over one shared K/V head, one norm per
    layer, tied embeddings."""
    from costmodel.params import total_params
    cfg = {**FALCON, "hidden_size": 4544, "num_attention_heads": 71, "num_hidden_layers": 32, "vocab_size": 65024}
    spec = resolve_model(str(_config(tmp_path, cfg)))
    with torch.device("meta"):
        theirs = _theirs(cfg, "FalconForCausalLM")
    assert spec.shared_norm and spec.num_kv_heads == 1 and spec.tied_embeddings
    assert total_params(spec) == theirs.num_parameters() == 6_921_720_704


@pytest.mark.parametrize("changes, cls_name", [
    ({}, "Qwen3ForCausalLM"),   # Qwen3-8B
    ({**QWEN3_MOE, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
      "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
      "num_experts_per_tok": 8}, "Qwen3MoeForCausalLM"),   # Qwen3-30B-A3B
], ids=["qwen3-8b", "qwen3-30b-a3b"])
def test_qwen3_counts_exactly_as_transformers(tmp_path, changes, cls_name):
    """Whole published Qwen3 configs on the meta device: per-head Q/K norms, heads of 128."""
    from costmodel.params import total_params
    cfg = {**QWEN3, "hidden_size": 4096, "head_dim": 128, "intermediate_size": 12288, "num_hidden_layers": 36,
           "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 151936, **changes}
    spec = resolve_model(str(_config(tmp_path, cfg)))
    with torch.device("meta"):
        theirs = _theirs(cfg, cls_name)
    assert spec.qk_norm and total_params(spec) == theirs.num_parameters()
