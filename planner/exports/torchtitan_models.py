"""The models torchtitan 0.2 builds itself: the flavours of its llama3 and qwen3 train specs
(torchtitan.models.llama3.llama3_args, torchtitan.models.qwen3.qwen3_args), each matched to a
ModelSpec by what sets its shapes and its cost: widths, heads, head width, vocabulary, RoPE base
and fraction, norm epsilon, Q/K norms, tied embeddings, attention window, a mixture's experts and
routing; tests/planner/test_export.py checks each against torchtitan's own args. Not compared,
as they change numerics and not cost: RoPE scaling (torchtitan's llama3 flavours are Llama 3.1's,
scaled by 8) and a mixture's load balancing (torchtitan's qwen3 biases its router, where
Qwen3's config states an auxiliary loss). A model no flavour matches needs a train spec of the
user's (the export says which dimensions)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from costmodel.specs import Arch, ModelSpec, RouterScoring


@dataclass(frozen=True, kw_only=True)
class Flavour:
    name: str           # the train spec (model.name)
    flavor: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int     # the dense MLP's width; a mixture's: its experts' (moe_inter_dim)
    vocab_size: int
    rope_theta: float
    norm_eps: float
    head_dim: int                 # llama3's dim / n_heads; qwen3's its own
    qk_norm: bool = False         # qwen3's per-head Q and K norms
    tied: bool = False            # enable_weight_tying
    num_experts: int = 0          # a mixture (moe_enabled): softmax routing, top-k renormalised
    top_k: int = 0
    # the train spec has a pipelining_fn (torchtitan's qwen3 has none: it runs without a pipeline)
    pipelined: bool = True

    def matches(self, m: ModelSpec) -> bool:
        if (m.arch is not Arch.LLAMA or m.is_mla or m.qkv_bias or m.mtp_depth or m.first_k_dense
                or m.sliding_window is not None or m.rotary_fraction != 1):
            return False
        shape = (m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads, m.ffn_hidden_size, m.vocab_size,
                 m.rope_theta, m.norm_eps, m.head_dim, m.qk_norm, m.tied_embeddings, m.num_experts)
        own = (self.dim, self.n_layers, self.n_heads, self.n_kv_heads, self.ffn_hidden, self.vocab_size,
               self.rope_theta, self.norm_eps, self.head_dim, self.qk_norm, self.tied, self.num_experts)
        if shape != own:
            return False
        return not m.is_moe or (m.experts_per_token == self.top_k and m.moe_ffn_hidden_size == self.ffn_hidden
                                and m.moe_norm_topk_prob and m.router_scoring is RouterScoring.SOFTMAX
                                and m.shared_expert_ffn_hidden_size == 0 and m.num_expert_groups == 1
                                and m.routed_scaling_factor == 1.0)


def _llama3(flavor: str, dim: int, n_layers: int, n_heads: int, ffn_hidden: int) -> Flavour:
    return Flavour(name="llama3", flavor=flavor, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8,
                   ffn_hidden=ffn_hidden, vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5,
                   head_dim=dim // n_heads)


def _qwen3(flavor: str, dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn_hidden: int, *,
           tied: bool = False, num_experts: int = 0, rope_theta: float = 1000000.0) -> Flavour:
    return Flavour(name="qwen3", flavor=flavor, dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                   ffn_hidden=ffn_hidden, vocab_size=151936, rope_theta=rope_theta, norm_eps=1e-6, head_dim=128,
                   qk_norm=True, tied=tied,
                   num_experts=num_experts, top_k=8 if num_experts else 0, pipelined=False)


FLAVOURS = (_llama3("8B", 4096, 32, 32, 14336), _llama3("70B", 8192, 80, 64, 28672),
            _llama3("405B", 16384, 126, 128, 53248),
            _qwen3("0.6B", 1024, 28, 16, 8, 3072, tied=True), _qwen3("1.7B", 2048, 28, 16, 8, 6144, tied=True),
            _qwen3("4B", 2560, 36, 32, 8, 9728, tied=True), _qwen3("8B", 4096, 36, 32, 8, 12288),
            _qwen3("14B", 5120, 40, 40, 8, 17408), _qwen3("32B", 5120, 64, 64, 8, 25600),
            _qwen3("30B-A3B", 2048, 48, 32, 4, 768, num_experts=128),
            # Qwen3-235B-A22B-2507's RoPE base (Qwen3-235B-A22B's is 1e6: no flavour of torchtitan's)
            _qwen3("235B-A22B", 4096, 94, 64, 4, 1536, num_experts=128, rope_theta=5000000.0))


@lru_cache(maxsize=256)   # the search asks for each candidate's model
def flavour_of(m: ModelSpec) -> Flavour | None:
    return next((f for f in FLAVOURS if f.matches(m)), None)
