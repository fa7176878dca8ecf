"""Named models, each citing its public config (Hugging Face config.json files: costmodel.hf_config)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from costmodel.inputs import UserError
from costmodel.specs import Arch, FfnKind, ModelSpec, NormKind, PositionKind, RouterScoring

_HF = "Hugging Face config.json of"


def llama_spec(name: str, *, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
           vocab: int, max_pos: int, source: str, **numerics: Any) -> ModelSpec:
    """`numerics`: rope_theta, norm_eps, rope_scaling_*, expert fields and the like (ModelSpec)."""
    return ModelSpec(name=name, arch=Arch.LLAMA, num_layers=layers, hidden_size=hidden,
                     num_heads=heads, num_kv_heads=kv_heads, ffn_hidden_size=ffn,
                     ffn_kind=FfnKind.SWIGLU, vocab_size=vocab, tied_embeddings=False,
                     norm_kind=NormKind.RMSNORM, position_kind=PositionKind.ROPE,
                     max_position_embeddings=max_pos, bias=False, dropout=False, source=source,
                     **numerics)


def gpt_spec(name: str, *, layers: int, hidden: int, heads: int, vocab: int, max_pos: int,
         source: str, ffn: int | None = None) -> ModelSpec:
    """Megatron-LM GPT: LayerNorm, learned positions, GeLU MLP of 4h, biases, tied output layer."""
    return ModelSpec(name=name, arch=Arch.GPT, num_layers=layers, hidden_size=hidden,
                     num_heads=heads, num_kv_heads=heads, ffn_hidden_size=ffn or 4 * hidden,
                     ffn_kind=FfnKind.GELU, vocab_size=vocab, tied_embeddings=True,
                     norm_kind=NormKind.LAYERNORM, position_kind=PositionKind.LEARNED,
                     max_position_embeddings=max_pos, bias=True, dropout=True, source=source)


# Llama 3: RoPE base 500,000 (Dubey et al. 2024 Sec. 3.1; rope_theta in the HF configs), RMSNorm
# eps 1e-5; Llama 3.1 adds rope_type "llama3" scaling: factor 8, low/high-frequency factors 1 and
# 4, original context 8192 (its HF config.json).
_LLAMA3 = dict(rope_theta=500_000.0, norm_eps=1e-5)
_LLAMA31 = dict(_LLAMA3, rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                rope_original_max_positions=8192)

# Mixtral (Jiang et al. 2024, arXiv 2401.04088): 8 SwiGLU experts per layer, 2 per token, RoPE
# base 1e6; 46.7B parameters, 12.9B active (8x7B); Mistral's 8x22B announcement: 141B, 39B active.
_MIXTRAL = dict(rope_theta=1_000_000.0, norm_eps=1e-5, num_experts=8, experts_per_token=2)
# Qwen1.5-MoE-A2.7B (Qwen blog, 2024-03): 60 fine-grained experts, 4 per token, a shared expert of
# 4x their width behind a sigmoid gate, top-k weights not renormalised, biases on Q/K/V;
# 14.3B parameters, 2.7B active.
_QWEN_MOE = dict(rope_theta=1_000_000.0, norm_eps=1e-6, qkv_bias=True, num_experts=60, experts_per_token=4,
                 moe_ffn_hidden_size=1408, shared_expert_ffn_hidden_size=5632, shared_expert_gate=True,
                 moe_norm_topk_prob=False, router_aux_loss_coef=0.001)

# DeepSeek-V3 (arXiv 2412.19437) and DeepSeek-V2-Lite (arXiv 2405.04434 App. B): latent
# attention (costmodel.deepseek), dense first layers, fine-grained routed experts and shared ones
# (n_shared_experts x moe_intermediate_size wide), RMSNorm eps 1e-6, RoPE base 1e4 with YaRN
# (factor 40; mscale 1.0 / 1.0 for V3, 0.707 / 0.707 for V2-Lite: their config.json), which
# changes no cost. V3: 671B parameters, 37B active, plus a 14B MTP module (11.5B of its
# own beside the embedding and head it shares: the model card's README_WEIGHTS.md).
_DEEPSEEK = dict(rope_theta=10_000.0, norm_eps=1e-6, kv_lora_rank=512, qk_nope_head_dim=128,
                 qk_rope_head_dim=64, v_head_dim=128)
_DEEPSEEK_V3 = dict(_DEEPSEEK, q_lora_rank=1536, num_experts=256, experts_per_token=8, moe_ffn_hidden_size=2048,
                    shared_expert_ffn_hidden_size=2048, first_k_dense=3, router_scoring=RouterScoring.SIGMOID,
                    num_expert_groups=8, topk_groups=4, routed_scaling_factor=2.5, mtp_depth=1,
                    router_aux_loss_coef=0.001, yarn_factor=40.0, yarn_mscale=1.0, yarn_mscale_all_dim=1.0)
_DEEPSEEK_V2_LITE = dict(_DEEPSEEK, num_experts=64, experts_per_token=6, moe_ffn_hidden_size=1408,
                         shared_expert_ffn_hidden_size=2 * 1408, first_k_dense=1, moe_norm_topk_prob=False,
                         router_aux_loss_coef=0.001, yarn_factor=40.0, yarn_mscale=0.707,
                         yarn_mscale_all_dim=0.707)

# Qwen3 MoE (Qwen3 technical report, arXiv 2505.09388, Table 2): 128 routed experts, 8 per token
# with renormalised top-k weights, no shared expert; 128-wide heads independent of the hidden size,
# an RMSNorm over each head's queries and keys; RoPE base 1e6, RMSNorm eps 1e-6. 30.5B parameters,
# 3.3B active (30B-A3B); 235B, 22B active (235B-A22B).
_QWEN3_MOE = dict(rope_theta=1_000_000.0, norm_eps=1e-6, qk_norm=True, explicit_head_dim=128, num_experts=128,
                  experts_per_token=8, moe_norm_topk_prob=True, router_aux_loss_coef=0.001)

_SC21 = "Narayanan et al. SC'21 (arXiv 2104.04473) Table 1 (vocab 51200, seq 2048)"

# (name, layers, hidden, heads) of Megatron-LM's weak-scaling table (SC'21 Table 1).
_MEGATRON_TABLE = [
    ("megatron-1.7b", 24, 2304, 24), ("megatron-3.6b", 30, 3072, 32),
    ("megatron-7.5b", 36, 4096, 32), ("megatron-18b", 40, 6144, 48),
    ("megatron-39b", 48, 8192, 64), ("megatron-76b", 60, 10240, 80),
    ("megatron-145b", 80, 12288, 96), ("megatron-310b", 96, 16384, 128),
    ("megatron-530b", 105, 20480, 128), ("megatron-1t", 128, 25600, 160),
]

MODELS: dict[str, ModelSpec] = {m.name: m for m in [
    llama_spec("llama2-7b", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008, vocab=32000,
           max_pos=4096, source=f"{_HF} meta-llama/Llama-2-7b-hf"),
    llama_spec("llama2-13b", layers=40, hidden=5120, heads=40, kv_heads=40, ffn=13824, vocab=32000,
           max_pos=4096, source=f"{_HF} meta-llama/Llama-2-13b-hf"),
    llama_spec("llama2-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=32000,
           max_pos=4096, source=f"{_HF} meta-llama/Llama-2-70b-hf"),
    llama_spec("llama3-8b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
           max_pos=8192, source=f"{_HF} meta-llama/Meta-Llama-3-8B", **_LLAMA3),
    llama_spec("llama3-70b", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672, vocab=128256,
           max_pos=8192, source=f"{_HF} meta-llama/Meta-Llama-3-70B", **_LLAMA3),
    llama_spec("llama3-405b", layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248,
           vocab=128256, max_pos=131072, source=f"{_HF} meta-llama/Llama-3.1-405B", **_LLAMA31),
    llama_spec("mixtral-8x7b", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=32000,
               max_pos=32768, source=f"{_HF} mistralai/Mixtral-8x7B-v0.1", **_MIXTRAL,
               moe_ffn_hidden_size=14336, router_aux_loss_coef=0.02),
    llama_spec("mixtral-8x22b", layers=56, hidden=6144, heads=48, kv_heads=8, ffn=16384, vocab=32000,
               max_pos=65536, source=f"{_HF} mistralai/Mixtral-8x22B-v0.1", **_MIXTRAL,
               moe_ffn_hidden_size=16384, router_aux_loss_coef=0.001),
    llama_spec("qwen1.5-moe-a2.7b", layers=24, hidden=2048, heads=16, kv_heads=16, ffn=1408, vocab=151936,
               max_pos=8192, source=f"{_HF} Qwen/Qwen1.5-MoE-A2.7B", **_QWEN_MOE),
    llama_spec("qwen3-30b-a3b", layers=48, hidden=2048, heads=32, kv_heads=4, ffn=768, vocab=151936,
               max_pos=40960, source=f"{_HF} Qwen/Qwen3-30B-A3B", **_QWEN3_MOE, moe_ffn_hidden_size=768),
    llama_spec("qwen3-235b-a22b", layers=94, hidden=4096, heads=64, kv_heads=4, ffn=1536, vocab=151936,
               max_pos=40960, source=f"{_HF} Qwen/Qwen3-235B-A22B", **_QWEN3_MOE, moe_ffn_hidden_size=1536),
    llama_spec("deepseek-v3", layers=61, hidden=7168, heads=128, kv_heads=128, ffn=18432, vocab=129280,
               max_pos=163840, source=f"{_HF} deepseek-ai/DeepSeek-V3", **_DEEPSEEK_V3),
    llama_spec("deepseek-v2-lite", layers=27, hidden=2048, heads=16, kv_heads=16, ffn=10944, vocab=102400,
               max_pos=163840, source=f"{_HF} deepseek-ai/DeepSeek-V2-Lite", **_DEEPSEEK_V2_LITE),
    gpt_spec("gpt3-175b", layers=96, hidden=12288, heads=96, vocab=50257, max_pos=2048,
         source="Brown et al. 2020 (arXiv 2005.14165) Table 2.1; vocab 50257, n_ctx 2048"),
    *[gpt_spec(n, layers=lay, hidden=hid, heads=hds, vocab=51200, max_pos=2048, source=_SC21)
      for n, lay, hid, hds in _MEGATRON_TABLE],
    # Small enough to run on a CPU in tests; GQA (4 heads / 2 kv heads) exercises every code path.
    llama_spec("debug-tiny", layers=4, hidden=64, heads=4, kv_heads=2, ffn=192, vocab=256,
           max_pos=128, source="project debug model (tests and local runs)"),
    # Big enough for compute to matter on a CPU, small enough to train there (closed-loop benchmark).
    # The smallest mixture of experts with every path: 4 experts, 2 per token, a gated shared one.
    llama_spec("debug-moe", layers=2, hidden=64, heads=4, kv_heads=2, ffn=96, vocab=256, max_pos=128,
               source="project debug model (tests)", num_experts=4, experts_per_token=2,
               moe_ffn_hidden_size=96, shared_expert_ffn_hidden_size=64, shared_expert_gate=True,
               router_aux_loss_coef=0.01),
    # Every DeepSeek path: latent attention with a compressed query, a dense first layer, a shared
    # expert, grouped sigmoid routing and an MTP module.
    llama_spec("debug-mla", layers=3, hidden=64, heads=4, kv_heads=4, ffn=96, vocab=256, max_pos=128,
               source="project debug model (tests)", q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=16, num_experts=8, experts_per_token=2, moe_ffn_hidden_size=32,
               shared_expert_ffn_hidden_size=32, first_k_dense=1, router_scoring=RouterScoring.SIGMOID,
               num_expert_groups=4, topk_groups=2, routed_scaling_factor=2.5, mtp_depth=1),
    llama_spec("debug-small", layers=4, hidden=256, heads=8, kv_heads=4, ffn=768, vocab=2048,
           max_pos=512, source="project debug model (closed-loop benchmark)"),
    # The GPT code paths (fused QKV, LayerNorm, learned positions, biases, tied output layer).
    gpt_spec("debug-tiny-gpt", layers=4, hidden=64, heads=4, vocab=256, max_pos=128,
         source="project debug model (tests and local runs)"),
]}

# Llama 2's sizes keep their short names; Llama 3's sizes that Llama 2 lacks take theirs.
ALIASES: dict[str, str] = {"llama-70b": "llama2-70b", "llama-7b": "llama2-7b",
                           "llama-13b": "llama2-13b", "llama-8b": "llama3-8b",
                           "llama-405b": "llama3-405b", "gpt3": "gpt3-175b"}

# Published pre-training recipes: (seq_len, global batch in sequences), used as defaults.
RECIPES: dict[str, tuple[int, int]] = {
    "llama2-7b": (4096, 1024), "llama2-13b": (4096, 1024), "llama2-70b": (4096, 1024),
    # Llama 2 paper (arXiv 2307.09288) Sec. 2.2: 4k context, 4M-token batches.
    # Llama 3 paper (arXiv 2407.21783) Sec. 3.4.1: 8k context; the 405B batch grows 4M -> 8M
    # -> 16M tokens (16M = 2048 x 8192 used here). 8B/70B batch not stated: 4M tokens assumed.
    "llama3-8b": (8192, 512), "llama3-70b": (8192, 512),
    "llama3-405b": (8192, 2048),
    "gpt3-175b": (2048, 1536),  # GPT-3 paper Table 2.1: 3.2M-token batch = 1536 x 2048.
    # DeepSeek-V3 paper Sec. 4.2: 4K sequences; the batch grows from 3072 to 15360 over the first
    # 469B tokens and stays at 15360.
    "deepseek-v3": (4096, 15360),
    "debug-tiny": (32, 8), "debug-tiny-gpt": (32, 8), "debug-small": (128, 16),
}


def model_names() -> list[str]:
    return sorted(MODELS)


def has_recipe(model: ModelSpec) -> bool:
    """Whether default_recipe is the model's own published recipe (not the SC'21 fallback)."""
    return model.name in RECIPES


def default_recipe(model: ModelSpec) -> tuple[int, int]:
    """(seq_len, global_batch_size) of the model's published recipe, else Megatron's SC'21 setting."""
    return RECIPES.get(model.name, (min(2048, model.max_position_embeddings), 512))


def resolve_model(name_or_path: str) -> ModelSpec:
    """A registry name, an alias, or a path to a Hugging Face-style config.json (or its directory)."""
    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in MODELS:
        return MODELS[key]
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():   # a Hugging Face model directory
        path = path / "config.json"
    if path.suffix == ".json" or path.exists():
        from costmodel.hf_config import model_from_hf_config
        return model_from_hf_config(path)
    known = ", ".join(model_names() + sorted(ALIASES))
    raise UserError(f"unknown model {name_or_path!r}; known: {known} (or a path to config.json)")
