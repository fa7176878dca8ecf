"""Parameter counts: whole model, per layer, and per device of a plan.

Derived from the layer layout (costmodel.layout) so the count matches the module tree the
runtime builds. Exact against published totals (tests): llama2-7b 6,738,415,616;
llama3-8b 8,030,261,248; llama2-70b 68,976,648,192; llama3-405b 405,853,388,800; and Megatron's
GPT formula P = 12 l h^2 (1 + 13/12h + (V + s)/12lh) (SC'21 Eq. 2) plus the final LayerNorm.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

from costmodel.deepseek import dense_layer_model
from costmodel.frameworks import RUNTIME, FrameworkTraits, shared_expert_split
from costmodel.layout import Linear, Style, dense_blocks
from costmodel.placement import ExpertLayout, expert_layout
from costmodel.plan import Plan
from costmodel.specs import ModelSpec, NormKind, PositionKind


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def norm_params(model: ModelSpec) -> int:
    """RMSNorm has a scale; LayerNorm a scale and a bias."""
    return model.hidden_size * (1 if model.norm_kind is NormKind.RMSNORM else 2)


def layer_param_tensors(model: ModelSpec, *, stacked_experts: bool = False) -> int:
    """Parameter tensors of one layer (weights, biases, norm scales and shifts): how many
    collectives a framework that gathers parameter by parameter issues per layer.
    `stacked_experts`: the routed experts' weights as three tensors of all experts each, as
    runtime.moe holds them, rather than three per expert."""
    norms = model.layer_norms * (1 if model.norm_kind is NormKind.RMSNORM else 2)
    moe = (1 + 3 * (1 if stacked_experts else model.num_experts) + 3 * bool(model.shared_expert_ffn_hidden_size)
           + model.shared_expert_gate) if model.is_moe else 0
    mla_norms = (1 + bool(model.q_lora_rank)) if model.is_mla else 0
    return norms + 2 * model.qk_norm + mla_norms + moe + sum(1 + lin.bias for block in dense_blocks(model) for lin in block.linears)


def edge_param_tensors(model: ModelSpec, embedding: int, head: int) -> int:
    """Parameter tensors of a rank's embedding (words, learned positions) and head (the final
    norm's, the output projection unless tied), given the parameters it holds of each."""
    words = (1 + (model.position_kind is PositionKind.LEARNED)) if embedding else 0
    norm = 1 if model.norm_kind is NormKind.RMSNORM else 2
    return words + ((norm + (head > norm_params(model))) if head else 0)


def rank_param_tensors(model: ModelSpec, held: RankParams, layers: int) -> int:
    """Parameter tensors of a rank holding `held` over `layers` layers, as the runtime holds them
    (routed experts stacked): one kernel each for a per-tensor pass (an add, a copy)."""
    return layers * layer_param_tensors(model, stacked_experts=True) + edge_param_tensors(model, held.embedding,
                                                                                          held.head)


def qk_norm_params(model: ModelSpec) -> int:
    """Qwen3's per-head Q and K norm scales in one layer (whole on every TP rank)."""
    return 2 * model.head_dim if model.qk_norm else 0


def mla_down_params(model: ModelSpec) -> int:
    """Latent attention's down-projections and their latent norms in one layer, whole on every TP
    rank (costmodel.layout's replicated style, as Megatron-Core lays them): the K/V latent with
    the shared RoPE key, and the Q latent where Q is compressed."""
    if not model.is_mla:
        return 0
    h = model.hidden_size
    kv = h * (model.kv_lora_rank + model.qk_rope_head_dim) + model.kv_lora_rank
    return kv + (h * model.q_lora_rank + model.q_lora_rank if model.q_lora_rank else 0)


def expert_params(model: ModelSpec, etp: int = 1) -> int:
    """One routed expert (a SwiGLU MLP) on one rank of its expert-TP group: its gate and up
    projections column-parallel, its down projection row-parallel over `etp` ranks (Plan.etp;
    check.etp_problems: etp divides the width). Experts are not split over the dense TP group:
    at etp 1 every TP rank holds its experts whole (runtime.parallel)."""
    return 3 * model.hidden_size * (model.moe_ffn_hidden_size // etp)


def moe_params(model: ModelSpec) -> int:
    """One layer's mixture of experts, whole: the router, every routed expert, the shared expert
    and its gate."""
    return moe_replicated_params(model) + model.num_experts * expert_params(model) if model.is_moe else 0


def shared_expert_params(model: ModelSpec, split: int = 1) -> int:
    """A layer's shared expert's three projections (its gate's vector apart) on one rank of the
    `split` ranks it is split over: 1 where the framework keeps it whole on every TP rank, the
    dense TP degree where it splits it as a dense MLP (frameworks.shared_expert_split: gate and
    up column-parallel, down row-parallel)."""
    return 3 * model.hidden_size * ceil_div(model.shared_expert_ffn_hidden_size, split)


def moe_replicated_params(model: ModelSpec) -> int:
    """The part of a layer's mixture every expert-parallel rank holds (whole, before any TP
    split of the shared expert): the router, the shared expert and its gate."""
    if not model.is_moe:
        return 0
    h = model.hidden_size
    return h * model.num_experts + shared_expert_params(model) + (h if model.shared_expert_gate else 0)


def moe_tp_replicated_params(model: ModelSpec, shared_expert_tp: bool = False) -> int:
    """What of a layer's mixture every TP rank holds whole while training on its own sequence
    shard (its gradients summed over TP: rank_time.dp_terms.tp_replica_sync_s): the router and
    the shared expert's gate, and the shared expert itself unless the framework splits it over
    TP (frameworks `shared_expert_tp`)."""
    return moe_replicated_params(model) - (shared_expert_params(model) if shared_expert_tp and model.is_moe else 0)


def layer_expert_params(model: ModelSpec, ep: int = 1, etp: int = 1) -> int:
    """The routed experts one device of a layer holds: num_experts/ep of them (Plan.ep), each
    its 1/etp share (Plan.etp)."""
    return model.num_experts // ep * expert_params(model, etp) if model.is_moe else 0


@lru_cache(maxsize=1024)
def layer_params(model: ModelSpec, tp: int = 1, ep: int = 1, etp: int = 1, shared_expert_tp: bool = False) -> int:
    """One transformer layer on one device of a TP group (tp=1: the whole layer), its routed
    experts sharded over `ep` devices and split over `etp` (the routed experts are not split over
    the dense TP group); its shared expert split over the TP group where `shared_expert_tp` (the
    framework's trait, frameworks.shared_expert_split), whole on every TP rank otherwise."""
    # norms replicated on every TP rank
    total = (model.layer_norms * norm_params(model) + qk_norm_params(model) + mla_norm_params(model)
             + moe_params(model))
    total -= layer_expert_params(model) - layer_expert_params(model, ep, etp)
    if model.is_moe:
        total -= shared_expert_params(model) - shared_expert_params(model, shared_expert_split(tp, shared_expert_tp))
    return total + sum(linear_params(lin, tp) for block in dense_blocks(model) for lin in block.linears)


def linear_params(lin: Linear, tp: int = 1) -> int:
    """One projection's weight and bias on one device of a TP group."""
    if lin.style is Style.COLWISE:
        return (lin.in_features + lin.bias) * ceil_div(lin.out_features, tp)
    if lin.style is Style.REPLICATED:
        return (lin.in_features + lin.bias) * lin.out_features
    # row-parallel: weight split on input features, bias replicated
    return ceil_div(lin.in_features, tp) * lin.out_features + lin.bias * lin.out_features


def embedding_params(model: ModelSpec, tp: int = 1) -> int:
    """Vocab-parallel word embedding (padded to a multiple of tp) plus learned positions."""
    words = ceil_div(model.vocab_size, tp) * model.hidden_size
    positions = model.max_position_embeddings * model.hidden_size \
        if model.position_kind is PositionKind.LEARNED else 0
    return words + positions


def head_params(model: ModelSpec, tp: int = 1, *, pipelined: bool = False) -> int:
    """Final norm and output projection. A tied head owns no weight, except on a separate last
    pipeline stage, which keeps its own copy of the embedding (Megatron-LM)."""
    lm_head = ceil_div(model.vocab_size, tp) * model.hidden_size
    owns_weight = not model.tied_embeddings or pipelined
    return norm_params(model) + (lm_head if owns_weight else 0)


def mla_norm_params(model: ModelSpec) -> int:
    """MLA's RMSNorms over its latents (the query's, where compressed, and the key/value's), whole
    on every TP rank (Megatron-Core's q_layernorm / kv_layernorm)."""
    return model.q_lora_rank + model.kv_lora_rank if model.is_mla else 0


def dense_first_layers_params(model: ModelSpec, tp: int = 1, shared_expert_tp: bool = False) -> int:
    """What the first `first_k_dense` layers (a dense MLP) hold beyond as many expert layers
    (negative where a mixture is larger): on one device of a TP group, routed experts whole, the
    shared expert split over TP where `shared_expert_tp` (layer_params)."""
    if not model.first_k_dense:
        return 0
    return model.first_k_dense * (layer_params(dense_layer_model(model), tp)
                                  - layer_params(model, tp, shared_expert_tp=shared_expert_tp))


def mtp_params(model: ModelSpec, tp: int = 1, ep: int = 1, etp: int = 1, shared_expert_tp: bool = False) -> int:
    """The multi-token-prediction modules' own parameters (DeepSeek-V3 Sec. 2.2), per device of a
    TP/EP group: per module two RMSNorms (the previous depth's hidden state, the next token's
    embedding), the projection of their concatenation (2h -> h, column-parallel), one layer (an
    expert layer like the model's last, its shared expert as layer_params splits it), and the
    norm before the shared output head. The embedding and output head are the model's (shared):
    DeepSeek's 14B for V3 counts them again (mtp_stored_params)."""
    h = model.hidden_size
    return model.mtp_depth * (3 * norm_params(model) + ceil_div(h, tp) * 2 * h
                              + layer_params(model, tp, ep, etp, shared_expert_tp))


def mtp_stored_params(model: ModelSpec) -> int:
    """The MTP modules as DeepSeek's checkpoint stores and counts them (V3: "14B"): their own
    parameters and a copy of the embedding and output head each."""
    return mtp_params(model) + model.mtp_depth * (embedding_params(model) + model.vocab_size * model.hidden_size)


def total_params(model: ModelSpec) -> int:
    """The main model's parameters, as transformers builds it (MTP modules apart: mtp_params)."""
    return (embedding_params(model) + model.num_layers * layer_params(model) + dense_first_layers_params(model)
            + head_params(model))


def trained_params(model: ModelSpec) -> int:
    """What training updates: the main model and its MTP modules' own parameters."""
    return total_params(model) + mtp_params(model)


def active_moe_params(model: ModelSpec) -> int:
    """One layer's mixture as a token passes through it: the router, `experts_per_token`
    experts, the shared expert and its gate."""
    idle = model.num_experts - model.experts_per_token if model.is_moe else 0
    return moe_params(model) - idle * expert_params(model)


def active_params(model: ModelSpec) -> int:
    """Parameters one token passes through: a mixture of experts' routed experts count only
    `experts_per_token` times (Mixtral 8x7B: 46.7B in all, 12.9B active)."""
    return total_params(model) - model.num_moe_layers * (moe_params(model) - active_moe_params(model))


@dataclass(frozen=True, kw_only=True, slots=True)
class RankParams:
    """Parameters held by one device of pipeline rank r before any ZeRO sharding: its layers'
    (routed experts apart), embedding, head, and its share of the layers' routed experts."""

    layers: int
    embedding: int
    head: int
    experts: int = 0
    mtp_linears: int = 0   # of `head`: the MTP modules' own linear weights, run in float8 as the layers' are

    @property
    def float8_linears(self) -> int:
        """The weights a float8 recipe runs its GEMMs with (the layers', the experts', the MTP
        modules'; not the embedding or the output head): what a framework's float8 cache copies."""
        return self.layers + self.experts + self.mtp_linears

    @property
    def total(self) -> int:
        return self.layers + self.embedding + self.head + self.experts

    @property
    def replicated(self) -> int:
        """What every data-parallel rank holds alike (ZeRO shards it over Plan.zero_ranks)."""
        return self.total - self.experts

    def zero_shard(self, plan: Plan, traits: FrameworkTraits = RUNTIME) -> float:
        """A ZeRO shard of these parameters: the replicated ones over the shard group's
        ranks (Plan.zero_ranks: dp x cp, dp / dp_replicate x cp under hybrid sharding), the experts over
        the ranks that hold the same ones (expert_dp)."""
        return self.replicated / plan.zero_ranks + self.experts / expert_dp(plan, traits)


def folds_ep(plan: Plan, traits: FrameworkTraits) -> bool:
    """Whether the framework folds the plan's expert grid (EP, and expert TP) over its TP, CP
    and DP ranks (costmodel.frameworks `ep_folds_over_tp`, placement.expert_layout) and the
    layout lets it."""
    return traits.ep_folds_over_tp and plan.ep * plan.etp > 1 and _layout(plan, True) is not None


def expert_layout_of(plan: Plan, traits: FrameworkTraits = RUNTIME) -> ExpertLayout | None:
    """The plan's expert-parallel layout as its framework lays it out (placement.expert_layout):
    folded where the framework folds, carved from dp otherwise; None where neither holds it."""
    return _layout(plan, traits.ep_folds_over_tp and plan.ep * plan.etp > 1)


def _layout(plan: Plan, fold: bool) -> ExpertLayout | None:
    order = plan.mesh_axis_order
    return expert_layout(order, tuple(plan.degree(a) for a in order), plan.ep, fold, plan.etp)


def expert_dp(plan: Plan, traits: FrameworkTraits = RUNTIME) -> int:
    """The ranks holding the same experts, over which their gradients are reduced and their
    states sharded (CP ranks included): edp x cp = dp/ep x cp where EP is carved from data
    parallelism, tp x cp x dp / (etp x ep) = world / (etp x ep x pp) where it folds (Megatron-Core's
    expert data-parallel size)."""
    layout = expert_layout_of(plan, traits) if plan.ep * plan.etp > 1 else None
    if layout is None:
        return plan.edp * plan.cp
    return prod(d for a, d in zip(layout.order, layout.degrees) if a in layout.edp_axes)


def rank_params_at(model: ModelSpec, plan: Plan, layers: int, first: bool, last: bool,
                   traits: FrameworkTraits = RUNTIME, dense: int | None = None) -> RankParams:
    """Parameters of a pipeline rank holding `layers` layers (and the embedding / head), `dense`
    of them DeepSeek's dense first layers (dense_layers_on_rank; by default all on the first
    rank, dense_layers_held); the last rank holds the MTP modules (Megatron-Core places
    them on the last stage), their routed experts with the layers' and the rest with the head,
    and, on a separate last stage, its own copy of the embedding they read (Megatron-Core's, as a
    tied head's; one weight where the head is tied). The shared expert as the framework `traits`
    holds it (layer_params)."""
    pipelined = plan.stage_rank(0) != plan.stage_rank(plan.num_virtual_stages - 1)
    replicated, experts, dense_extra, mtp, embedding, head, mtp_linears = _rank_param_parts(
        model, plan.tp, plan.ep, plan.etp, pipelined, first, last, traits.shared_expert_tp)
    dense = dense_layers_held(model.first_k_dense, first, dense)
    return RankParams(layers=layers * replicated + dense * dense_extra, experts=(layers + mtp - dense) * experts,
                      embedding=embedding, head=head, mtp_linears=mtp_linears)


def dense_layers_held(first_k_dense: int, first: bool, dense: int | None) -> int:
    """The dense first layers a rank or stage holds: `dense` where its split says
    (dense_layers_on_rank, dense_layers_by_stage; the search's spreads, planner.dense_spreads),
    else all of them on the first."""
    return (first_k_dense if first else 0) if dense is None else dense


def dense_layers_first_rank(first_k_dense: int, plan: Plan) -> tuple[int, ...]:
    """Per pipeline rank, the dense first layers it holds when all of them are on the first
    (`dense_layers_held`'s default, rank by rank)."""
    first = plan.stage_rank(0)
    return tuple(first_k_dense if rank == first else 0 for rank in range(plan.pp))


def dense_layers_by_stage(model: ModelSpec, plan: Plan) -> tuple[int, ...]:
    """Per virtual stage (pipeline order), how many of DeepSeek's dense first layers
    (ModelSpec.first_k_dense: the model's first layers) it holds: Megatron-Core's published
    DeepSeek-V3 layout Et|(tt|)*30mL puts one on the first stage and two on the second."""
    start, out = 0, []
    for n in plan.layers_per_stage:
        out.append(max(0, min(start + n, model.first_k_dense) - start))
        start += n
    return tuple(out)


def dense_layers_on_rank(model: ModelSpec, plan: Plan, rank: int) -> int:
    """How many of the dense first layers pipeline rank `rank` holds over its virtual stages."""
    if not model.first_k_dense:
        return 0
    by_stage = dense_layers_by_stage(model, plan)
    return sum(by_stage[j] for j in plan.stages_of_rank(rank))


@lru_cache(maxsize=4096)
def _rank_param_parts(model: ModelSpec, tp: int, ep: int, etp: int, pipelined: bool, first: bool,
                      last: bool, shared_expert_tp: bool) -> tuple[int, int, int, int, int, int, int]:
    """rank_params_at's terms that do not depend on the layer count (the search asks for tens of
    thousands of ranks of a few kinds): per layer, the replicated and the expert parameters;
    what a dense first layer adds; the MTP modules' expert layers; the embedding and the head
    with the MTP modules' replicated parameters; of those, the MTP modules' linears (their
    projection and their layer's replicated part: Megatron-Core runs the MTP layer under the
    float8 context, multi_token_prediction.py)."""
    experts = layer_expert_params(model, ep, etp)
    replicated = layer_params(model, tp, ep, etp, shared_expert_tp) - experts
    mtp = model.mtp_depth if last else 0
    dense_layer = layer_params(dense_layer_model(model), tp) if model.first_k_dense else 0
    mtp_replicated = mtp_params(model, tp, ep, etp, shared_expert_tp) - model.mtp_depth * experts if mtp else 0
    if mtp and pipelined and not model.tied_embeddings:
        mtp_replicated += embedding_params(model, tp)
    mtp_linears = mtp * (ceil_div(model.hidden_size, tp) * 2 * model.hidden_size + replicated)
    return (replicated, experts, dense_layer - replicated if model.first_k_dense else 0, mtp,
            embedding_params(model, tp) if first else 0,
            (head_params(model, tp, pipelined=pipelined) + mtp_replicated) if last else 0, mtp_linears)


def rank_params(model: ModelSpec, plan: Plan, rank: int, traits: FrameworkTraits = RUNTIME) -> RankParams:
    first, last = plan.stage_rank(0), plan.stage_rank(plan.num_virtual_stages - 1)
    return rank_params_at(model, plan, plan.layers_on_rank(rank), rank == first, rank == last, traits,
                          dense_layers_on_rank(model, plan, rank))


def optimized_params(held: RankParams, plan: Plan, traits: FrameworkTraits = RUNTIME) -> float:
    """What one device's optimizer steps: its ZeRO shard, or all it holds without ZeRO."""
    return held.zero_shard(plan, traits) if plan.zero_stage >= 1 else held.total
