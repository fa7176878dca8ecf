"""Per pipeline rank: the time of one micro-batch (compute and the communication on its critical
path), and the data-parallel synchronisation left exposed after overlap."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from costmodel.cluster import ClusterSpec
from costmodel.comm import (HOST_COPIES, Collective, all_reduce_algorithms_s, collective_time_s, host_copy_s,
                            p2p_time_s, ring_time_s)
from costmodel.compute import (KernelTimes, cross_entropy_s, expert_rows, fsdp_sync_s, gradient_add_s, gradient_cast_s,
                               host_optimizer_step_s, moe_tokens, optimizer_step_s, step_host_s, embedding_kernel_times,
                               head_kernel_times, layer_kernel_times)
from costmodel.flops import stops_before_final_linear
from costmodel.frameworks import FrameworkTraits
from costmodel.layout import dense_blocks
from costmodel.memory import (layer_activation_bytes, reduces_every_micro_batch, runtime_wraps_in_fsdp,
                              unsharded_between_micro_batches)
from costmodel.params import (RankParams, ceil_div, edge_param_tensors, folds_ep, fsdp_unit_layers, layer_expert_params,
                              layer_param_tensors, layer_params, moe_replicated_params, optimized_params,
                              qk_norm_params, rank_param_tensors, rank_params, rank_params_at, whole_stage_units)
from costmodel.placement import AxisSpan, group_span, stage_pair_span
from costmodel.plan import Plan, Recompute
from costmodel.specs import DType, ModelSpec, TrainSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class RankTimes:
    """Seconds per micro-batch on one pipeline rank (all its virtual stages)."""

    forward_s: float
    backward_s: float
    backward_weight_s: float  # the part of backward_s a zero-bubble schedule may defer
    recompute_s: float
    tp_comm_s: float
    cp_comm_s: float
    pp_comm_s: float
    ep_comm_s: float = 0.0   # expert parallelism's token all-to-alls
    offload_s: float = 0.0   # offloaded activations' copies to the host and back (Plan.offload_activations)

    @property
    def total_s(self) -> float:
        return (self.forward_s + self.backward_s + self.recompute_s + self.tp_comm_s
                + self.cp_comm_s + self.pp_comm_s + self.ep_comm_s + self.offload_s)

    # field by field rather than over __slots__: the search adds these a few hundred thousand times
    def __add__(self, other: "RankTimes") -> "RankTimes":
        return RankTimes(forward_s=self.forward_s + other.forward_s, backward_s=self.backward_s + other.backward_s,
                         backward_weight_s=self.backward_weight_s + other.backward_weight_s,
                         recompute_s=self.recompute_s + other.recompute_s, tp_comm_s=self.tp_comm_s + other.tp_comm_s,
                         cp_comm_s=self.cp_comm_s + other.cp_comm_s, pp_comm_s=self.pp_comm_s + other.pp_comm_s,
                         ep_comm_s=self.ep_comm_s + other.ep_comm_s, offload_s=self.offload_s + other.offload_s)

    def scaled(self, k: float) -> "RankTimes":
        return RankTimes(forward_s=self.forward_s * k, backward_s=self.backward_s * k,
                         backward_weight_s=self.backward_weight_s * k, recompute_s=self.recompute_s * k,
                         tp_comm_s=self.tp_comm_s * k, cp_comm_s=self.cp_comm_s * k, pp_comm_s=self.pp_comm_s * k,
                         ep_comm_s=self.ep_comm_s * k, offload_s=self.offload_s * k)


ZERO_TIMES = RankTimes(forward_s=0.0, backward_s=0.0, backward_weight_s=0.0, recompute_s=0.0,
                       tp_comm_s=0.0, cp_comm_s=0.0, pp_comm_s=0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankTimeModel:
    """A rank's micro-batch time is affine in its layer count and recomputed-layer count, plus
    the embedding / LM-head work of the first / last rank. The search reads this shape."""

    per_layer: RankTimes
    per_recomputed_layer: RankTimes
    first_edge: RankTimes
    last_edge: RankTimes
    pp_send_s: float  # one activation (or its gradient) to the neighbouring stage
    vpp: int

    @property
    def pp_comm_s(self) -> float:
        return self.pp_comm_with_s(self.vpp)

    def pp_comm_with_s(self, vpp: int) -> float:
        """Forward and backward sends at every virtual-stage boundary of the rank, were it to
        hold `vpp` virtual stages."""
        return 2 * vpp * self.pp_send_s

    def with_vpp(self, vpp: int) -> "RankTimeModel":
        """The same rank with `vpp` virtual stages (only its pipeline sends change)."""
        return replace(self, vpp=vpp)

    def at(self, layers: int, recomputed: int, first: bool, last: bool) -> RankTimes:
        times = self.per_layer.scaled(layers) + self.per_recomputed_layer.scaled(recomputed)
        if first:
            times = times + self.first_edge
        if last:
            times = times + self.last_edge
        return RankTimes(forward_s=times.forward_s, backward_s=times.backward_s,
                         backward_weight_s=times.backward_weight_s, recompute_s=times.recompute_s,
                         tp_comm_s=times.tp_comm_s, cp_comm_s=times.cp_comm_s,
                         pp_comm_s=times.pp_comm_s + self.pp_comm_s, ep_comm_s=times.ep_comm_s,
                         offload_s=times.offload_s)


def fastest_of(models: list[RankTimeModel]) -> RankTimeModel:
    """Every time the least the models give it (their common vpp): a rank of any of them is
    never faster, so bounds read from this hold for a mixed cluster's every rank. The deferrable
    weight pass is the largest instead: a zero-bubble fill (total - 2W) is then below every
    model's too."""
    if len(models) == 1:
        return models[0]
    def least(name: str) -> RankTimes:
        parts = [getattr(m, name) for m in models]
        return RankTimes(**{f: (max if f == "backward_weight_s" else min)(getattr(p, f) for p in parts)
                            for f in RankTimes.__slots__})
    return RankTimeModel(per_layer=least("per_layer"), per_recomputed_layer=least("per_recomputed_layer"),
                         first_edge=least("first_edge"), last_edge=least("last_edge"),
                         pp_send_s=min(m.pp_send_s for m in models), vpp=models[0].vpp)


@dataclass(frozen=True, kw_only=True, slots=True)
class Spans:
    tp: AxisSpan
    cp: AxisSpan
    pp: AxisSpan
    dp: AxisSpan  # the gradient group: dp x cp (context-parallel ranks share weights)
    ep: AxisSpan  # the token all-to-all group: ep consecutive data-parallel ranks
    edp: AxisSpan  # the experts' gradient group: edp x cp, the ranks holding the same experts


def split_dp_axis(order: tuple[str, ...], degrees: tuple[int, ...], ep: int) -> tuple[tuple, tuple]:
    """The mesh with its dp axis split into edp (outer) and ep (inner): EP groups are consecutive
    data-parallel ranks, as runtime.parallel.build_mesh lays them out."""
    i = order.index("dp")
    return (order[:i] + ("edp", "ep") + order[i + 1:],
            degrees[:i] + (degrees[i] // ep, ep) + degrees[i + 1:])


def spans(plan: Plan, cluster: ClusterSpec) -> Spans:
    return _spans(plan.mesh_axis_order, tuple(plan.degree(a) for a in plan.mesh_axis_order), plan.ep,
                  cluster.devices_per_node, folds_ep(plan, cluster.framework))


@lru_cache(maxsize=16384)
def _spans(mesh_order: tuple[str, ...], mesh_degrees: tuple[int, ...], ep: int, dpn: int,
           fold: bool = False) -> Spans:
    """Cached per layout (the search asks for the same few thousand many times; each group_span
    walks its group's ranks, thousands of them at 16k devices). `fold`: EP folded over TP
    (params.folds_ep): an EP group is the TP ranks and ep/tp data-parallel ranks, an expert's
    gradient group the rest of dp with cp."""
    tp = mesh_degrees[mesh_order.index("tp")]
    order, degrees = split_dp_axis(mesh_order, mesh_degrees, ep // tp if fold else ep)
    dp = group_span(order, degrees, ("edp", "ep", "cp"), dpn)
    # without expert parallelism the experts' group is the gradient group and EP is one rank
    one = AxisSpan(size=1, members_per_node=1, num_nodes=1)
    return Spans(tp=group_span(order, degrees, ("tp",), dpn), cp=group_span(order, degrees, ("cp",), dpn),
                 pp=group_span(order, degrees, ("pp",), dpn), dp=dp,
                 ep=group_span(order, degrees, ("ep", "tp") if fold else ("ep",), dpn) if ep > 1 else one,
                 edp=group_span(order, degrees, ("edp", "cp"), dpn) if ep > 1 else dp)


def link_costs(sp: Spans, cluster: ClusterSpec) -> tuple[float, ...]:
    """Every link time the cost model derives from a placement, each as its (latency, seconds
    per byte) pair: each collective over each axis's group, a point-to-point send on the pipeline
    and the context-parallel axis, and the tied-embedding all-reduce between the first and last
    stage. Every time the cost model prices is nondecreasing in each of these, so a placement
    whose every entry is at least another's is never faster (the search drops it). Keep this in
    step with the functions below that take a span."""
    out: list[float] = []

    def affine(time_of) -> None:  # every link time here is affine in the bytes moved
        one, two = time_of(1.0), time_of(2.0)
        out.extend((2 * one - two, two - one))

    for span in (sp.tp, sp.cp, sp.pp, sp.dp, sp.ep, sp.edp):
        # host copies depend on a group's size, not on where its ranks sit: the same for every
        # placement of the same degrees
        for kind in (k for k in Collective if k not in HOST_COPIES and k is not Collective.ALL_REDUCE):
            affine(lambda b: collective_time_s(kind, b, span, cluster))  # noqa: B023
        for algorithm in range(2):   # an all-reduce is the faster of ring and tree: both compared
            affine(lambda b: all_reduce_algorithms_s(b, span, cluster)[algorithm])  # noqa: B023
    for tier in (cluster.pipeline_tier(sp.pp.num_nodes), cluster.device.tier_for(sp.cp.num_nodes)):
        affine(lambda b: p2p_time_s(b, tier))  # noqa: B023
    affine(lambda b: stage_pair_all_reduce_s(b, sp, cluster))
    return tuple(out)


def stage_pair_all_reduce_s(num_bytes: float, sp: Spans, cluster: ClusterSpec) -> float:
    """An all-reduce between the first and the last pipeline stage's ranks (tied embeddings);
    on a mixed cluster's group view, over the link between the groups."""
    if cluster.pipeline_link is not None:
        return ring_time_s(Collective.ALL_REDUCE, num_bytes, 2, cluster.pipeline_tier(2))
    return collective_time_s(Collective.ALL_REDUCE, num_bytes, stage_pair_span(sp.pp), cluster)


def _tp_hidden_bytes(model: ModelSpec, train: TrainSpec, plan: Plan) -> int:
    """What each TP collective of a layer or the model's edges moves: the micro-batch's hidden
    states (all of them: an all-gather's output, a reduce-scatter's input)."""
    return train.compute_dtype.num_bytes * plan.micro_batch_size * train.seq_len // plan.cp * model.hidden_size


def _tp_layer_comm_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                     span: AxisSpan) -> float:
    """One direction (forward or backward) of one layer: per dense block an all-reduce, or an
    all-gather + reduce-scatter with sequence parallelism (same volume, Korthikanti Sec. 4.2.2);
    a mixture of experts routes its sequence shard without either."""
    if plan.tp == 1:
        return 0.0
    per_block = (_tp_block_collective_s(model, train, plan, cluster, span, output=False)
                 + _tp_block_collective_s(model, train, plan, cluster, span, output=True))
    return len(dense_blocks(model)) * per_block


def _tp_block_collective_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                           span: AxisSpan, output: bool) -> float:
    """One dense block's collective on its input (all-gather with sequence parallelism, else
    nothing forward) or its output (reduce-scatter with sequence parallelism, else all-reduce)."""
    num_bytes = _tp_hidden_bytes(model, train, plan)
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
                     span: AxisSpan) -> float:
    """One direction (forward or backward) of one layer under expert parallelism: the routed
    rows' dispatch to their experts' ranks and the outputs' return, two all-to-alls of the
    busiest rank's rows (computation waits on both: nothing to overlap them with)."""
    if plan.ep == 1:
        return 0.0
    tokens = moe_tokens(plan.micro_batch_size * train.seq_len // plan.cp, plan.tp)
    rows = expert_rows(model, train, tokens, plan.ep)
    return 2 * collective_time_s(Collective.ALL_TO_ALL, train.compute_dtype.num_bytes * rows * model.hidden_size,
                                 span, cluster)


def _times(fwd: float = 0.0, bwd: float = 0.0, bwd_w: float = 0.0, rc: float = 0.0,
           tp: float = 0.0, cp: float = 0.0, ep: float = 0.0) -> RankTimes:
    return RankTimes(forward_s=fwd, backward_s=bwd, backward_weight_s=bwd_w, recompute_s=rc,
                     tp_comm_s=tp, cp_comm_s=cp, pp_comm_s=0.0, ep_comm_s=ep)


def _activation_offload_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec) -> float:
    """A layer's saved activations copied to the host as forward saves them and back as backward
    reads them (Plan.offload_activations). The saved-tensor hooks copy on the compute stream,
    so neither copy overlaps the layer's kernels."""
    saved = layer_activation_bytes(model, train, plan, Recompute.NONE, cluster.framework)
    return 2 * host_copy_s(saved, cluster)


def rank_time_model(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                    sp: Spans) -> RankTimeModel:
    """Depends on the plan's degrees, micro-batch, SP, recompute mode and placement only, not on
    its layer split or recompute counts."""
    dev = cluster.device
    # a full recomputation that stops before the layer's last projection (and its TP collective)
    early = cluster.framework.recompute_early_stop and stops_before_final_linear(model, plan)
    layer = layer_kernel_times(model, train, plan, dev, not cluster.framework.cp_all_gather_kv,
                               cluster.framework.float8_casts_fused, cluster.framework.cpu_kernels,
                               cluster.framework.eager_layer, early)
    # the share of TP collectives the framework hides behind GEMMs (costmodel.frameworks)
    exposed = 1.0 - cluster.framework.tp_comm_hidden
    tp = _tp_layer_comm_s(model, train, plan, cluster, sp.tp) * exposed
    cp_fwd, cp_bwd = _cp_layer_comm_s(model, train, plan, cluster, sp.cp, layer)
    ep = _ep_layer_comm_s(model, train, plan, cluster, sp.ep)
    per_layer = _times(layer.forward_s, layer.backward_s, layer.backward_weight_s, tp=2 * tp,
                       cp=cp_fwd + cp_bwd, ep=2 * ep)
    if plan.offload_activations:
        per_layer = replace(per_layer, offload_s=_activation_offload_s(model, train, plan, cluster))
    # a recomputed forward's cost against a training one (Efficiency.recompute_cost: 1, or calibrate's fit)
    again = dev.for_dtype(train.compute_dtype).efficiency.recompute_cost
    if plan.recompute is Recompute.FULL:
        # stopping early, it never runs the collective after the MLP's row-parallel projection
        skipped_tp = (_tp_block_collective_s(model, train, plan, cluster, sp.tp, output=True) * exposed
                      if early and plan.tp > 1 else 0.0)
        per_rc = _times(rc=again * layer.recompute_forward_s, tp=tp - skipped_tp, cp=cp_fwd, ep=ep)
    elif plan.recompute is Recompute.SELECTIVE:
        per_rc = _times(rc=again * layer.attention_forward_s)
    else:
        per_rc = ZERO_TIMES
    edge_tp = _edge_tp_comm_s(train, plan, cluster, model, sp.tp)
    emb = embedding_kernel_times(model, train, plan, dev)
    head = head_kernel_times(model, train, plan, dev, cluster.framework.cpu_kernels)
    loss_s, gather_s = _gathered_logits_s(model, train, plan, cluster, sp.tp)
    # a pipeline stage's work at the device's factor for it (Efficiency.pp_stage)
    stage = dev.efficiency.pp_stage if plan.pp > 1 else 1.0
    return RankTimeModel(
        per_layer=per_layer.scaled(stage), per_recomputed_layer=per_rc.scaled(stage),
        first_edge=_times(emb.forward_s, emb.backward_s, emb.backward_weight_s, tp=edge_tp).scaled(stage),
        last_edge=_times(head.forward_s + loss_s, head.backward_s + loss_s, head.backward_weight_s,
                         tp=edge_tp + gather_s).scaled(stage),
        pp_send_s=_pp_send_s(model, train, plan, cluster, sp.pp), vpp=plan.vpp)


def rank_times(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
               sp: Spans, rank: int) -> RankTimes:
    first, last = plan.stage_rank(0), plan.stage_rank(plan.num_virtual_stages - 1)
    return rank_time_model(model, train, plan, cluster, sp).at(
        plan.layers_on_rank(rank), plan.recompute_num_layers[rank], rank == first, rank == last)


def _edge_tp_comm_s(train: TrainSpec, plan: Plan, cluster: ClusterSpec, model: ModelSpec,
                    span: AxisSpan) -> float:
    """Vocab-parallel embedding output all-reduce (reduce-scatter with SP) and the LM-head input
    all-gather / gradient all-reduce: one collective each way."""
    if plan.tp == 1:
        return 0.0
    return 2 * _tp_block_collective_s(model, train, plan, cluster, span, output=True)


def _gathered_logits_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                       span: AxisSpan) -> tuple[float, float]:
    """Where the framework gathers the logits over TP before a whole-vocabulary loss
    (frameworks.vocab_parallel_loss): (the loss over the other ranks' vocabulary, each way; the
    all-gather of one micro-batch's logits)."""
    if plan.tp == 1 or cluster.framework.vocab_parallel_loss:
        return 0.0, 0.0
    tokens = plan.micro_batch_size * train.seq_len // plan.cp
    others = model.vocab_size - ceil_div(model.vocab_size, plan.tp)
    gathered = train.compute_dtype.num_bytes * tokens * model.vocab_size
    return (cross_entropy_s(tokens, others, train, cluster.device),
            collective_time_s(Collective.ALL_GATHER, gathered, span, cluster))


def _pp_send_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
               span: AxisSpan) -> float:
    """One micro-batch's activations (or their gradient) to the next stage; with TP each rank
    sends only its 1/t slice (SC'21 scatter/gather optimisation)."""
    if plan.pp == 1:
        return 0.0
    tier = cluster.pipeline_tier(span.num_nodes)
    num_bytes = (train.compute_dtype.num_bytes * plan.micro_batch_size * train.seq_len // plan.cp
                 * model.hidden_size / plan.tp)
    return p2p_time_s(num_bytes, tier)


@dataclass(frozen=True, kw_only=True, slots=True)
class DpTerm:
    """One data-parallel synchronisation, `multiplier` times per step: collectives whose size is
    `bytes_per_param` x the rank's parameters, hidden behind the rank's forward or backward.
    `pieces_per_layer` 0: large buckets, `units` collectives' latency for the rank (one per stage
    it runs where each stage is one FSDP unit: dp_unit_layers); n >= 1: one unit (dp_groups) at a
    time, each in n collectives, every one paying the ring's latency."""

    multiplier: int
    collectives: tuple[tuple[Collective, float], ...]
    window: str  # "forward", "backward", or "none" (after the backward pass, exposed)
    pieces_per_layer: int = 0
    units: int = 1
    scale: float = 1.0   # a fraction of the collectives' time (the contention terms below)


def dp_terms(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec) -> tuple[DpTerm, ...]:
    """The synchronisations of `_dp_terms` under the cluster's framework, and for each one that
    hides behind compute a term for what hiding costs: NCCL's kernels take SMs and memory
    bandwidth from the GEMMs they run beside, so the compute slows by the device's
    `comm_contention` (fitted; 0 where unknown) x the collective's time. Counted as exposed."""
    terms = _dp_terms(model, train, plan, cluster.framework)
    if plan.offload_optimizer:
        terms = _with_host_copies(terms, plan, cluster.framework)
    contention = cluster.device.efficiency.comm_contention
    if not contention:
        return terms
    # the host copies run on copy engines, not SMs: no contention for them
    return terms + tuple(replace(t, window="none", scale=contention,
                                 collectives=tuple(c for c in t.collectives if c[0] not in HOST_COPIES))
                         for t in terms if t.window != "none")


def _with_host_copies(terms: tuple[DpTerm, ...], plan: Plan, traits: FrameworkTraits) -> tuple[DpTerm, ...]:
    """Offloaded states (FSDP2's CPUOffloadPolicy): each gather first copies the fp32 shard in
    from the host, each reduce-scatter copies the fp32 gradient shard out, on the collective's
    own stream (costmodel.comm: HOST_COPIES). Where every micro-batch reduces (ZeRO-2/3, no
    pipeline holding gradients whole), only the first copy out overlaps: each later one blocks
    and is added to the host's shard on the host (FSDP2's accumulation, costmodel.comm)."""
    m = plan.num_micro_batches
    accumulates = m > 1 and reduces_every_micro_batch(plan, traits)
    h2d, d2h = (Collective.HOST_TO_DEVICE, 4), (Collective.DEVICE_TO_HOST, 4)
    out = []
    for term in terms:
        copies = [h2d for kind, _ in term.collectives if kind is Collective.ALL_GATHER]
        if not accumulates:
            copies += [d2h for kind, _ in term.collectives if kind is Collective.REDUCE_SCATTER]
        out.append(replace(term, collectives=term.collectives + tuple(copies)))
    if accumulates:
        out += [DpTerm(multiplier=1, collectives=(d2h,), window="backward"),
                DpTerm(multiplier=m - 1, collectives=(d2h, (Collective.HOST_ADD, 12)), window="none")]
    return tuple(out)


def _dp_terms(model: ModelSpec, train: TrainSpec, plan: Plan, traits: FrameworkTraits) -> tuple[DpTerm, ...]:
    """ZeRO-0: one gradient all-reduce per step. ZeRO-1: reduce-scatter gradients, all-gather
    updated weights (Megatron's distributed optimizer). ZeRO-2: gradients sharded, so
    reduce-scattered every micro-batch. ZeRO-3 (FSDP): weights gathered for forward and again for
    backward, gradients reduce-scattered, every micro-batch, one layer (FSDP unit) at a time, or
    one parameter at a time where the framework gathers so (DeepSpeed). A framework that keeps
    gradients whole between a pipeline's micro-batches reduce-scatters once per step instead; one
    that does not overlap a collective leaves it after the backward pass (window "none")."""
    g, w, m = train.grad_dtype.num_bytes, train.compute_dtype.num_bytes, plan.num_micro_batches
    ar, ag, rs = Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER
    z = plan.zero_stage
    reduce_window = "backward" if traits.dp_grad_overlap else "none"
    gather_window = "forward" if traits.dp_param_overlap else "none"
    reduces = 1 if unsharded_between_micro_batches(plan, traits) else m
    units = 1 if traits.dp_collectives_per_layer else 0   # FSDP units below ZeRO-3 too
    stages = 1
    if units and whole_stage_units(model, plan, traits):
        # one unit a stage: its reduction follows the whole backward, its gather precedes the forward
        units, stages, reduce_window, gather_window = 0, plan.vpp, "none", "none"
    if z == 0:
        return (DpTerm(multiplier=1, collectives=((ar, g),), window=reduce_window, pieces_per_layer=units,
                       units=stages),)
    if z in (1, 2):
        return (DpTerm(multiplier=1 if z == 1 else reduces, collectives=((rs, g),), window=reduce_window,
                       pieces_per_layer=units, units=stages),
                DpTerm(multiplier=1, collectives=((ag, w),), window=gather_window, pieces_per_layer=units,
                       units=stages))
    pieces = layer_param_tensors(model) if traits.zero3_gathers_per_param else 1
    # FSDP prefetches the next layer's gather behind the current one's compute in either pass
    forward = DpTerm(multiplier=m, collectives=((ag, w),), window="forward", pieces_per_layer=pieces)
    if reduces == m and reduce_window == "backward":   # backward's gathers and reductions share its window
        return (forward, DpTerm(multiplier=m, collectives=((ag, w), (rs, g)), window="backward",
                                pieces_per_layer=pieces))
    return (forward, DpTerm(multiplier=m, collectives=((ag, w),), window="backward", pieces_per_layer=pieces),
            DpTerm(multiplier=reduces, collectives=((rs, g),), window=reduce_window, pieces_per_layer=pieces))


def dp_term_comm_s(term: DpTerm, n_params: float, cluster: ClusterSpec, span: AxisSpan,
                   unit_params: float) -> float:
    """Seconds of one synchronisation of `n_params` parameters; `unit_params`: one layer's. At
    the device's `dp_comm` over the links' fitted efficiency and latency alike
    (costmodel.cluster.Efficiency.dp_comm): scaling the bandwidth alone left TP's collectives to
    tell the links' latency from their efficiency, which one message size cannot, and priced
    the closed loops' TP plans 30-39 % too slow (BK, BL refitted, 2026-11-27)."""
    scale = term.scale / cluster.device.efficiency.dp_comm
    if not term.pieces_per_layer:
        return scale * term.units * sum(collective_time_s(kind, bpp * n_params / term.units, span, cluster)
                                        for kind, bpp in term.collectives)
    k = term.pieces_per_layer
    per_unit = sum(k * collective_time_s(kind, bpp * unit_params / k, span, cluster)
                   for kind, bpp in term.collectives)
    return scale * n_params / unit_params * per_unit


def dp_window_s(term: DpTerm, times: RankTimes, overlap: float) -> float:
    """Compute the collective can hide behind: the rank's forward or backward, times the
    device's overlap (1 with a separate communication stream, as on GPUs; lower where compute
    and communication share the cores, as gloo ranks on a CPU do)."""
    if term.window == "none":
        return 0.0
    window = times.forward_s if term.window == "forward" else times.backward_s + times.recompute_s
    return overlap * window


def dp_hidden_s(comm_s: float, window_s: float, bucket_s: float) -> float:
    """Bucketed overlap: the collective hides behind the window, except the last bucket (one
    layer's parameters: the first to gather, the last to reduce) stays exposed."""
    return max(comm_s - window_s, bucket_s)


def dp_unit_layers(model: ModelSpec, plan: Plan, traits: FrameworkTraits) -> int:
    """Layers a DP unit of dp_groups holds: the framework's FSDP unit (params.fsdp_unit_layers),
    one layer where a stage is one unit whole (DpTerm.units prices those) or the framework
    buckets otherwise (pieces_per_layer 0: the unit is then the last bucket's, dp_bucket_s)."""
    if not traits.dp_collectives_per_layer or whole_stage_units(model, plan, traits):
        return 1
    return fsdp_unit_layers(model, plan)


def dp_groups(model: ModelSpec, plan: Plan, sp: Spans, held: RankParams,
              traits: FrameworkTraits) -> list[tuple[float, float, AxisSpan]]:
    """(parameters, one DP unit's of them, span) per gradient group of a device holding `held`:
    everything over dp x cp; under expert parallelism the routed experts over edp x cp apart. A
    unit of several layers (dp_unit_layers) counts its collectives by the rank's parameters over
    its own, the embedding and head among them: exact where every stage's layers fill whole units
    beside a root of about one unit's size, within a unit's latency otherwise."""
    if plan.ep == 1:
        return [(held.total, dp_unit_layers(model, plan, traits) * layer_params(model, plan.tp), sp.dp)]
    experts = layer_expert_params(model, plan.ep)
    return [(held.replicated, layer_params(model, plan.tp, plan.ep) - experts, sp.dp),
            (held.experts, experts, sp.edp)]


def tp_replica_sync_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec, sp: Spans,
                      layers: int) -> float:
    """Parameters every TP rank holds whole but trains on its own share: a mixture of experts
    (each TP rank routes its sequence shard) and per-head Q/K norms (each rank's heads). Once the
    data-parallel reduction has left each rank its gradient shards (replicated ones over dp x cp,
    experts over edp x cp), they are all-reduced over TP before the optimizer step in one
    collective, exposed (runtime.job.sync_replicated_over_tp). Affine in the rank's layers."""
    if plan.tp == 1 or not (model.is_moe or model.qk_norm):
        return 0.0
    # ZeRO-0 keeps whole gradients (FSDP2 over a unit shard axis: runtime.parallel.dp_mesh_for)
    sharded = plan.zero_stage > 0
    # experts folded over TP (params.folds_ep) are each on one TP rank: nothing to sum for them
    experts = 0 if folds_ep(plan, cluster.framework) else layer_expert_params(model, plan.ep)
    shard = (moe_replicated_params(model) + qk_norm_params(model)) / (plan.dp * plan.cp if sharded else 1)
    if experts:
        shard += experts / (plan.edp * plan.cp if sharded else 1)
    return collective_time_s(Collective.ALL_REDUCE, layers * shard * train.grad_dtype.num_bytes, sp.tp, cluster)


def after_pipeline_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec, sp: Spans,
                     held: RankParams, layers: int) -> tuple[float, float, float]:
    """(optimizer step, the step's own host work, the TP-replicated parameters' gradient sync) of a
    rank holding `held` over `layers` layers: what it does once its pipeline work and DP reduction
    are done. Offloaded states step on the host. The host work is apart from the optimizer so that
    a run's table compares the optimizer with the optimizer it times (runtime.measure)."""
    step = (host_optimizer_step_s(held.zero_shard(plan, cluster.framework), train, cluster) if plan.offload_optimizer
            else optimizer_step_s(optimized_params(held, plan, cluster.framework), train, cluster.device))
    return (step, step_host_s(train, cluster.device),   # once a step, after the pipeline
            tp_replica_sync_s(model, train, plan, cluster, sp, layers))


def grad_accumulation_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec, held: RankParams,
                        layers: int) -> float:
    """A step's gradient accumulation on a rank holding `held` over `layers` layers: every
    micro-batch after the first adds its gradients into the step's, in place, one kernel per
    parameter tensor. The adds run inside each micro-batch's backward; priced once a step, beside
    the optimizer, as the search's rank shapes take it: affine in the layers. On a 2-core EPYC it
    was 26.6 ms a step of a 10.9M-parameter fp32 model's 8 micro-batches (`python
    benchmarks/step_trace.py PLAN --steps 2 --rows 400 --shapes` on a closed loop's one-rank
    micro-batch-1 fp32 plan, 2026-11-28; README, "What a pipeline adds").
    - Whole gradients (ZeRO-0/1, or a pipeline holding them whole) arrive in the compute dtype:
      fp32 ones add into fp32 (autograd; the runtime takes no reduce dtype in fp32), 16-bit ones
      into the grad dtype, FSDP2 casting the first micro-batch's into that accumulator.
    - ZeRO-2/3 reducing every micro-batch add the reduced shard into the sharded gradient, which
      FSDP2 keeps in the sharded parameter's dtype: fp32 under fp32 master weights (the reduced
      shard's cast to it is the reduction's, not priced here). Offloaded states add on the host
      (_with_host_copies prices it).
    - Where the framework fuses the adds into its weight-gradient GEMMs (costmodel.frameworks
      `fused_grad_accumulation`), only the embedding's gradient, which no GEMM makes, adds into
      the fp32 buffer in a hook, every micro-batch."""
    m, traits = plan.num_micro_batches, cluster.framework
    dev = cluster.device.for_dtype(train.compute_dtype)
    new, grad = train.compute_dtype, train.grad_dtype
    if traits.fused_grad_accumulation:   # no embedding on the rank: nothing to add, no kernel
        return m * gradient_add_s(held.embedding, new, grad, edge_param_tensors(model, held.embedding, 0), dev)
    if m == 1:
        return 0.0
    tensors = rank_param_tensors(model, held, layers)
    if reduces_every_micro_batch(plan, traits):
        if plan.offload_optimizer:
            return 0.0
        fp32_params = new is DType.FP32 or (traits.fsdp_master_params and train.master_weights_fp32)
        shard = DType.FP32 if fp32_params else grad
        return (m - 1) * gradient_add_s(held.zero_shard(plan, traits), shard, shard, tensors, dev)
    accumulator = grad if new is not DType.FP32 else DType.FP32
    cast = gradient_cast_s(held.total, new, accumulator, tensors, dev) if new is not accumulator else 0.0
    return cast + (m - 1) * gradient_add_s(held.total, new, accumulator, tensors, dev)


def one_replica_fsdp_parts_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec, held: RankParams,
                             layers: int) -> tuple[float, float]:
    """(reduces, gathers): a step's FSDP2 gradient reductions and parameter gathers on a rank
    holding `held` over `layers` layers, where the framework wraps a plan of one data-parallel
    replica in FSDP (costmodel.frameworks `one_replica_fsdp`): on a one-rank group they are FSDP's
    copies and casts alone, which dp_exposed_s (no collective on one rank) prices at nothing. As
    runtime.train and torch pipelining drive FSDP2:
    - reduces: once a step (sync on the last micro-batch) below ZeRO-2 or where a pipeline holds the
      gradients whole; after every micro-batch above it otherwise;
    - gathers: once, by the step's first forward (the last backward resharded), below ZeRO-3;
      under ZeRO-3 every forward reshards after itself (reshard_after_forward), so each forward
      and each backward gathers again (2m), except that under a pipeline the backward leaves them
      whole for what follows until the last micro-batch: m forwards and one backward (m + 1,
      GPipe and 1F1B alike).
    Offloaded states are left to the host copies' price. Not priced: the experts' own unit on a
    one-rank expert group (ep = dp), and the re-gathers of an interleaved schedule that keeps at
    most three virtual stages unsharded."""
    traits = cluster.framework
    if (not traits.one_replica_fsdp or plan.dp * plan.cp > 1 or plan.offload_optimizer
            or not runtime_wraps_in_fsdp(plan, train)):
        return 0.0, 0.0
    m, z = plan.num_micro_batches, plan.zero_stage
    reduces = m if reduces_every_micro_batch(plan, traits) else 1
    gathers = 1 if z < 3 else (m + 1 if unsharded_between_micro_batches(plan, traits) else 2 * m)
    dev = cluster.device.for_dtype(train.compute_dtype)
    tensors = rank_param_tensors(model, held, layers)
    return (reduces * fsdp_sync_s("reduce", held.total, train.compute_dtype, tensors, dev),
            gathers * fsdp_sync_s("gather", held.total, train.compute_dtype, tensors, dev))


def one_replica_fsdp_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec, held: RankParams,
                       layers: int) -> float:
    """one_replica_fsdp_parts_s in all: priced once a step beside the optimizer (affine in the
    layers, as the search's rank shapes take it). The runtime times the gathers and, without a
    pipeline, the reduce inside the passes; a pipeline's once-a-step reduce as its DP sync
    (runtime.pipeline's perform_reduce_grad)."""
    return sum(one_replica_fsdp_parts_s(model, train, plan, cluster, held, layers))


def dp_bucket_s(model: ModelSpec, plan: Plan, term: DpTerm, cluster: ClusterSpec, sp: Spans) -> float:
    """One DP unit's collectives of a term (in each gradient group; dp_unit_layers)."""
    one = rank_params_at(model, plan, 1, False, False)
    return sum(dp_term_comm_s(term, unit, cluster, span, unit)
               for _, unit, span in dp_groups(model, plan, sp, one, cluster.framework))


def dp_exposed_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                 sp: Spans, rank: int, times: RankTimes) -> float:
    """Gradient reduction and parameter gathers over the dp x cp group (and the experts' edp x cp
    group), minus what hides."""
    if sp.dp.size == 1 and not plan.offload_optimizer:
        return 0.0
    groups = dp_groups(model, plan, sp, rank_params(model, plan, rank), cluster.framework)
    overlap = cluster.device.efficiency.overlap
    return sum(t.multiplier * dp_hidden_s(sum(dp_term_comm_s(t, n, cluster, span, unit) for n, unit, span in groups),
                                          dp_window_s(t, times, overlap), dp_bucket_s(model, plan, t, cluster, sp))
               for t in dp_terms(model, train, plan, cluster))
