"""Per pipeline rank: the time of one micro-batch, compute and the communication on its critical
path, as a model affine in the layers and recomputed layers a rank holds."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from costmodel.hardware import ClusterSpec
from costmodel.params import dense_layers_held, dense_layers_on_rank
from costmodel.plan import Plan, Recompute
from costmodel.rank_time.ep_overlap import ep_overlap_factor
from costmodel.rank_time.layer_comm import send_cost_share
from costmodel.rank_time.parts import ComputeParts, RankTimeParts, TimeShape, rank_time_parts
from costmodel.rank_time.spans import Spans
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
    ep_comm_s: float = 0.0   # expert parallelism's token all-to-alls
    offload_s: float = 0.0   # offloaded activations' copies to the host and back (Plan.offload_activations)

    @property
    def total_s(self) -> float:
        return (self.forward_s + self.backward_s + self.recompute_s + self.tp_comm_s
                + self.cp_comm_s + self.pp_comm_s + self.ep_comm_s + self.offload_s)

    # field by field rather than over __slots__: the search adds these a few hundred thousand times
    def __add__(self, other: "RankTimes") -> "RankTimes":
        return _rank_times(self.forward_s + other.forward_s, self.backward_s + other.backward_s,
                           self.backward_weight_s + other.backward_weight_s, self.recompute_s + other.recompute_s,
                           self.tp_comm_s + other.tp_comm_s, self.cp_comm_s + other.cp_comm_s,
                           self.pp_comm_s + other.pp_comm_s, self.ep_comm_s + other.ep_comm_s,
                           self.offload_s + other.offload_s)

    def scaled(self, k: float) -> "RankTimes":
        if k == 1.0:   # x * 1.0 is x: no new record (most ranks' stage factor, most models' MTP depth)
            return self
        return _rank_times(self.forward_s * k, self.backward_s * k, self.backward_weight_s * k, self.recompute_s * k,
                           self.tp_comm_s * k, self.cp_comm_s * k, self.pp_comm_s * k, self.ep_comm_s * k,
                           self.offload_s * k)


_new = object.__new__
_set_forward, _set_backward, _set_backward_weight, _set_recompute = (
    RankTimes.forward_s.__set__, RankTimes.backward_s.__set__, RankTimes.backward_weight_s.__set__,
    RankTimes.recompute_s.__set__)
_set_tp, _set_cp, _set_pp, _set_ep, _set_offload = (
    RankTimes.tp_comm_s.__set__, RankTimes.cp_comm_s.__set__, RankTimes.pp_comm_s.__set__, RankTimes.ep_comm_s.__set__,
    RankTimes.offload_s.__set__)


def _rank_times(forward_s: float, backward_s: float, backward_weight_s: float, recompute_s: float, tp_comm_s: float,
                cp_comm_s: float, pp_comm_s: float, ep_comm_s: float, offload_s: float) -> RankTimes:
    """RankTimes(...) with every field given, a quarter of its cost: the frozen dataclass's
    __init__ sets each field through object.__setattr__, and the search (rank time models,
    pipeline rows) makes a few hundred thousand of these; its slots are set directly instead."""
    times = _new(RankTimes)
    _set_forward(times, forward_s)
    _set_backward(times, backward_s)
    _set_backward_weight(times, backward_weight_s)
    _set_recompute(times, recompute_s)
    _set_tp(times, tp_comm_s)
    _set_cp(times, cp_comm_s)
    _set_pp(times, pp_comm_s)
    _set_ep(times, ep_comm_s)
    _set_offload(times, offload_s)
    return times


ZERO_TIMES = RankTimes(forward_s=0.0, backward_s=0.0, backward_weight_s=0.0, recompute_s=0.0,
                       tp_comm_s=0.0, cp_comm_s=0.0, pp_comm_s=0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class RankTimeModel:
    """A rank's micro-batch time is affine in its layer count and recomputed-layer count, plus
    the embedding / LM-head work of the first / last rank and what each of DeepSeek's dense first
    layers it holds adds (`dense_layer`). The search reads this shape. The
    ranks differ in their sends (`sends_s`): the end stages send one way only, and where a node
    holds several ranks of the pipeline some neighbours are on NVLink and others are not. Unless
    `for_rank` names one rank, its sends are the ranks' mean, what they send together."""

    per_layer: RankTimes
    per_recomputed_layer: RankTimes
    first_edge: RankTimes
    last_edge: RankTimes
    # per pipeline rank, (one activation to the next rank, one gradient to the previous), round the
    # ring (layer_comm.pp_rank_sends_s); empty without a pipeline
    sends_s: tuple[tuple[float, float], ...]
    vpp: int
    rank: int | None = None   # the pipeline rank priced (for_rank); None: the ranks' mean
    # what a second of a gradient send hidden behind compute costs where its framework hides the steady
    # state's (frameworks `steady_sends_overlap`: the device's comm_contention); 1: every send is waited
    # for (layer_comm.send_cost_share). The share hidden grows with the step's micro-batches.
    hidden_send_cost: float = 1.0
    num_micro_batches: int = 1
    # a dense first layer's time less an expert layer's (ModelSpec.first_k_dense), at the stage
    # factor; `first_k_dense` of them, on the first rank unless a split says otherwise (`at`)
    dense_layer: RankTimes = ZERO_TIMES
    first_k_dense: int = 0

    @property
    def pp_comm_s(self) -> float:
        return self.pp_comm_with_s(self.vpp)

    @property
    def send_share(self) -> float:
        """The share of its gradient sends' time a rank's step pays (layer_comm.send_cost_share)."""
        return send_cost_share(len(self.sends_s), self.vpp, self.num_micro_batches, self.hidden_send_cost)

    def pp_comm_with_s(self, vpp: int, num_micro_batches: int | None = None) -> float:
        """Its sends per micro-batch as its step pays them (send_share: the gradient sends' share),
        were it to hold `vpp` virtual stages (_rank_sends_s) and run `num_micro_batches` (default:
        its own)."""
        if not self.sends_s:
            return 0.0
        m = self.num_micro_batches if num_micro_batches is None else num_micro_batches
        share = send_cost_share(len(self.sends_s), vpp, m, self.hidden_send_cost)
        sends = self.sends_s if share == 1.0 else tuple((forward, share * back) for forward, back in self.sends_s)
        if self.rank is not None:
            return _rank_sends_s(sends, self.rank, vpp)
        # the ranks' _rank_sends_s summed: every pair vpp times, less the two sends to nowhere
        return (vpp * _pairs_sum_s(sends) - sends[-1][0] - sends[0][1]) / len(sends)

    def with_schedule(self, vpp: int, num_micro_batches: int) -> "RankTimeModel":
        """The same rank with `vpp` virtual stages and `num_micro_batches` a step (only the sends
        its step pays change): how a plan's model is read from the models the search shares."""
        return replace(self, vpp=vpp, num_micro_batches=num_micro_batches)

    def with_pp_sends(self, sends_s: tuple[tuple[float, float], ...]) -> "RankTimeModel":
        """The same ranks under another placement of the pipeline axis (only their sends change)."""
        return self if sends_s == self.sends_s else replace(self, sends_s=sends_s)

    def for_rank(self, rank: int) -> "RankTimeModel":
        """Pipeline rank `rank`'s model: its own sends in place of the ranks' mean."""
        return replace(self, rank=rank) if self.sends_s and self.rank != rank else self

    def with_ep_scaled(self, k: float) -> "RankTimeModel":
        """The same rank with every part's expert all-to-all time times k (an overlap's share)."""
        if k == 1.0:
            return self

        def scaled(times: RankTimes) -> RankTimes:
            return replace(times, ep_comm_s=times.ep_comm_s * k)
        return replace(self, per_layer=scaled(self.per_layer), per_recomputed_layer=scaled(self.per_recomputed_layer),
                       first_edge=scaled(self.first_edge), last_edge=scaled(self.last_edge),
                       dense_layer=scaled(self.dense_layer))

    def at(self, layers: int, recomputed: int, first: bool, last: bool, dense: int | None = None) -> RankTimes:
        """The time of a rank (or a virtual stage) of `layers` layers, `recomputed` of them
        recomputed, `dense` of them dense first layers (costmodel.params.dense_layers_on_rank;
        by default all of them on the first rank, as the search places them)."""
        times = self.per_layer.scaled(layers) + self.per_recomputed_layer.scaled(recomputed)
        dense = dense_layers_held(self.first_k_dense, first, dense)
        if dense:
            times = times + self.dense_layer.scaled(dense)
        if first:
            times = times + self.first_edge
        if last:
            times = times + self.last_edge
        return _rank_times(times.forward_s, times.backward_s, times.backward_weight_s, times.recompute_s,
                           times.tp_comm_s, times.cp_comm_s, times.pp_comm_s + self.pp_comm_s, times.ep_comm_s,
                           times.offload_s)


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
    sends = tuple(tuple(min(pair) for pair in zip(*pairs)) for pairs in zip(*(m.sends_s for m in models)))
    return RankTimeModel(per_layer=least("per_layer"), per_recomputed_layer=least("per_recomputed_layer"),
                         first_edge=least("first_edge"), last_edge=least("last_edge"), sends_s=sends,
                         vpp=models[0].vpp, hidden_send_cost=min(m.hidden_send_cost for m in models),
                         num_micro_batches=models[0].num_micro_batches, dense_layer=least("dense_layer"),
                         first_k_dense=models[0].first_k_dense)


def _hidden_send_cost(cluster: ClusterSpec) -> float:
    """What a second of a gradient send hidden behind compute costs where the framework hides the
    steady state's (frameworks `steady_sends_overlap`): the device's comm_contention; 1 elsewhere."""
    return cluster.device.efficiency.comm_contention if cluster.framework.steady_sends_overlap else 1.0


@lru_cache(maxsize=4096)
def _pairs_sum_s(sends_s: tuple[tuple[float, float], ...]) -> float:
    return sum(forward + backward for forward, backward in sends_s)


def _rank_sends_s(sends_s: tuple[tuple[float, float], ...], rank: int, vpp: int) -> float:
    """A pipeline rank's sends per micro-batch over `vpp` chunks: each chunk's output to the
    next rank and its input's gradient to the previous one, but for the last stage's output and
    the first stage's gradient, which go nowhere (the last rank's last chunk, the first rank's
    first)."""
    forward, backward = sends_s[rank]
    last = len(sends_s) - 1
    return vpp * (forward + backward) - (forward if rank == last else 0.0) - (backward if rank == 0 else 0.0)


def _times(fwd: float = 0.0, bwd: float = 0.0, bwd_w: float = 0.0, rc: float = 0.0,
           tp: float = 0.0, cp: float = 0.0, ep: float = 0.0) -> RankTimes:
    return _rank_times(fwd, bwd, bwd_w, rc, tp, cp, 0.0, ep, 0.0)


def rank_time_model(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                    sp: Spans) -> RankTimeModel:
    """Depends on the plan's degrees, micro-batch, SP, recompute mode and placement only (TimeShape;
    of the spans those of TP, CP, EP and PP), not on its layer split or recompute counts, and where
    the framework overlaps the expert all-to-alls, on its micro-batch and stage counts
    (costmodel.rank_time.ep_overlap). The sends a step pays read its micro-batches too, which the
    model takes from RankTimeModel.with_schedule (rank_times, stage_costs), not from here."""
    rtm = shape_time_model(model, train, TimeShape.of(plan), cluster, sp, plan.vpp)
    return rtm.with_ep_scaled(ep_overlap_factor(rtm.per_layer, plan, cluster))


def shape_time_model(model: ModelSpec, train: TrainSpec, shape: TimeShape, cluster: ClusterSpec, sp: Spans,
                     vpp: int = 1) -> RankTimeModel:
    """rank_time_model of every plan of this TimeShape, placed as `sp` says, with `vpp` virtual
    stages."""
    parts = rank_time_parts(model, train, cluster)
    return parts_time_model(parts, parts.compute(shape), sp, vpp)


def parts_time_model(parts: RankTimeParts, c: ComputeParts, sp: Spans, vpp: int = 1) -> RankTimeModel:
    """The rank time model from its parts (`c`: parts.compute of its TimeShape). All but its
    recomputed layer read no recompute mode: shapes that differ only in it share that part."""
    key = (sp.tp, sp.cp, sp.ep, sp.etp)
    unrecomputed = c.unrecomputed.get(key)
    if unrecomputed is None:
        unrecomputed = c.unrecomputed[key] = _unrecomputed(parts, c, sp)
    per_layer, first_edge, last_edge, comm, dense_layer = unrecomputed
    if c.dense is not None and c.shape.recompute is Recompute.SELECTIVE and c.dense.selective_s != c.selective_s:
        dense_layer = dense_layer + _dense_selective(c)
    return RankTimeModel(per_layer=per_layer, per_recomputed_layer=_recomputed_layer(c, *comm).scaled(c.stage),
                         first_edge=first_edge, last_edge=last_edge, sends_s=parts.pp_rank_sends_s(c, sp.pp), vpp=vpp,
                         hidden_send_cost=_hidden_send_cost(parts.cluster), dense_layer=dense_layer,
                         first_k_dense=parts.model.first_k_dense)


def _dense_selective(c: ComputeParts) -> RankTimes:
    """What a dense first layer's selective recomputation re-runs beyond an expert layer's (a
    dense MLP under Megatron-Core's `mlp`; recompute_modules), at the stage factor: Megatron-Core
    recomputes selectively every layer. Their full recomputation is priced as an expert layer's."""
    assert c.dense is not None
    return _times(rc=c.again * (c.dense.selective_s - c.selective_s)).scaled(c.stage)


def _unrecomputed(parts: RankTimeParts, c: ComputeParts, sp: Spans) -> tuple:
    """(a layer's time, the first and the last rank's edges, at the stage factor; the layer's
    collectives a recomputed layer reads: _layer_times; what a dense first layer adds, at the
    stage factor)."""
    model = parts.model
    per_layer, comm, tp_edges = _layer_times(parts, c, sp)
    embed_pass = _times(c.embedding.forward_s, c.embedding.backward_s, c.embedding.backward_weight_s, tp=tp_edges[0])
    head_pass = _times(c.head.forward_s + c.loss_s, c.head.backward_s + c.loss_s, c.head.backward_weight_s,
                       tp=tp_edges[0] + tp_edges[1])
    dense_layer = _dense_first_layer(parts.dense(), c.dense, sp, per_layer) if model.first_k_dense else ZERO_TIMES
    last_edge = head_pass + _mtp_times(model, c, tp_edges[2], per_layer, embed_pass + head_pass)
    stage = c.stage
    return per_layer.scaled(stage), embed_pass.scaled(stage), last_edge.scaled(stage), comm, dense_layer.scaled(stage)


def _layer_times(parts: RankTimeParts, c: ComputeParts,
                 sp: Spans) -> tuple[RankTimes, tuple[float, ...], tuple[float, ...]]:
    """A layer's times (before the stage factor); its collectives one way a recomputed layer
    reads (TP, TP output, CP forward, EP: _recomputed_layer); and the edges' TP collectives (the
    embedding's and the head's each, the logits' gather, the MTP projection's)."""
    layer = c.layer
    tp_layer_s, regather_s, tp_output_s, edge_tp_s, gather_s, mtp_tp_s = parts.tp_terms(c, sp.tp)
    tp = tp_layer_s * c.exposed   # one direction's, as the forward (and a recomputation) runs them
    cp_fwd, cp_bwd = parts.cp_terms(c, sp.cp)
    ep = parts.ep_s(c, sp.ep, sp.etp)
    per_layer = _times(layer.forward_s, layer.backward_s, layer.backward_weight_s,
                       tp=tp + tp_layer_s * c.exposed_backward + regather_s,
                       cp=cp_fwd + cp_bwd, ep=2 * ep)
    if c.shape.offload_activations:
        per_layer = replace(per_layer, offload_s=c.offload_s)
    return per_layer, (tp, tp_output_s, cp_fwd, ep), (edge_tp_s, gather_s, mtp_tp_s)


def _recomputed_layer(c: ComputeParts, tp: float, tp_output_s: float, cp_fwd: float, ep: float) -> RankTimes:
    """A recomputed layer's extra time (before the stage factor), under the shape's recompute mode."""
    layer = c.layer
    if c.shape.recompute is Recompute.FULL:
        # stopping early, it never runs the collective after the MLP's row-parallel projection
        skipped_tp = tp_output_s * c.exposed if c.early and c.shape.tp > 1 else 0.0
        return _times(rc=c.again * layer.recompute_forward_s, tp=tp - skipped_tp, cp=cp_fwd, ep=ep)
    if c.shape.recompute is Recompute.SELECTIVE:   # the framework's modules (frameworks `selective_modules`)
        # a re-run dense MLP (or torchtitan's per-op policy, which re-runs the blocks' inputs' gathers
        # and wo's output) repeats TP collectives: the output's, and under SP an input's all-gather of as
        # many bytes
        mlp_tp = (2 if c.shape.sequence_parallel else 1) * tp_output_s * c.exposed if c.selective_tp else 0.0
        return _times(rc=c.again * c.selective_s, tp=mlp_tp)
    return ZERO_TIMES


def _dense_first_layer(dense: RankTimeParts, c: ComputeParts, sp: Spans, expert_layer: RankTimes) -> RankTimes:
    """A dense first layer (ModelSpec.first_k_dense) against an expert layer: a dense layer's
    time less an expert layer's (kernels and communication), before the stage factor. Its
    recomputation is priced as an expert layer's. `dense`, `c`: the parts of
    costmodel.deepseek.dense_layer_model(model) and its compute."""
    # a dense layer's time as its own rank time model gives it (at the stage factor), the factor
    # taken back off: _unrecomputed applies it once
    layer = _layer_times(dense, c, sp)[0].scaled(c.stage).scaled(1 / c.stage)
    return layer + expert_layer.scaled(-1.0)


def _mtp_times(model: ModelSpec, c: ComputeParts, proj_tp: float, layer: RankTimes, edges: RankTimes) -> RankTimes:
    """The MTP modules on the last rank (as Megatron-Core places them; DeepSeek-V3 Sec. 2.2): per
    module one more expert layer, a pass through the shared embedding and the shared output head
    and loss (`edges`, their TP collectives included), and its 2h -> h projection, column-parallel
    over TP with its output gathered (runtime.mtp, Megatron-Core's eh_proj; its collectives:
    costmodel.rank_time.parts.mtp_tp_s). Its three RMSNorms and the concatenation are left out
    (memory-bound, 4 h-wide passes against the layer's dozens)."""
    if not model.mtp_depth:
        return ZERO_TIMES
    proj = c.mtp_proj_s
    return (layer + edges + _times(proj, 2 * proj, proj, tp=proj_tp)).scaled(model.mtp_depth)


def rank_times(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
               sp: Spans, rank: int) -> RankTimes:
    first, last = plan.stage_rank(0), plan.stage_rank(plan.num_virtual_stages - 1)
    rtm = rank_time_model(model, train, plan, cluster, sp).with_schedule(plan.vpp, plan.num_micro_batches)
    return rtm.for_rank(rank).at(plan.layers_on_rank(rank), plan.recompute_num_layers[rank], rank == first,
                                 rank == last, dense_layers_on_rank(model, plan, rank))
