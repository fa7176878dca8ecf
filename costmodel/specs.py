"""Model and training specs: frozen, plain data, units in names.

`ModelSpec` holds architecture facts only; `TrainSpec` holds what one optimizer step
processes. Neither is ever chosen by the planner.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from costmodel.deepseek import check_deepseek
from costmodel.inputs import (
    MAX_EXPERTS,
    MAX_GLOBAL_BATCH,
    MAX_LAYERS,
    MAX_SEQ_LEN,
    MAX_VOCAB,
    MAX_WIDTH,
    UserError,
    check_limit,
    dataclass_from_json,
)


class Arch(StrEnum):
    """`llama`: RMSNorm, RoPE, SwiGLU, GQA, no biases. `gpt`: LayerNorm, learned positions, GeLU, biases."""

    LLAMA = "llama"
    GPT = "gpt"


class FfnKind(StrEnum):
    SWIGLU = "swiglu"
    GEGLU = "geglu"   # gated like SwiGLU, with tanh-approximated GeLU (Gemma)
    GELU = "gelu"       # tanh-approximated GeLU MLP (GPT-2's gelu_new, Megatron's)
    GELU_ERF = "gelu_erf"   # exact (erf) GeLU MLP (GPT-NeoX)

    @property
    def gated(self) -> bool:
        """Three projections (gate, up, down) and a product, whatever the activation."""
        return self not in (FfnKind.GELU, FfnKind.GELU_ERF)


class NormKind(StrEnum):
    RMSNORM = "rmsnorm"
    LAYERNORM = "layernorm"


class PositionKind(StrEnum):
    ROPE = "rope"
    LEARNED = "learned"
    ALIBI = "alibi"


class DType(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def num_bytes(self) -> int:
        return 4 if self is DType.FP32 else 2


class Optimizer(StrEnum):
    ADAMW = "adamw"
    SGD = "sgd"


class RouterScoring(StrEnum):
    """Expert scores: a softmax (Mixtral, DeepSeek-V2), or sigmoids biased for balance in the choice (V3)."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


class AttentionKernel(StrEnum):
    """`flash`: fused, O(s) memory, skips the masked half of causal attention (Dao 2022).
    `eager`: materialised s x s scores with softmax/dropout as separate memory-bound passes."""

    FLASH = "flash"
    EAGER = "eager"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    name: str
    arch: Arch
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    ffn_kind: FfnKind
    vocab_size: int
    tied_embeddings: bool
    norm_kind: NormKind
    position_kind: PositionKind
    max_position_embeddings: int
    bias: bool
    dropout: bool
    source: str = ""
    # Numerics only (the runtime uses them; no cost changes with them): the RoPE base (Llama 2
    # 1e4, Llama 3 5e5: Dubey et al. 2024 Sec. 3.1), the norms' epsilon, and Llama 3.1's RoPE
    # frequency scaling (HF rope_type "llama3"; factor 1: none), with its low/high-frequency
    # factors and the context length it was trained at before scaling.
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    # DeepSeek's YaRN (HF rope_type "yarn"; factor 1: none): the context-extension factor and its
    # two magnitude terms (latent attention's softmax scale gains (0.1 mscale_all_dim ln factor
    # + 1)^2, the rotary embedding the ratio of the mscale term to that one); the correction range
    # is DeepSeek's, Megatron-Core's default too (4,096 original positions, beta_fast 32, beta_slow 1).
    yarn_factor: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    # Mistral-style sliding-window attention (None: full causal). The cost model and the runtime
    # handle sequences up to the window, where it is full causal attention (costmodel.check).
    sliding_window: int | None = None
    # GPT-NeoX: attention and MLP side by side on the layer input, x + attn(norm1(x)) +
    # mlp(norm2(x)) (numerics and what autograd keeps: the norms share their input), and RoPE on
    # the first `rotary_fraction` of each head's dimensions (NeoX 0.25; the rest pass through)
    parallel_residual: bool = False
    rotary_fraction: float = 1.0
    # Falcon-7B: one norm per layer feeding both parallel branches, x + attn(n) + mlp(n)
    shared_norm: bool = False
    # Qwen3: an RMSNorm over each head's queries and keys (one head_dim-wide scale each) before RoPE
    qk_norm: bool = False
    # Each head's size where it is not hidden_size / num_heads (Gemma 7B: 16 heads of 256 over a
    # 3072-wide model; Mistral NeMo): the queries and the attention output are num_heads x head_dim
    # wide, K and V num_kv_heads x head_dim. None: hidden_size / num_heads.
    explicit_head_dim: int | None = None
    qkv_bias: bool = False   # biases on the Q, K and V projections only (Qwen2), besides `bias`
    # Gemma: embeddings multiplied by sqrt(hidden_size); RMSNorm's scale stored as w with 1 + w applied
    scale_embeddings: bool = False
    norm_unit_offset: bool = False
    # Mixture of experts (num_experts 0: dense). Every layer's MLP is then a router (a linear map
    # to one logit per expert, softmax) sending each token to `experts_per_token` of `num_experts`
    # SwiGLU experts of width `moe_ffn_hidden_size` (dropless: no capacity limit, as Mixtral and
    # Qwen-MoE train), plus, where `shared_expert_ffn_hidden_size` > 0, an always-on shared SwiGLU
    # MLP of that width (Qwen-MoE's shared expert; DeepSeek-MoE's several, concatenated), scaled by
    # a sigmoid of one more projection where `shared_expert_gate` (Qwen2-MoE). The chosen experts'
    # weights are renormalised to sum to one where `moe_norm_topk_prob` (Mixtral), else kept as
    # softmax probabilities (Qwen2-MoE). `router_aux_loss_coef` scales the load-balancing loss.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_hidden_size: int = 0
    shared_expert_ffn_hidden_size: int = 0
    shared_expert_gate: bool = False
    moe_norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    # DeepSeek-V2/V3 (costmodel.deepseek): latent attention where kv_lora_rank > 0 (K, V from a
    # kv_lora_rank-wide latent, Q from a q_lora_rank-wide one or, 0, the input; heads' Q/K of
    # qk_nope + qk_rope dims, V of v_head_dim); `first_k_dense` dense first layers (ffn_hidden_size);
    # routing by `router_scoring` within the best `topk_groups` of `num_expert_groups` groups, routed
    # outputs scaled (numerics); `mtp_depth` MTP modules after the last layer (V3 Sec. 2.2).
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    first_k_dense: int = 0
    router_scoring: RouterScoring = RouterScoring.SOFTMAX
    num_expert_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    mtp_depth: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads",
                     "ffn_hidden_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise UserError(f"model {self.name!r}: {name} must be positive")
        check_limit(f"model {self.name!r}", "num_layers", self.num_layers, MAX_LAYERS)
        check_limit(f"model {self.name!r}", "vocab_size", self.vocab_size, MAX_VOCAB)
        for name in ("hidden_size", "num_heads", "ffn_hidden_size"):
            check_limit(f"model {self.name!r}", name, getattr(self, name), MAX_WIDTH)
        if self.explicit_head_dim is None and not self.is_mla and self.hidden_size % self.num_heads:
            raise UserError(f"model {self.name!r}: hidden_size {self.hidden_size} is not a "
                             f"multiple of num_heads {self.num_heads}")
        if self.explicit_head_dim is not None:
            if self.explicit_head_dim <= 0 or self.explicit_head_dim % 2:
                raise UserError(f"model {self.name!r}: head_dim must be a positive even number")
            check_limit(f"model {self.name!r}", "head_dim", self.explicit_head_dim, MAX_WIDTH)
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"model {self.name!r}: num_heads {self.num_heads} is not a "
                             f"multiple of num_kv_heads {self.num_kv_heads}")
        for name in ("rope_theta", "norm_eps", "rope_original_max_positions"):
            if not getattr(self, name) > 0:
                raise UserError(f"model {self.name!r}: {name} must be positive")
        if self.yarn_factor < 1.0:
            raise UserError(f"model {self.name!r}: yarn_factor must be at least 1 (1: no YaRN scaling)")
        if self.rope_scaling_factor < 1.0:
            raise UserError(f"model {self.name!r}: rope_scaling_factor must be at least 1 (1: no scaling)")
        if self.rope_scaling_factor > 1.0 and not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
            raise UserError(f"model {self.name!r}: RoPE scaling needs 0 < low_freq_factor < high_freq_factor")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise UserError(f"model {self.name!r}: sliding_window must be positive (or absent)")
        if self.qk_norm and self.arch is not Arch.LLAMA:
            raise UserError(f"model {self.name!r}: qk_norm is built for the llama layout only")
        if self.shared_norm and not self.parallel_residual:
            raise UserError(f"model {self.name!r}: shared_norm (one norm for both branches) needs parallel_residual")
        if not 0 < self.rotary_fraction <= 1:
            raise UserError(f"model {self.name!r}: rotary_fraction must be in (0, 1]")
        if self.rotary_fraction != 1 and (self.position_kind is not PositionKind.ROPE or self.rotary_dims % 2
                                          or not self.rotary_dims):
            raise UserError(f"model {self.name!r}: rotary_fraction {self.rotary_fraction:g} needs RoPE and an even, "
                             f"positive number of rotated dimensions (head_dim {self.head_dim})")
        self._check_experts()
        check_deepseek(self)

    def _check_experts(self) -> None:
        where = f"model {self.name!r}"
        if self.num_experts < 0 or self.shared_expert_ffn_hidden_size < 0 or self.router_aux_loss_coef < 0:
            raise UserError(f"{where}: expert counts, widths and the aux-loss coefficient must not be negative")
        if not self.num_experts:
            if self.experts_per_token or self.moe_ffn_hidden_size or self.shared_expert_ffn_hidden_size:
                raise UserError(f"{where}: expert fields are set but num_experts is 0")
            return
        check_limit(where, "num_experts", self.num_experts, MAX_EXPERTS)
        check_limit(where, "moe_ffn_hidden_size", self.moe_ffn_hidden_size, MAX_WIDTH)
        if self.ffn_kind is not FfnKind.SWIGLU:
            raise UserError(f"{where}: experts are SwiGLU MLPs; a {self.ffn_kind} model cannot have them")
        if self.norm_unit_offset or self.scale_embeddings:
            raise UserError(f"{where}: Gemma-style norms and embeddings with experts are not supported")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise UserError(f"{where}: experts_per_token {self.experts_per_token} must be between 1 and "
                             f"num_experts {self.num_experts}")
        if self.moe_ffn_hidden_size <= 0:
            raise UserError(f"{where}: moe_ffn_hidden_size must be positive")
        if self.shared_expert_gate and not self.shared_expert_ffn_hidden_size:
            raise UserError(f"{where}: shared_expert_gate without a shared expert")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3)."""
        return self.kv_lora_rank > 0

    @property
    def head_dim(self) -> int:
        """Each head's query/key size (MLA: its no-RoPE and RoPE parts together)."""
        if self.is_mla:
            return self.qk_nope_head_dim + self.qk_rope_head_dim
        return self.explicit_head_dim or self.hidden_size // self.num_heads

    @property
    def value_head_dim(self) -> int:
        """Each head's value size: head_dim except under MLA (v_head_dim)."""
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def attention_head_dim(self) -> float:
        """The head size attention's two products see on average: (Q/K's + V's) / 2."""
        return (self.head_dim + self.value_head_dim) / 2

    @property
    def attention_output_size(self) -> int:
        """Width of the attention output, the output projection's input: num_heads x value_head_dim."""
        return self.num_heads * self.value_head_dim

    @property
    def num_moe_layers(self) -> int:
        """Layers whose MLP is the mixture (all but the first `first_k_dense`); 0 for a dense model."""
        return self.num_layers - self.first_k_dense if self.is_moe else 0

    @property
    def q_hidden_size(self) -> int:
        """Width of the queries and of the attention output: num_heads x head_dim (hidden_size
        unless the heads are sized apart)."""
        return self.num_heads * self.head_dim

    @property
    def layer_norms(self) -> int:
        """Norms in each layer: one before each branch, or one shared by both (Falcon-7B)."""
        return 1 if self.shared_norm else 2

    @property
    def rotary_dims(self) -> int:
        """Dimensions of each head RoPE rotates (int(head_dim * partial_rotary_factor); MLA's RoPE part)."""
        return self.qk_rope_head_dim if self.is_mla else int(self.head_dim * self.rotary_fraction)

    @property
    def kv_hidden_size(self) -> int:
        """Width of K (and of V): num_kv_heads x head_dim; equals hidden_size without GQA."""
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, StrEnum) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "model") -> "ModelSpec":
        return dataclass_from_json(cls, data, where)


MAX_EXPERT_IMBALANCE = 64.0   # the busiest EP rank's share over the mean; beyond this, a broken router
# Dropless routing with an auxiliary loss is not balanced: NVIDIA's Megatron-Core reproduction of
# Mixtral 8x22B on 128 H100 gives "around 445 TFLOPS" dropless and "around 465" with forced
# balance (Megatron MoE ModelZoo, run_mixtral_8x22B.sh), i.e. 4.5 % slower, which with experts
# about 70 % of the layer's time is a busiest rank ~7 % over the mean; Qwen3-235B at 16K-128K
# tokens loses 8-20 % (same source). 1.1 sits between; state yours with --expert-imbalance.
DEFAULT_EXPERT_IMBALANCE = 1.1


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainSpec:
    """One optimizer step: `global_batch_size` sequences of `seq_len` tokens.

    Mixed precision as in Megatron-LM / ZeRO: weights and activations in `compute_dtype`,
    fp32 master weights and Adam moments when `compute_dtype` is 16-bit, gradients reduced and
    accumulated in `grad_dtype` (Megatron's default for bf16 is fp32 main grads; the ZeRO paper's
    2+2+12 bytes/parameter ledger is `grad_dtype=compute_dtype`).
    """

    seq_len: int
    global_batch_size: int
    compute_dtype: DType = DType.BF16
    grad_dtype: DType = DType.FP32
    optimizer: Optimizer = Optimizer.ADAMW
    attention_kernel: AttentionKernel = AttentionKernel.FLASH
    # Mixtures of experts under expert parallelism: the routed tokens the busiest EP rank gets
    # over the mean (1: perfectly balanced). It scales that rank's expert GEMMs and all-to-all
    # bytes; stated by the user (planner --expert-imbalance).
    expert_load_imbalance: float = DEFAULT_EXPERT_IMBALANCE
    # The user accepts float8 numerics (`--dtype fp8`): plans may run their linear layers in
    # float8 (Plan.fp8_linears, torchao's tensorwise recipe), everything else in compute_dtype,
    # which must then be bf16. The search weighs float8 against bf16 linears per plan.
    float8: bool = False

    def __post_init__(self) -> None:
        if self.seq_len <= 0 or self.global_batch_size <= 0:
            raise UserError("seq_len and global_batch_size must be positive")
        if self.float8 and self.compute_dtype is not DType.BF16:
            raise UserError(f"float8 linears train beside bf16 (got compute dtype {self.compute_dtype})")
        if not 1.0 <= self.expert_load_imbalance <= MAX_EXPERT_IMBALANCE:
            raise UserError(f"expert_load_imbalance must be in [1, {MAX_EXPERT_IMBALANCE:g}] "
                             f"(got {self.expert_load_imbalance})")
        check_limit("train", "seq_len", self.seq_len, MAX_SEQ_LEN)
        check_limit("train", "global_batch_size", self.global_batch_size, MAX_GLOBAL_BATCH)

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch_size

    @property
    def master_weights_fp32(self) -> bool:
        return self.compute_dtype is not DType.FP32

    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, StrEnum) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "train") -> "TrainSpec":
        return dataclass_from_json(cls, data, where)


@dataclass(frozen=True)
class LayerProbe:
    """The layer a CPU profile times kernel by kind inside a training step (runtime.layer_ops;
    planner.measure.probes.LAYER_PROBE): `model`'s first layer, or `small`'s in a dtype the hardware does
    not accelerate (its GEMMs at ~1 GFLOP/s would take seconds a pass), over `micro_batch_size`
    sequences of `seq_len` tokens."""

    model: ModelSpec
    small: ModelSpec
    micro_batch_size: int
    seq_len: int
