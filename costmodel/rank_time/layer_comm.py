"""A layer's communication per micro-batch: tensor-parallel collectives, context-parallel K/V
exchange, expert all-to-alls, activation offload copies, the head's and embedding's collectives
and pipeline sends."""
from __future__ import annotations

from costmodel.comm import Collective, collective_time_s, host_copy_s, p2p_time_s
from costmodel.hardware import ClusterSpec
from costmodel.kernels import KernelTimes, cross_entropy_s, expert_rows, moe_tokens
from costmodel.layout import Block, dense_blocks
from costmodel.memory import layer_activation_bytes, send_bytes
from costmodel.moe_dispatch import dispatch_combine_s
from costmodel.params import ceil_div
from costmodel.placement import AxisSpan, same_node
from costmodel.plan import Plan, Recompute
from costmodel.rank_time.contention import partly_hidden_cost
from costmodel.schedules import interleaved_warmup_chunks
from costmodel.specs import ModelSpec, TrainSpec


def _tp_hidden_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, width: int | None = None,
                     element_bytes: int | None = None) -> int:
    """What each TP collective of a layer or the model's edges moves: the micro-batch's hidden
    states (all of them: an all-gather's output, a reduce-scatter's input), or `width` features
    of each token, at `element_bytes` an element (default: the compute dtype's)."""
    size = train.compute_dtype.num_bytes if element_bytes is None else element_bytes
    return size * plan.micro_batch_size * train.seq_len // plan.cp * (model.hidden_size if width is None else width)


# A float8 element: what a float8 linear's sequence-parallel all-gather moves (_float8_gathers)
FLOAT8_BYTES = 1


def _float8_gathers(plan: Plan, cluster: ClusterSpec) -> bool:
    """Whether a layer's sequence-parallel all-gathers move float8 rather than compute-dtype
    elements: with float8 linears under TP (costmodel.frameworks `float8_with_tp`) each input is
    cast before it is gathered, and in backward each output gradient is cast before its gather,
    so both all-gathers of a dense block move a byte an element; the reduce-scatters (the row-
    parallel output, the column-parallel input gradient) sum partial results in the compute
    dtype. torchao's float8 TP styles, which torchtitan applies with its tensorwise recipe
    (Float8ColwiseParallel / PrepareFloat8ModuleInput cast, then redistribute;
    Float8RowwiseParallel's _NoopFwToFloat8BwDynamic casts the gradient before the redistribute's
    backward gathers it: torchao/float8/float8_tensor_parallel.py; torchtitan parallelize.py
    `enable_float8_tensorwise_tp`: "float8 all-gather with TP"); Transformer Engine under
    Megatron-Core gathers its FP8-cast LayerNorm output and, in `grad_output_preprocess`, the
    FP8-cast output gradient ("cast, transpose for efficient gather",
    transformer_engine/pytorch/module/base.py)."""
    return plan.fp8_linears and plan.sequence_parallel and cluster.framework.float8_with_tp


def _tp_input_width(model: ModelSpec, block: Block) -> int:
    """Features of each token a dense block's input collective moves: the hidden states, or, for
    latent attention, what its column-parallel up-projections read (the query latent, or the
    input itself without one, the key/value latent and the RoPE key), gathered in their place by
    our runtime (runtime.latent_attention) as by Megatron-Core's MLASelfAttention."""
    if block.name == "attention" and model.is_mla:
        return (model.q_lora_rank or model.hidden_size) + model.kv_lora_rank + model.qk_rope_head_dim
    return model.hidden_size


def _tp_layer_comm_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                     span: AxisSpan) -> float:
    """One direction (forward or backward) of one layer: per dense block an all-reduce, or an
    all-gather + reduce-scatter with sequence parallelism (same volume, Korthikanti Sec. 4.2.2);
    a mixture of experts routes its sequence shard without either, but a shared expert the
    framework splits over TP pays a dense MLP's (_split_shared_experts)."""
    if plan.tp == 1:
        return 0.0
    out = _tp_block_collective_s(model, train, plan, cluster, span, output=True)
    gathered_bytes = FLOAT8_BYTES if _float8_gathers(plan, cluster) else None
    widths = [_tp_input_width(model, block) for block in dense_blocks(model)]
    widths += [model.hidden_size] * _split_shared_experts(model, plan, cluster)
    return sum(out + _tp_block_collective_s(model, train, plan, cluster, span, output=False,
                                            width=width, element_bytes=gathered_bytes)
               for width in widths)


def _split_shared_experts(model: ModelSpec, plan: Plan, cluster: ClusterSpec) -> int:
    """1 where the layer's shared expert is split over the TP group as a dense MLP
    (costmodel.frameworks `shared_expert_tp`): Megatron-Core's SharedExpertMLP gathers its
    sequence shard before fc1 and reduce-scatters after fc2 itself (all-reduces without SP), as
    the dense blocks do; torchtitan's mixture does so once around router and shared expert. 0 where
    the shared expert is whole on every TP rank over its shard, or there is none."""
    split = plan.tp > 1 and cluster.framework.shared_expert_tp
    return 1 if split and model.is_moe and model.shared_expert_ffn_hidden_size else 0


def _sp_regather_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec, span: AxisSpan) -> float:
    """A layer's backward all-gathers of the sequence shards its dense blocks kept instead of
    their gathered inputs (Korthikanti et al. 2022 Sec. 4.2.2), where nothing hides them
    (costmodel.frameworks `sp_regather_exposed`). Latent attention keeps its gathered latents
    and gathers again only an uncompressed query's input."""
    traits = cluster.framework
    if plan.tp == 1 or not plan.sequence_parallel or traits.tp_keeps_gathered_input or not traits.sp_regather_exposed:
        return 0.0
    shards = sum(1 for block in dense_blocks(model)
                 if not (model.is_mla and block.name == "attention" and model.q_lora_rank))
    shards += _split_shared_experts(model, plan, cluster)
    return shards * _tp_block_collective_s(model, train, plan, cluster, span, output=False)


def _tp_block_collective_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                           span: AxisSpan, output: bool, width: int | None = None,
                           element_bytes: int | None = None) -> float:
    """One dense block's collective on its input (all-gather with sequence parallelism, else
    nothing forward) or its output (reduce-scatter with sequence parallelism, else all-reduce), of
    the hidden states or `width` features a token, at `element_bytes` an element."""
    num_bytes = _tp_hidden_bytes(model, train, plan, width, element_bytes)
    if not plan.sequence_parallel:
        return collective_time_s(Collective.ALL_REDUCE, num_bytes, span, cluster) if output else 0.0
    return collective_time_s(Collective.REDUCE_SCATTER if output else Collective.ALL_GATHER, num_bytes, span, cluster)


def _cp_layer_comm_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                     span: AxisSpan, kernels: KernelTimes) -> tuple[float, float]:
    """The exposed (forward, backward) K/V exchange of one layer. All-gathered (our runtime,
    costmodel.frameworks `cp_all_gather_kv`): the whole sequence's K and V gathered before
    attention, their gradients reduce-scattered after it, neither hidden. Ring attention (Liu et
    al. 2023): cp-1 hops of the local K and V block, overlapped with the attention core;
    backward also returns dK, dV."""
    if plan.cp == 1:
        return 0.0, 0.0
    if cluster.framework.cp_all_gather_kv:
        whole = (2 * train.compute_dtype.num_bytes * plan.micro_batch_size * train.seq_len
                 * model.kv_hidden_size / plan.tp)
        return (collective_time_s(Collective.ALL_GATHER, whole, span, cluster),
                collective_time_s(Collective.REDUCE_SCATTER, whole, span, cluster))
    tier = cluster.device.tier_for(span.num_nodes)
    kv_bytes = (2 * train.compute_dtype.num_bytes * plan.micro_batch_size
                * (train.seq_len // plan.cp) * model.kv_hidden_size / plan.tp)
    hops = plan.cp - 1
    fwd = hops * p2p_time_s(kv_bytes, tier)
    return (max(0.0, fwd - kernels.attention_forward_s),
            max(0.0, 2 * fwd - kernels.attention_forward_s * 2.5))


def _ep_layer_comm_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                     span: AxisSpan, etp_span: AxisSpan | None = None) -> float:
    """One direction (forward or backward) of one layer under expert parallelism: the routed
    rows' dispatch to their experts' ranks and the outputs' return, two all-to-alls of the
    busiest rank's rows (computation waits on both: nothing to overlap them with), node-limited
    routing's bound on a token's network copies included (costmodel.moe_dispatch). Under expert
    TP (Plan.etp) the rows each rank received are all-gathered over its etp ranks before the
    experts and their outputs reduce-scattered after (backward: the reverse, the same bytes),
    as Megatron-Core's all-to-all dispatcher does (dispatch_postprocess, combine_preprocess)."""
    if plan.ep * plan.etp == 1:
        return 0.0
    tokens = moe_tokens(plan.micro_batch_size * train.seq_len // plan.cp, plan.tp)
    rows = expert_rows(model, train, tokens, plan.ep)
    out = dispatch_combine_s(model, train, rows, span, cluster) if plan.ep > 1 else 0.0
    if plan.etp > 1:
        gathered = train.compute_dtype.num_bytes * plan.etp * rows * model.hidden_size
        out += (collective_time_s(Collective.ALL_GATHER, gathered, etp_span, cluster)
                + collective_time_s(Collective.REDUCE_SCATTER, gathered, etp_span, cluster))
    return out


def _activation_offload_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec) -> float:
    """A layer's saved activations copied to the host as forward saves them and back as backward
    reads them (Plan.offload_activations). The saved-tensor hooks copy on the compute stream,
    so neither copy overlaps the layer's kernels."""
    saved = layer_activation_bytes(model, train, plan, Recompute.NONE, cluster.framework)
    return 2 * host_copy_s(saved, cluster)


def _edge_tp_comm_s(train: TrainSpec, plan: Plan, cluster: ClusterSpec, model: ModelSpec,
                    span: AxisSpan) -> float:
    """Vocab-parallel embedding output all-reduce (reduce-scatter with SP) and the LM-head input
    all-gather / gradient all-reduce: one collective each way."""
    if plan.tp == 1:
        return 0.0
    return 2 * _tp_block_collective_s(model, train, plan, cluster, span, output=True)


def _gathered_logits_loss_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec) -> float:
    """Where the framework gathers the logits over TP before a whole-vocabulary loss
    (frameworks.vocab_parallel_loss): the loss over the other ranks' vocabulary, each way."""
    if plan.tp == 1 or cluster.framework.vocab_parallel_loss:
        return 0.0
    tokens = plan.micro_batch_size * train.seq_len // plan.cp
    return cross_entropy_s(tokens, model.vocab_size - ceil_div(model.vocab_size, plan.tp), train, cluster.device)


def _gathered_logits_gather_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                              span: AxisSpan) -> float:
    """Where the framework gathers the logits over TP before a whole-vocabulary loss: the
    all-gather of one micro-batch's logits."""
    if plan.tp == 1 or cluster.framework.vocab_parallel_loss:
        return 0.0
    tokens = plan.micro_batch_size * train.seq_len // plan.cp
    gathered = train.compute_dtype.num_bytes * tokens * model.vocab_size
    return collective_time_s(Collective.ALL_GATHER, gathered, span, cluster)


def pp_rank_sends_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                    span: AxisSpan) -> tuple[tuple[float, float], ...]:
    """Per pipeline rank, (its send to the next rank, its send to the previous one), round the
    ring (interleaved chunks hand on from the last rank to the first), each on its own link
    (pp_sends_s, placement.same_node): RankTimeModel.sends_s. A mixed cluster's pipelines cross
    the groups' link: every send at its tier. Without a pipeline, none."""
    if plan.pp == 1:
        return ()
    within, across = pp_sends_s(model, train, plan, cluster, span)
    p = span.size   # the pipeline's degree (`plan` may be a shape that only says there is one)
    if cluster.pipeline_link is not None:
        return ((across, across),) * p

    def send_s(r: int, k: int) -> float:
        return within if same_node(span, r, k % p) else across
    return tuple((send_s(r, r + 1), send_s(r, r - 1)) for r in range(p))


def send_cost_share(pp: int, vpp: int, num_micro_batches: int, hidden_cost: float) -> float:
    """The share of a pipeline rank's gradient sends (to the previous stage) that its step pays
    under Megatron-Core's interleaved schedule (frameworks `steady_sends_overlap`): those of the
    first rank's flush whole (it has the most: 2(p-1) + (v-1)·p of its m·v chunks, as many as its
    warm-up forwards, schedules.interleaved_warmup_chunks), the steady state's at `hidden_cost`
    (the device's comm_contention: what a second of communication hidden behind compute costs,
    as for DP's and TP's collectives). Its activation sends are waited for in the steady state too
    (the step pays them whole). Priced as that share of every gradient send, so the simulation and
    the closed forms charge a step alike. `hidden_cost` 1: every send is waited for."""
    if hidden_cost >= 1.0 or vpp == 1:
        return 1.0
    waited = min(1.0, (interleaved_warmup_chunks(pp, vpp, 0) - 1) / (num_micro_batches * vpp))
    return partly_hidden_cost(waited, hidden_cost)


def pp_sends_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
               span: AxisSpan) -> tuple[float, float]:
    """(within a node, across nodes): one micro-batch's activations (or their gradient) to a
    neighbouring stage's rank on the same node (its NVLink) and on another (the tier the
    pipeline's group crosses): what the stage hands on (costmodel.memory.send_bytes), its 1/t
    sequence shard under SP and the whole activation without (Megatron-Core's get_tensor_shapes
    divides the sequence by TP only under sequence parallelism), except where the framework
    scatters the replicated activation over TP (`pipeline_send_scatter`: SC'21's Megatron-LM;
    the receiver's all-gather over NVLink is not counted). DeepSpeed's PipelineEngine (`pipe_engine_sends`) sends the 1/t slice forward
    with the s x s attention mask in 16 bits beside it, and the whole gradient back from every
    TP rank. Its schedule runs each send and each receive as its own blocking instruction
    (SendActivation, RecvActivation, SendGrad, RecvGrad: runtime/pipe/p2p.py's send and recv
    refuse async_op), so a stage is held for both transfers it sends and both it receives, where
    Megatron pairs a send with a receive in one batched call: priced as the two transfers' sum,
    the simulation's one send a way (a middle rank pays it twice a micro-batch, an end rank once;
    a hand-off's latency is then one transfer long, a small pessimism in the fill and the drain)."""
    whole = (train.compute_dtype.num_bytes * plan.micro_batch_size * train.seq_len // plan.cp
             * model.hidden_size)
    mask = 2.0 * (train.seq_len // plan.cp) * train.seq_len

    def send_s(tier) -> float:
        if cluster.framework.pipeline_send_scatter:
            return p2p_time_s(whole / plan.tp, tier)
        if not cluster.framework.pipe_engine_sends:
            return p2p_time_s(send_bytes(model, train, plan), tier)
        return p2p_time_s(whole / plan.tp + mask, tier) + p2p_time_s(whole, tier)
    return send_s(cluster.pipeline_tier(1)), send_s(cluster.pipeline_tier(span.num_nodes))
