"""The parts a rank's time model (costmodel.rank_time.times) is assembled from, each computed
once per what it reads: the compute (kernel times and the factors on them) per TimeShape, the
plan fields the model reads, and each axis's collectives per the span of its group and the
few plan fields their bytes depend on. A search prices tens of thousands of placements of a few
thousand shapes; the parts of one are shared by all of them."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Callable

from costmodel.comm import Collective, collective_time_s
from costmodel.deepseek import dense_layer_model
from costmodel.flops import stops_before_final_linear
from costmodel.frameworks import composite_rms_norm, eager_layer_ops, tp_comm_exposed_shares, tp_in_one_node
from costmodel.hardware import ClusterSpec, DeviceProfile
from costmodel.kernels import KernelKey, KernelTimes, embedding_kernel_times, head_kernel_times, layer_kernel_times
from costmodel.kernels.gemm import gemm_s
from costmodel.kernels.recompute_modules import selective_recompute_s
from costmodel.placement import AxisSpan
from costmodel.plan import Plan, Recompute
from costmodel.rank_time.contention import partly_hidden_cost
from costmodel.rank_time.layer_comm import (
    _activation_offload_s,
    _cp_layer_comm_s,
    _edge_tp_comm_s,
    _ep_layer_comm_s,
    _gathered_logits_gather_s,
    _gathered_logits_loss_s,
    _sp_regather_s,
    _tp_block_collective_s,
    _tp_hidden_bytes,
    _tp_layer_comm_s,
    pp_rank_sends_s,
)
from costmodel.selective_modules import OP_POLICY, priced_modules
from costmodel.specs import ModelSpec, TrainSpec

MAX_SHAPES = 1 << 14   # per model, recipe and cluster; a full cache starts over


@dataclass(frozen=True, slots=True)
class TimeShape:
    """The plan fields a rank's time model reads, standing in for the Plan its helpers take: a
    helper reading any other field fails here rather than reading a value the cache did not key
    on. `pp` is 1 or 2: only whether there is a pipeline counts (the stage factor, the sends)."""

    tp: int
    cp: int
    ep: int
    sequence_parallel: bool
    micro_batch_size: int
    fp8_linears: bool
    recompute: Recompute
    offload_activations: bool
    pp: int
    etp: int = 1

    @classmethod
    def of(cls, plan: Plan) -> "TimeShape":
        return cls(plan.tp, plan.cp, plan.ep, plan.sequence_parallel, plan.micro_batch_size, plan.fp8_linears,
                   plan.recompute, plan.offload_activations, min(plan.pp, 2), plan.etp)


# What each axis's collectives read of a plan (the bytes a rank moves: its micro-batch's tokens
# and their sharding), standing in for the Plan as TimeShape does.
@dataclass(frozen=True, slots=True)
class _TpShape:
    tp: int
    cp: int
    sequence_parallel: bool
    micro_batch_size: int
    fp8_linears: bool = False   # float8 linears gather float8 inputs (layer_comm._float8_gathers)


@dataclass(frozen=True, slots=True)
class _CpShape:
    tp: int
    cp: int
    micro_batch_size: int


@dataclass(frozen=True, slots=True)
class _EpShape:
    tp: int
    cp: int
    ep: int
    micro_batch_size: int
    etp: int = 1


@dataclass(frozen=True, slots=True)
class _PpShape:
    tp: int
    cp: int
    pp: int
    micro_batch_size: int
    sequence_parallel: bool   # a stage sends its sequence shard under SP, the whole activation without


@dataclass(frozen=True, kw_only=True, slots=True)
class ComputeParts:
    """What a rank's time model reads that depends on no placement, and each axis's collectives
    by span, shared with every shape whose collectives move the same bytes."""

    shape: TimeShape
    layer: KernelTimes
    selective_s: float   # what the framework's selective recomputation re-runs of the layer
    selective_tp: bool  # and whether that re-run repeats TP collectives (a dense MLP's, torchtitan's op policy)
    exposed: float   # the share of forward TP collectives the framework leaves exposed
    exposed_backward: float   # and of backward ones
    early: bool      # a full recomputation stops before the layer's last projection
    again: float     # a recomputed forward's cost against a training one
    offload_s: float
    embedding: KernelTimes
    head: KernelTimes
    loss_s: float    # the loss over the other ranks' vocabulary, where the logits are gathered
    stage: float     # a pipeline stage's work at the device's factor for it
    mtp_proj_s: float
    tp: "_ByAxis"
    cp: "_ByAxis"
    ep: "_ByAxis"
    pp: "_ByAxis"
    dense: "ComputeParts | None"   # its dense first layers' (RankTimeParts.dense), where it has some
    # what the rank time model reads of no recomputation, by the TP, CP, EP and ETP groups' spans:
    # shared with the shapes that differ from this one only in their recompute mode
    unrecomputed: dict = field(compare=False)


@dataclass(frozen=True, slots=True)
class _ByAxis:
    """One axis's collectives of shapes that move the same bytes (`key`), by the span of the group."""

    key: object
    by_span: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True, kw_only=True, slots=True)
class _KernelParts:
    """ComputeParts' fields that read no more of the plan than its kernels do (KernelKey)."""

    layer: KernelTimes
    selective_s: float
    selective_tp: bool
    early: bool
    exposed: float
    exposed_backward: float
    embedding: KernelTimes
    head: KernelTimes
    loss_s: float
    mtp_proj_s: float
    tp: _ByAxis
    cp: _ByAxis


class RankTimeParts:
    """The parts of one model's rank time models under one recipe on one cluster."""

    def __init__(self, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec) -> None:
        self.model, self.train, self.cluster = model, train, cluster
        self._compute: dict[TimeShape, ComputeParts] = {}
        self._kernels: dict[KernelKey, _KernelParts] = {}
        self._unrecomputed: dict[TimeShape, dict] = {}
        self._axes: dict[object, _ByAxis] = {}
        self._dense: RankTimeParts | None = None

    def dense(self) -> "RankTimeParts":
        """The parts of the model whose layers are this one's dense first layers."""
        if self._dense is None:
            self._dense = RankTimeParts(dense_layer_model(self.model), self.train, self.cluster)
        return self._dense

    def compute(self, shape: TimeShape) -> ComputeParts:
        got = self._compute.get(shape)
        if got is None:
            if len(self._compute) >= MAX_SHAPES:
                self._compute.clear()
                self._kernels.clear()
                self._axes.clear()
                self._unrecomputed.clear()
            # a model without experts has no expert GEMMs or routing: its kernels read no ep
            # (tests/costmodel/test_rank_time_parts.py), so its shapes share them across ep
            moe = self.model.is_moe
            key = KernelKey(shape.tp, shape.cp, shape.ep if moe else 1, shape.etp if moe else 1,
                               shape.sequence_parallel, shape.micro_batch_size, shape.fp8_linears)
            kernels = self._kernels.get(key)
            if kernels is None:
                kernels = self._kernels[key] = _kernel_parts(self.model, self.train, key, self.cluster, self._axis)
            dense = self.dense().compute(shape) if self.model.first_k_dense else None
            unrecomputed = self._unrecomputed.setdefault(replace(shape, recompute=Recompute.NONE), {})
            got = self._compute[shape] = _compute_parts(self.model, self.train, shape, self.cluster, kernels,
                                                        self._axis, dense, unrecomputed)
        return got

    def _axis(self, key: object) -> _ByAxis:
        got = self._axes.get(key)
        if got is None:
            got = self._axes[key] = _ByAxis(key)
        return got

    def tp_terms(self, c: ComputeParts, span: AxisSpan) -> tuple[float, ...]:
        """Over the TP group `span`: a layer's collectives one way, its SP regathers, its output
        collective, the embedding's and the head's collectives (each), the logits' gather, the
        MTP projection's collectives."""
        got = c.tp.by_span.get(span)
        if got is None:
            m, t, cl, s = self.model, self.train, self.cluster, c.tp.key
            got = c.tp.by_span[span] = (
                _tp_layer_comm_s(m, t, s, cl, span), _sp_regather_s(m, t, s, cl, span),
                _tp_block_collective_s(m, t, s, cl, span, output=True) if s.tp > 1 else 0.0,
                _edge_tp_comm_s(t, s, cl, m, span), _gathered_logits_gather_s(m, t, s, cl, span),
                mtp_tp_s(m, t, s, cl, span))
        return got

    def cp_terms(self, c: ComputeParts, span: AxisSpan) -> tuple[float, float]:
        """The exposed (forward, backward) K/V exchange of a layer over the CP group `span`."""
        got = c.cp.by_span.get(span)
        if got is None:
            shape, layer = c.cp.key
            got = c.cp.by_span[span] = _cp_layer_comm_s(self.model, self.train, shape, self.cluster, span, layer)
        return got

    def ep_s(self, c: ComputeParts, span: AxisSpan, etp_span: AxisSpan) -> float:
        """A layer's expert all-to-alls one way over the EP group `span`, and the expert-TP
        gathers over `etp_span`."""
        got = c.ep.by_span.get((span, etp_span))
        if got is None:
            got = c.ep.by_span[span, etp_span] = _ep_layer_comm_s(self.model, self.train, c.ep.key, self.cluster,
                                                                  span, etp_span)
        return got

    def pp_rank_sends_s(self, c: ComputeParts, span: AxisSpan) -> tuple[tuple[float, float], ...]:
        """Per pipeline rank, its sends to the next and the previous rank, the pipeline's group
        being `span` (pp_rank_sends_s)."""
        got = c.pp.by_span.get(span)
        if got is None:
            got = c.pp.by_span[span] = pp_rank_sends_s(self.model, self.train, c.pp.key, self.cluster, span)
        return got


@lru_cache(maxsize=4)
def rank_time_parts(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec) -> RankTimeParts:
    """The parts of the few models, recipes and clusters priced last (a search, a sweep's step)."""
    return RankTimeParts(model, train, cluster)


def _compute_parts(model: ModelSpec, train: TrainSpec, shape: TimeShape, cluster: ClusterSpec,
                   kernels: _KernelParts, axis: Callable[[object], _ByAxis], dense: ComputeParts | None,
                   unrecomputed: dict) -> ComputeParts:
    dev = cluster.device
    k = kernels
    return ComputeParts(
        shape=shape, layer=k.layer, selective_s=k.selective_s, selective_tp=k.selective_tp,
        exposed=k.exposed, exposed_backward=k.exposed_backward, early=k.early,
        # Efficiency.recompute_cost: 1, or calibrate's fit
        again=dev.for_dtype(train.compute_dtype).efficiency.recompute_cost,
        offload_s=_activation_offload_s(model, train, shape, cluster) if shape.offload_activations else 0.0,
        embedding=k.embedding, head=k.head, loss_s=k.loss_s,
        # Efficiency.pp_stage
        stage=dev.efficiency.pp_stage if shape.pp > 1 else 1.0, mtp_proj_s=k.mtp_proj_s, tp=k.tp, cp=k.cp,
        ep=axis(_EpShape(shape.tp, shape.cp, shape.ep, shape.micro_batch_size, shape.etp)),
        pp=axis(_PpShape(shape.tp, shape.cp, shape.pp, shape.micro_batch_size, shape.sequence_parallel)), dense=dense,
        unrecomputed=unrecomputed)


def _kernel_parts(model: ModelSpec, train: TrainSpec, shape: KernelKey, cluster: ClusterSpec,
                  axis: Callable[[object], _ByAxis]) -> _KernelParts:
    dev, fw = cluster.device, cluster.framework
    # a full recomputation that stops before the layer's last projection (and its TP collective)
    early = fw.recompute_early_stop and stops_before_final_linear(model, shape)
    layer = layer_kernel_times(model, train, shape, dev, not fw.cp_all_gather_kv, fw.float8_casts_fused,
                               fw.cpu_kernels, eager_layer_ops(fw, model), early, fw.compiled_layer,
                               not fw.vendor_attention,   # torch's SDPA: one head size
                               fw.grouped_expert_gemm, fw.shared_expert_tp,
                               composite_rms_norm(fw), fw.llama_ops_eager, fw.qkv_bias_grad_in_gemm,
                               fw.norm_fp32_recomputed)
    mtp_proj_s = 0.0
    if model.mtp_depth:   # the MTP modules' 2h -> h projection, column-parallel over TP
        h = model.hidden_size
        mtp_proj_s = gemm_s(shape.micro_batch_size * train.seq_len // shape.cp, 2 * h, -(-h // shape.tp), dev, train)
    tp, cp, mbs = shape.tp, shape.cp, shape.micro_batch_size
    # the shares of TP collectives the framework leaves beside its GEMMs (costmodel.frameworks)
    exposed, exposed_backward = tp_comm_exposed_shares(fw, dev.tp_comm_gemm_overlap, tp, shape.sequence_parallel,
                                                       tp_within_node=tp_in_one_node(tp, cluster.devices_per_node))
    exposed, exposed_backward = _contended(exposed, dev), _contended(exposed_backward, dev)
    modules = priced_modules(fw.selective_modules, fw.selective_op_policy)
    return _KernelParts(
        layer=layer, early=early,
        selective_s=selective_recompute_s(model, train, shape, dev, modules, layer, fw.float8_casts_fused),
        # a dense MLP's re-run, or the per-op policy's, repeats TP collectives (times._recomputed_layer)
        selective_tp=("mlp" in modules or OP_POLICY in modules) and not model.is_moe,
        exposed=exposed, exposed_backward=exposed_backward,
        embedding=embedding_kernel_times(model, train, shape, dev),
        head=head_kernel_times(model, train, shape, dev, fw.cpu_kernels, fw.fused_cross_entropy,
                               composite_rms_norm(fw)),
        loss_s=_gathered_logits_loss_s(model, train, shape, cluster), mtp_proj_s=mtp_proj_s,
        tp=axis(_TpShape(tp, cp, shape.sequence_parallel, mbs, shape.fp8_linears)),
        # ring attention hides its hops behind the layer's attention
        cp=axis((_CpShape(tp, cp, mbs), layer)))


def mtp_tp_s(model: ModelSpec, train: TrainSpec, plan: _TpShape, cluster: ClusterSpec, span: AxisSpan) -> float:
    """An MTP projection's TP collectives: its 2h-wide input all-gathered under SP (its gradient
    reduce-scattered; without SP that gradient all-reduced) and its output all-gathered over the
    features (under SP again in backward, where the sequence shard's gradient is gathered)."""
    if not model.mtp_depth or plan.tp == 1:
        return 0.0
    h = model.hidden_size
    gathers = 2 if plan.sequence_parallel else 1
    return (_tp_block_collective_s(model, train, plan, cluster, span, output=False, width=2 * h)
            + _tp_block_collective_s(model, train, plan, cluster, span, output=True, width=2 * h)
            + gathers * collective_time_s(Collective.ALL_GATHER, _tp_hidden_bytes(model, train, plan), span, cluster))


def _contended(exposed: float, dev: DeviceProfile) -> float:
    """The time a TP collective costs per second of it, `exposed` of it beside the GEMMs: that
    share whole, and the hidden rest at the device's `comm_contention`, as a hidden DP
    collective costs (costmodel.rank_time.dp_terms): the GEMMs it overlaps give it SMs and
    memory bandwidth whichever group it runs on (Transformer Engine's userbuffers overlap,
    torch's async TP)."""
    return partly_hidden_cost(exposed, dev.efficiency.comm_contention)
