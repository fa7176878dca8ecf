"""validate's optional `model` column: a published run of a registry model whose layout the
architecture columns cannot state (Qwen3's 128-wide heads and query/key norms, DeepSeek's latent
attention), checked against the columns it fills."""
from dataclasses import replace

import pytest

from costmodel.hf_config import model_from_hf_dict
from costmodel.inputs import UserError
from costmodel.params import active_params, total_params
from costmodel.registry import MODELS
from planner.measure.runs_table import row_specs

QWEN3_235B_ROW = {
    "id": "q", "source": "x", "framework": "megatron-core", "arch": "llama", "layers": "94", "hidden": "4096",
    "ffn_hidden": "1536", "heads": "64", "kv_heads": "4", "vocab": "151936", "seq_len": "4096",
    "gpu": "H100-SXM5-80GB", "num_gpus": "256", "gpus_per_node": "8", "tp": "4", "pp": "8", "dp": "8",
    "global_batch": "2048", "precision": "bf16", "metric_name": "iteration_time_s", "metric_value": "29.0",
    "num_experts": "128", "experts_per_token": "8", "moe_ffn_hidden": "1536", "ep": "8",
    "model": "qwen3-235b-a22b"}

# Qwen/Qwen3-30B-A3B's config.json (the keys the reader reads)
QWEN3_30B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "norm_topk_prob": True,
    "router_aux_loss_coef": 0.001, "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
    "sliding_window": None, "max_window_layers": 48, "output_router_logits": False, "rope_scaling": None,
    "initializer_range": 0.02, "torch_dtype": "bfloat16", "use_cache": True, "bos_token_id": 151643,
    "eos_token_id": 151645, "transformers_version": "4.51.0"}


def test_the_qwen3_moe_entries_are_their_configs_and_published_sizes():
    """Qwen3 report (arXiv 2505.09388) Table 2: 30.5B total / 3.3B active (3.35B counted), 235B / 22B."""
    read = model_from_hf_dict(QWEN3_30B_CONFIG, name="qwen3-30b-a3b")
    assert replace(read, source="") == replace(MODELS["qwen3-30b-a3b"], source="")
    sizes = {n: (round(total_params(MODELS[n]) / 1e9, 1), round(active_params(MODELS[n]) / 1e9, 1))
             for n in ("qwen3-30b-a3b", "qwen3-235b-a22b")}
    assert sizes == {"qwen3-30b-a3b": (30.5, 3.4), "qwen3-235b-a22b": (235.1, 22.2)}


def test_a_named_model_keeps_what_the_columns_cannot_state():
    model, train, _ = row_specs(QWEN3_235B_ROW)
    assert model.name == "q" and model.qk_norm and model.head_dim == 128 and model.num_experts == 128
    assert model.attention_output_size == 64 * 128 != model.hidden_size
    v3 = dict(QWEN3_235B_ROW, model="deepseek-v3", layers="61", hidden="7168", heads="128", kv_heads="128",
              vocab="129280", ffn_hidden="", num_experts="256", moe_ffn_hidden="2048")
    model, _, _ = row_specs(v3)
    assert model.is_mla and model.first_k_dense == 3 and model.shared_expert_ffn_hidden_size == 2048


@pytest.mark.parametrize("change,message", [
    ({"heads": "32"}, "heads = 32 but model qwen3-235b-a22b has 64"),
    ({"num_experts": "64"}, "num_experts = 64 but model qwen3-235b-a22b has 128"),
    ({"arch": "gpt"}, "arch = gpt but model qwen3-235b-a22b has llama"),
    ({"model": "qwen3-999b"}, "model 'qwen3-999b' is not a registry model"),
])
def test_a_named_model_the_columns_contradict_is_one_line(change, message):
    with pytest.raises(UserError, match=message):
        row_specs({**QWEN3_235B_ROW, **change})
