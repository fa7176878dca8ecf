"""Megatron-LM's arguments that describe the model (planner.exports.megatron writes them beside
the plan's): widths, heads, positions, norms, the MLP, biases, dropout, a mixture's experts and
router, and DeepSeek's mechanisms, in Megatron-LM's spelling."""
from __future__ import annotations

from costmodel.frameworks import FrameworkTraits
from costmodel.hardware import ClusterSpec, run_by
from costmodel.moe_dispatch import needs_per_node_dispatcher
from costmodel.plan import Plan, PlanFile
from costmodel.rank_time import spans
from costmodel.specs import Arch, FfnKind, ModelSpec, NormKind, PositionKind, TrainSpec
from planner.exports.common import CannotExport


def model_arguments(pf: PlanFile, plan: Plan, traits: FrameworkTraits) -> list[tuple[str, str | None]]:
    """The model's flags: the dense architecture, a mixture's (its dispatcher as `traits` lay the
    expert group out), DeepSeek's."""
    return [*_model_arguments(pf.model, pf.train), *_moe_arguments(pf, plan, traits), *_deepseek_arguments(pf.model)]


def _model_arguments(m: ModelSpec, t: TrainSpec) -> list[tuple[str, str | None]]:
    """The dense architecture: widths, heads, positions, norms, MLP kind, biases, dropout."""
    args: list[tuple[str, str | None]] = [
        ("--num-layers", str(m.num_layers)), ("--hidden-size", str(m.hidden_size)),
        ("--ffn-hidden-size", str(m.ffn_hidden_size)), ("--num-attention-heads", str(m.num_heads)),
    ]
    if m.num_kv_heads != m.num_heads:
        args += [("--group-query-attention", None), ("--num-query-groups", str(m.num_kv_heads))]
    args += [("--seq-length", str(t.seq_len)),
             ("--max-position-embeddings", str(max(t.seq_len, m.max_position_embeddings))),
             ("--normalization", "RMSNorm" if m.norm_kind is NormKind.RMSNORM else "LayerNorm"),
             ("--norm-epsilon", f"{m.norm_eps:g}")]
    if m.explicit_head_dim is not None:
        args += [("--kv-channels", str(m.head_dim))]
    args += _position_arguments(m)
    if m.arch is Arch.LLAMA:
        args += [("--swiglu", None)]
    elif m.ffn_kind is FfnKind.GELU:   # the tanh GeLU (Megatron's default is the exact one)
        args += [("--openai-gelu", None)]
    switches = ((m.qk_norm, "--qk-layernorm"), (not m.tied_embeddings, "--untie-embeddings-and-output-weights"),
                (not m.bias, "--disable-bias-linear"), (m.qkv_bias, "--add-qkv-bias"))
    args += [(flag, None) for on, flag in switches if on]
    if not m.dropout:
        args += [("--attention-dropout", "0.0"), ("--hidden-dropout", "0.0")]
    return args


def _position_arguments(m: ModelSpec) -> list[tuple[str, str | None]]:
    if m.position_kind is not PositionKind.ROPE:
        return [("--position-embedding-type", "learned_absolute")]
    if m.rope_theta != int(m.rope_theta):   # Megatron-LM parses --rotary-base as an int
        raise CannotExport(f"megatron cannot run this model: its --rotary-base is an integer, and the model's "
                           f"rope_theta is {m.rope_theta:g}")
    args: list[tuple[str, str | None]] = [("--position-embedding-type", "rope"),
                                          ("--rotary-base", str(int(m.rope_theta)))]
    if m.rotary_fraction != 1:
        args += [("--rotary-percent", f"{m.rotary_fraction:g}")]
    if m.rope_scaling_factor != 1:   # Llama 3.1's
        args += [("--use-rope-scaling", None), ("--rope-scaling-factor", f"{m.rope_scaling_factor:g}")]
    return args


def _moe_arguments(pf: PlanFile, plan: Plan, traits: FrameworkTraits) -> list[tuple[str, str | None]]:
    m = pf.model
    if not m.is_moe:
        return []
    args = [("--num-experts", str(m.num_experts)), ("--moe-router-topk", str(m.experts_per_token)),
            ("--moe-ffn-hidden-size", str(m.moe_ffn_hidden_size)),
            *_dispatcher(m, plan, pf.cluster, traits), ("--moe-grouped-gemm", None),
            ("--moe-router-load-balancing-type", "aux_loss"),
            ("--moe-aux-loss-coeff", f"{m.router_aux_loss_coef:g}"),
            ("--expert-model-parallel-size", str(plan.ep)), ("--expert-tensor-parallel-size", str(plan.etp))]
    if m.shared_expert_ffn_hidden_size:
        args += [("--moe-shared-expert-intermediate-size", str(m.shared_expert_ffn_hidden_size))]
        if m.shared_expert_gate:   # Qwen2-MoE's sigmoid gate on the shared expert
            args += [("--moe-shared-expert-gate", None)]
    if not m.moe_norm_topk_prob:
        args += [("--moe-router-pre-softmax", None)]
    return args


def _dispatcher(m: ModelSpec, plan: Plan, cluster: ClusterSpec, traits: FrameworkTraits) -> list[tuple[str, str | None]]:
    """The token dispatcher the plan was priced with (costmodel.moe_dispatch): DeepEP behind the
    flex dispatcher, a token sent once to each node and rank holding its experts, wherever that
    moves fewer bytes than every routed row or the group crosses nodes
    (needs_per_node_dispatcher); the all-to-all one otherwise, which then moves the same bytes."""
    run = run_by(cluster, traits)
    if needs_per_node_dispatcher(m, run, spans(plan, run).ep):
        # DeepEP behind the flex dispatcher (Megatron-Core deprecates --moe-enable-deepep for this)
        return [("--moe-token-dispatcher-type", "flex"), ("--moe-flex-dispatcher-backend", "deepep")]
    return [("--moe-token-dispatcher-type", "alltoall")]


def _deepseek_arguments(m: ModelSpec) -> list[tuple[str, str | None]]:
    """DeepSeek-V2/V3's mechanisms in Megatron-Core's spelling (MLATransformerConfig and the MoE
    router's fields): latent attention, dense first layers, sigmoid routing with a balancing
    bias over expert groups, scaled routed outputs, multi-token prediction."""
    args: list[tuple[str, str | None]] = []
    if m.is_mla:
        # --qk-layernorm under MLA is the latents' RMSNorms (gpt_layer_specs: the up-projections
        # become TELayerNormColumnParallelLinear), which DeepSeek's layers have and the cost
        # model prices (costmodel.params.mla_norm_params); without it Megatron drops them
        args += [("--multi-latent-attention", None), ("--qk-layernorm", None), ("--kv-lora-rank", str(m.kv_lora_rank)),
                 ("--qk-head-dim", str(m.qk_nope_head_dim)), ("--qk-pos-emb-head-dim", str(m.qk_rope_head_dim)),
                 ("--v-head-dim", str(m.v_head_dim))]
        if m.q_lora_rank:
            args += [("--q-lora-rank", str(m.q_lora_rank))]
        # YaRN as MLATransformerConfig takes it (Megatron-LM's defaults, 1 / 1 / 0, are no scaling)
        args += [("--rotary-scaling-factor", f"{m.yarn_factor:g}"), ("--mscale", f"{m.yarn_mscale:g}"),
                 ("--mscale-all-dim", f"{m.yarn_mscale_all_dim:g}")]
    if m.first_k_dense:
        args += [("--moe-layer-freq", f"([0]*{m.first_k_dense}+[1]*{m.num_layers - m.first_k_dense})")]
    if m.router_scoring == "sigmoid":
        args += [("--moe-router-score-function", "sigmoid"), ("--moe-router-enable-expert-bias", None)]
    if m.num_expert_groups > 1:
        args += [("--moe-router-num-groups", str(m.num_expert_groups)),
                 ("--moe-router-group-topk", str(m.topk_groups))]
    if m.routed_scaling_factor != 1.0:
        args += [("--moe-router-topk-scaling-factor", f"{m.routed_scaling_factor:g}")]
    if m.mtp_depth:
        args += [("--mtp-num-layers", str(m.mtp_depth))]
    return args
