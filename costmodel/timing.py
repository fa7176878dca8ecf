"""Per pipeline rank: the time of one micro-batch (compute and the communication on its critical
path), and the data-parallel synchronisation left exposed after overlap."""
from __future__ import annotations

from dataclasses import dataclass

from costmodel.cluster import ClusterSpec
from costmodel.comm import Collective, collective_time_s, p2p_time_s
from costmodel.compute import (KernelTimes, embedding_kernel_times, head_kernel_times,
                               layer_kernel_times)
from costmodel.layout import layer_blocks
from costmodel.params import rank_params
from costmodel.placement import AxisSpan, group_span
from costmodel.plan import Plan, Recompute
from costmodel.specs import ModelSpec, TrainSpec


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

    @property
    def total_s(self) -> float:
        return (self.forward_s + self.backward_s + self.recompute_s + self.tp_comm_s
                + self.cp_comm_s + self.pp_comm_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class Spans:
    tp: AxisSpan
    cp: AxisSpan
    pp: AxisSpan
    dp: AxisSpan  # the gradient group: dp x cp (context-parallel ranks share weights)


def spans(plan: Plan, cluster: ClusterSpec) -> Spans:
    order = plan.mesh_axis_order
    degrees = tuple(plan.degree(a) for a in order)
    dpn = cluster.devices_per_node
    return Spans(tp=group_span(order, degrees, ("tp",), dpn), cp=group_span(order, degrees, ("cp",), dpn),
                 pp=group_span(order, degrees, ("pp",), dpn), dp=group_span(order, degrees, ("dp", "cp"), dpn))


def _tp_layer_comm_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                     span: AxisSpan) -> float:
    """One direction (forward or backward) of one layer: per block an all-reduce, or an
    all-gather + reduce-scatter with sequence parallelism (same volume, Korthikanti Sec. 4.2.2)."""
    if plan.tp == 1:
        return 0.0
    num_bytes = train.compute_dtype.num_bytes * plan.micro_batch_size * train.seq_len // plan.cp \
        * model.hidden_size
    if plan.sequence_parallel:
        per_block = (collective_time_s(Collective.ALL_GATHER, num_bytes, span, cluster)
                     + collective_time_s(Collective.REDUCE_SCATTER, num_bytes, span, cluster))
    else:
        per_block = collective_time_s(Collective.ALL_REDUCE, num_bytes, span, cluster)
    return len(layer_blocks(model)) * per_block


def _cp_layer_comm_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                     span: AxisSpan, kernels: KernelTimes) -> tuple[float, float]:
    """Ring attention (Liu et al. 2023): cp-1 hops of the local K and V block, overlapped with the
    attention core; backward also returns dK, dV. Returns the exposed (forward, backward) parts."""
    if plan.cp == 1:
        return 0.0, 0.0
    tier = cluster.device.inter_node if span.crosses_nodes else cluster.device.intra_node
    kv_bytes = (2 * train.compute_dtype.num_bytes * plan.micro_batch_size
                * (train.seq_len // plan.cp) * model.kv_hidden_size / plan.tp)
    hops = plan.cp - 1
    fwd = hops * p2p_time_s(kv_bytes, tier)
    return (max(0.0, fwd - kernels.attention_forward_s),
            max(0.0, 2 * fwd - kernels.attention_forward_s * 2.5))


def rank_times(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
               sp: Spans, rank: int) -> RankTimes:
    dev = cluster.device
    layer = layer_kernel_times(model, train, plan, dev)
    tp = _tp_layer_comm_s(model, train, plan, cluster, sp.tp)
    cp_fwd, cp_bwd = _cp_layer_comm_s(model, train, plan, cluster, sp.cp, layer)
    n, n_rc = plan.layers_on_rank(rank), plan.recompute_num_layers[rank]
    fwd, bwd, bwd_w = n * layer.forward_s, n * layer.backward_s, n * layer.backward_weight_s
    tp_s, cp_s = 2 * n * tp, n * (cp_fwd + cp_bwd)
    edge_tp = _edge_tp_comm_s(train, plan, cluster, model, sp.tp)
    if rank == plan.stage_rank(0):
        emb = embedding_kernel_times(model, train, plan, dev)
        fwd, bwd, bwd_w, tp_s = fwd + emb.forward_s, bwd + emb.backward_s, bwd_w + emb.backward_weight_s, tp_s + edge_tp
    if rank == plan.stage_rank(plan.num_virtual_stages - 1):
        head = head_kernel_times(model, train, plan, dev)
        fwd, bwd, bwd_w, tp_s = fwd + head.forward_s, bwd + head.backward_s, bwd_w + head.backward_weight_s, tp_s + edge_tp
    recompute = 0.0
    if plan.recompute is Recompute.FULL:
        recompute = n_rc * layer.forward_s
        tp_s += n_rc * tp
        cp_s += n_rc * cp_fwd
    elif plan.recompute is Recompute.SELECTIVE:
        recompute = n_rc * layer.attention_forward_s
    return RankTimes(forward_s=fwd, backward_s=bwd, backward_weight_s=bwd_w, recompute_s=recompute,
                     tp_comm_s=tp_s, cp_comm_s=cp_s, pp_comm_s=_pp_comm_s(model, train, plan, cluster, sp.pp))


def _edge_tp_comm_s(train: TrainSpec, plan: Plan, cluster: ClusterSpec, model: ModelSpec,
                    span: AxisSpan) -> float:
    """Vocab-parallel embedding output all-reduce (reduce-scatter with SP) and the LM-head input
    all-gather / gradient all-reduce: one collective each way."""
    if plan.tp == 1:
        return 0.0
    num_bytes = train.compute_dtype.num_bytes * plan.micro_batch_size * train.seq_len // plan.cp \
        * model.hidden_size
    kind = Collective.REDUCE_SCATTER if plan.sequence_parallel else Collective.ALL_REDUCE
    return 2 * collective_time_s(kind, num_bytes, span, cluster)


def _pp_comm_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
               span: AxisSpan) -> float:
    """Send activations forward and gradients backward at every virtual-stage boundary of the
    rank; with TP each rank sends only its 1/t slice (SC'21 scatter/gather optimisation)."""
    if plan.pp == 1:
        return 0.0
    tier = cluster.device.inter_node if span.crosses_nodes else cluster.device.intra_node
    num_bytes = (train.compute_dtype.num_bytes * plan.micro_batch_size * train.seq_len // plan.cp
                 * model.hidden_size / plan.tp)
    return 2 * plan.vpp * p2p_time_s(num_bytes, tier)


def dp_exposed_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                 sp: Spans, rank: int, times: RankTimes) -> float:
    """Gradient reduction and parameter gathers over the dp x cp group, minus what hides behind
    compute: step-level collectives overlap the last micro-batch's backward (gradients) or the
    first forward (parameters), bucket by bucket, so at least one layer's bucket stays exposed;
    ZeRO-2/3 collectives run every micro-batch behind that micro-batch's compute."""
    if sp.dp.size == 1:
        return 0.0
    n_params = rank_params(model, plan, rank).total
    grads = n_params * train.grad_dtype.num_bytes
    weights = n_params * train.compute_dtype.num_bytes
    buckets = max(1, plan.layers_on_rank(rank))
    t = lambda kind, b: collective_time_s(kind, b, sp.dp, cluster)  # noqa: E731
    hide = lambda comm, window: max(comm - window, comm / buckets)  # noqa: E731
    bwd, fwd, m = times.backward_s + times.recompute_s, times.forward_s, plan.num_micro_batches
    z = plan.zero_stage
    if z == 0:
        return hide(t(Collective.ALL_REDUCE, grads), bwd)
    if z == 1:
        return hide(t(Collective.REDUCE_SCATTER, grads), bwd) + hide(t(Collective.ALL_GATHER, weights), fwd)
    if z == 2:
        return m * hide(t(Collective.REDUCE_SCATTER, grads), bwd) + hide(t(Collective.ALL_GATHER, weights), fwd)
    gather = t(Collective.ALL_GATHER, weights)
    return m * (hide(gather, fwd) + hide(gather + t(Collective.REDUCE_SCATTER, grads), bwd))
