"""Data-parallel synchronisation: the collectives ZeRO / FSDP run per step and the part compute
hides (what runs once after the pipeline: costmodel.rank_time.after_pipeline)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from costmodel.comm import HOST_COPIES, Collective, collective_time_s
from costmodel.frameworks import FrameworkTraits, float8_params
from costmodel.fsdp_units import fsdp_unit_layers, whole_stage_units
from costmodel.hardware import ClusterSpec
from costmodel.kernels.optimizer import gather_copy_out_s
from costmodel.memory import reduces_every_micro_batch, unsharded_between_micro_batches
from costmodel.params import (
    RankParams,
    layer_expert_params,
    layer_param_tensors,
    layer_params,
    rank_params,
    rank_params_at,
)
from costmodel.placement import AxisSpan
from costmodel.plan import Plan
from costmodel.rank_time.spans import Spans
from costmodel.rank_time.times import RankTimes
from costmodel.specs import DType, ModelSpec, TrainSpec
from costmodel.zero3_coordinator import coordinates, coordinator_wait_s


@dataclass(frozen=True, kw_only=True, slots=True)
class DpTerm:
    """One data-parallel synchronisation, `multiplier` times per step: collectives whose size is
    `bytes_per_param` x the rank's parameters, hidden behind the rank's forward or backward.
    `pieces_per_layer` 0: large buckets, `units` collectives' latency for the rank (one per stage
    it runs where each stage is one FSDP unit: dp_unit_layers; one per model chunk where the
    framework syncs each on its own: chunk_collectives); n >= 1: one unit (dp_groups) at a time,
    each in n collectives, every one paying the ring's latency."""

    multiplier: int
    collectives: tuple[tuple[Collective, float], ...]
    window: str  # "forward", "backward", "none" (after the backward pass, exposed), or "walked" (zero3_coordinator)
    pieces_per_layer: int = 0
    units: int = 1
    scale: float = 1.0   # a fraction of the collectives' time (the contention terms below)
    window_micro_batches: float = 1.0   # micro-batches of the pass the window spans (chunk_window_micro_batches)


def dp_terms(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec) -> tuple[DpTerm, ...]:
    """The synchronisations of `_dp_terms` under the cluster's framework, and for each one that
    hides behind compute a term for what hiding costs: NCCL's kernels take SMs and memory
    bandwidth from the GEMMs they run beside, so the compute slows by the device's
    `comm_contention` (fitted; 0 where unknown) x the collective's time. Counted as exposed. A
    hidden TP collective costs the same (costmodel.rank_time.parts: _contended). Under FSDP2 each
    gather is followed by its copy-out on the compute stream (_copy_outs)."""
    terms = _dp_terms(model, train, plan, cluster.framework)
    if cluster.framework.fsdp_copy_out:
        terms += _copy_outs(terms)
    if plan.offload_optimizer:
        terms = _with_host_copies(terms, plan, cluster.framework)
    contention = cluster.device.efficiency.comm_contention
    if not contention:
        return terms
    # the host copies run on copy engines, not SMs: no contention for them
    return terms + tuple(replace(t, window="none", scale=contention,
                                 collectives=tuple(c for c in t.collectives if c[0] not in HOST_COPIES))
                         for t in terms if t.window != "none")


def _copy_outs(terms: tuple[DpTerm, ...]) -> tuple[DpTerm, ...]:
    """FSDP2's copy-out after each of the terms' all-gathers (frameworks `fsdp_copy_out`): on the
    compute stream, so exposed (window "none"), at the device's bandwidth (dp_term_comm_s)."""
    return tuple(DpTerm(multiplier=t.multiplier, collectives=((Collective.GATHER_COPY_OUT, bpp),), window="none")
                 for t in terms for kind, bpp in t.collectives if kind is Collective.ALL_GATHER)


def copies_out(term: DpTerm) -> bool:
    """Whether the term is FSDP2's copy-out (_copy_outs), which holds nothing else."""
    return any(kind is Collective.GATHER_COPY_OUT for kind, _ in term.collectives)


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
    if float8_params(plan, traits):
        w = 1   # weights gathered in float8
    ar, ag, rs = Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER
    z = plan.zero_stage
    reduce_window = "backward" if grads_overlap_backward(plan, traits, train) else "none"
    gather_window = "forward" if traits.dp_param_overlap else "none"
    reduces = 1 if unsharded_between_micro_batches(plan, traits) else m
    # FSDP units below ZeRO-3 too: ours at every stage, per-block FSDP's where it shards
    units = 1 if traits.dp_collectives_per_layer or (traits.fsdp_block_units and z in (1, 2)) else 0
    stages = 1
    spread = chunk_window_micro_batches(plan, traits)
    if units and whole_stage_units(model, plan, traits):
        # one unit a stage: its reduction follows the whole backward, its gather precedes the forward
        units, stages, reduce_window, gather_window = 0, plan.vpp, "none", "none"
    elif not units and traits.dp_sync_per_chunk:
        stages = chunk_collectives(plan)
    if z == 0:
        return (DpTerm(multiplier=1, collectives=((ar, g),), window=reduce_window, pieces_per_layer=units,
                       units=stages, window_micro_batches=spread),)
    if z == 1 and traits.owner_broadcasts:
        # gradients all-reduced whole over every data-parallel rank; the updated shards broadcast
        # by their owners after the step, exposed
        return (DpTerm(multiplier=1, collectives=((ar, g),), window=reduce_window, pieces_per_layer=units,
                       units=stages, window_micro_batches=spread),
                DpTerm(multiplier=1, collectives=((Collective.OWNER_BROADCASTS, w),), window="none"))
    if z in (1, 2):
        # DeepSpeed's BF16_Optimizer all-reduces the fp32 gradients whole where ZeRO-1 reduce-scatters
        reduction = (ar, 4) if z == 1 and bf16_optimizer_all_reduces(train, traits) else (rs, g)
        # resharded after each reducing backward (frameworks `reshards_after_backward`): gathered again
        gathers = reduces if z == 2 and traits.reshards_after_backward else 1
        return (DpTerm(multiplier=1 if z == 1 else reduces, collectives=(reduction,), window=reduce_window,
                       pieces_per_layer=units, units=stages, window_micro_batches=spread if reduces == 1 or z == 1 else 1.0),
                DpTerm(multiplier=gathers, collectives=((ag, w),), window=gather_window, pieces_per_layer=units,
                       units=stages, window_micro_batches=spread if gathers == 1 else 1.0))
    pieces = layer_param_tensors(model) if traits.zero3_gathers_per_param else 1
    if coordinates(model, plan, traits):
        # the gathers' wait walked as DeepSpeed's coordinator runs them (dp_exposed_s); their term
        # ("walked": hidden here) stays for the compute they contend with, a forward's and a backward's
        # (no host copy exposed with them: ZeRO-Offload keeps the 16-bit weights on the device)
        return (DpTerm(multiplier=2 * m, collectives=((ag, w),), window="walked", pieces_per_layer=pieces),
                DpTerm(multiplier=reduces, collectives=((rs, g),), window=reduce_window, pieces_per_layer=pieces))
    # FSDP prefetches the next layer's gather behind the current one's compute in either pass
    forward = DpTerm(multiplier=m, collectives=((ag, w),), window="forward", pieces_per_layer=pieces)
    if reduces == m and reduce_window == "backward":   # backward's gathers and reductions share its window
        return (forward, DpTerm(multiplier=m, collectives=((ag, w), (rs, g)), window="backward",
                                pieces_per_layer=pieces))
    return (forward, DpTerm(multiplier=m, collectives=((ag, w),), window="backward", pieces_per_layer=pieces),
            DpTerm(multiplier=reduces, collectives=((rs, g),), window=reduce_window, pieces_per_layer=pieces))


def chunk_collectives(plan: Plan) -> int:
    """How many collectives of each kind a rank's once-a-step data-parallel sync runs where the
    framework syncs each model chunk on its own (`dp_sync_per_chunk`, Megatron-Core): each chunk
    has its own gradient buffer, and under a pipeline each is one collective: Megatron-Core
    buckets neither a later pipeline rank's buffers (its sync hides in the drain) nor an
    interleaved rank's later chunks (`disable_bucketing`, megatron/core/distributed/
    distributed_data_parallel.py). Each pays the ring's latency, milliseconds over hundreds of
    nodes (costmodel.comm). Not priced: the buckets of max(40M, 1M x dp) parameters Megatron-Core
    cuts the first rank's first chunk into (one or two more collectives on a deep pipeline), and
    a plan without a pipeline into (tens, each at a ring latency the model overstates over the
    NVLink domains of 64-72 GPUs that GB200 and GB300 runs use: priced so, their pure data-parallel
    published runs came out far too slow)."""
    return plan.vpp if plan.pp > 1 else 1


def bf16_optimizer_all_reduces(train: TrainSpec, traits: FrameworkTraits) -> bool:
    """Whether ZeRO-1 runs as DeepSpeed's BF16_Optimizer (`bf16_optimizer_all_reduce`: bf16
    compute with fp32 gradients), all-reducing them whole in fp32 after the backward."""
    return (traits.bf16_optimizer_all_reduce and train.compute_dtype is DType.BF16
            and train.grad_dtype is DType.FP32)


def grads_overlap_backward(plan: Plan, traits: FrameworkTraits, train: TrainSpec) -> bool:
    """Whether the framework reduces gradients during the backward for this plan (costmodel.
    frameworks: dp_grad_overlap, less DeepSpeed's pipeline, its overlap_comm default and its
    BF16_Optimizer's all-reduce after the backward)."""
    if traits.grads_reduced_after_pipeline and plan.pp > 1:
        return False
    if plan.zero_stage == 1 and bf16_optimizer_all_reduces(train, traits):
        return False
    if traits.grad_overlap_zero3_only and plan.zero_stage < 3:
        return False
    return traits.dp_grad_overlap


def dp_term_comm_s(term: DpTerm, n_params: float, cluster: ClusterSpec, span: "DpSpan",
                   unit_params: float) -> float:
    """Seconds of one synchronisation of `n_params` parameters; `unit_params`: one layer's. At
    the device's `dp_comm` over the links' fitted efficiency and latency alike
    (costmodel.hardware.Efficiency.dp_comm): scaling the bandwidth alone left TP's collectives to
    tell the links' latency from their efficiency, which one message size cannot, and priced
    TP plans too slow."""
    if copies_out(term):   # device work (_copy_outs): no link, no latency
        return term.scale * sum(gather_copy_out_s(bpp * n_params, cluster.device) for _, bpp in term.collectives)
    scale = term.scale / cluster.device.efficiency.dp_comm
    if not term.pieces_per_layer:
        return scale * term.units * sum(_collective_s(kind, bpp * n_params / term.units, span, cluster)
                                        for kind, bpp in term.collectives)
    k = term.pieces_per_layer
    per_unit = sum(k * _collective_s(kind, bpp * unit_params / k, span, cluster)
                   for kind, bpp in term.collectives)
    return scale * n_params / unit_params * per_unit


@dataclass(frozen=True, kw_only=True, slots=True)
class DpSpan:
    """Where a gradient group's collectives run: its ZeRO shard group, and under hybrid sharding
    (Plan.dp_replicate) the replicas each reduced shard is then all-reduced over; `whole` is the
    group with its replicas (an all-reduce of whole gradients runs over it)."""
    group: AxisSpan
    replicas: AxisSpan
    whole: AxisSpan


def _collective_s(kind: Collective, num_bytes: float, span: DpSpan, cluster: ClusterSpec) -> float:
    """One collective of a DP term over its shard group; a reduce-scatter under hybrid sharding
    also all-reduces the 1/group shard it leaves over the replicas (FSDP2's HSDP, FSDP1's
    HYBRID_SHARD); an all-reduce runs over the whole group."""
    if kind is Collective.ALL_REDUCE:
        return collective_time_s(kind, num_bytes, span.whole, cluster)
    out = collective_time_s(kind, num_bytes, span.group, cluster)
    if kind is Collective.REDUCE_SCATTER and span.replicas.size > 1:
        out += collective_time_s(Collective.ALL_REDUCE, num_bytes / span.group.size, span.replicas, cluster)
    return out


def dp_window_s(term: DpTerm, times: RankTimes, overlap: float) -> float:
    """Compute the collective can hide behind: the rank's forward or backward, times the
    device's overlap (1 with a separate communication stream, as on GPUs; lower where compute
    and communication share the cores, as gloo ranks on a CPU do)."""
    if term.window == "none":
        return 0.0
    if term.window == "walked":   # its wait is costmodel.zero3_coordinator's, added apart
        return math.inf
    window = times.forward_s if term.window == "forward" else times.backward_s + times.recompute_s
    return overlap * term.window_micro_batches * window


def chunk_window_micro_batches(plan: Plan, traits: FrameworkTraits) -> float:
    """Micro-batches of a pass a once-per-step DP collective hides behind. One stage a rank: the
    last micro-batch's backward (the first micro-batch's forward for the gather), bucket by
    bucket. Interleaved, a framework that syncs each model chunk on its own (`dp_sync_per_chunk`:
    Megatron-Core launches a chunk's reduce-scatter when its last micro-batch's backward ends, its
    gather when its first forward starts) runs the other chunks' collectives behind the last (first)
    round of the schedule: min(m, pp) micro-batches of each of the vpp - 1 other chunks, each 1/vpp
    of a micro-batch's pass, besides the chunk's own micro-batch."""
    if not traits.dp_sync_per_chunk or plan.vpp == 1:
        return 1.0
    rounds = min(plan.num_micro_batches, plan.pp)
    return (1 + rounds * (plan.vpp - 1)) / plan.vpp


def dp_hidden_s(comm_s: float, window_s: float, bucket_s: float) -> float:
    """Bucketed overlap: the collective hides behind the window, except the last bucket (one
    layer's parameters: the first to gather, the last to reduce) stays exposed."""
    return max(comm_s - window_s, bucket_s)


def dp_unit_layers(model: ModelSpec, plan: Plan, traits: FrameworkTraits) -> int:
    """Layers a DP unit of dp_groups holds: the framework's FSDP unit (fsdp_units.fsdp_unit_layers),
    one layer where a stage is one unit whole (DpTerm.units prices those) or the framework
    buckets otherwise (pieces_per_layer 0: the unit is then the last bucket's, dp_bucket_s)."""
    if not traits.dp_collectives_per_layer or whole_stage_units(model, plan, traits):
        return 1
    return fsdp_unit_layers(model, plan)


def dp_groups(model: ModelSpec, plan: Plan, sp: Spans, held: RankParams,
              traits: FrameworkTraits) -> list[tuple[float, float, DpSpan]]:
    """(parameters, one DP unit's of them, span) per gradient group of a device holding `held`:
    everything over dp x cp; under expert parallelism the routed experts over edp x cp apart. A
    unit of several layers (dp_unit_layers) counts its collectives by the rank's parameters over
    its own, the embedding and head among them: exact where every stage's layers fill whole units
    beside a root of about one unit's size, within a unit's latency otherwise."""
    layer = layer_params(model, plan.tp, plan.ep, plan.etp, traits.shared_expert_tp)
    if plan.ep * plan.etp == 1:
        return [(held.total, dp_unit_layers(model, plan, traits) * layer, DpSpan(group=sp.shard, replicas=sp.replicas, whole=sp.dp))]
    experts = layer_expert_params(model, plan.ep, plan.etp)   # no hybrid sharding (check.hsdp_problems)
    return [(held.replicated, layer - experts, DpSpan(group=sp.dp, replicas=sp.replicas, whole=sp.dp)),
            (held.experts, experts, DpSpan(group=sp.edp, replicas=sp.replicas, whole=sp.edp))]


def dp_bucket_s(model: ModelSpec, plan: Plan, term: DpTerm, cluster: ClusterSpec, sp: Spans,
                groups: list | None = None) -> float:
    """One DP unit's collectives of a term (in each gradient group; dp_unit_layers). `groups`:
    dp_groups of a middle rank holding one layer, where the caller has them."""
    if term.window == "walked":   # the coordinator's wait has no bucket of its own to bound it by
        return 0.0
    if term.pieces_per_layer == 0:   # the last bucket to reduce (the first to gather): one collective
        term = replace(term, units=1)
    if groups is None:
        groups = dp_groups(model, plan, sp, rank_params_at(model, plan, 1, False, False, cluster.framework),
                           cluster.framework)
    return sum(dp_term_comm_s(term, unit, cluster, span, unit) for _, unit, span in groups)


def dp_exposed_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                 sp: Spans, rank: int, times: RankTimes) -> float:
    """Gradient reduction and parameter gathers over the dp x cp group (and the experts' edp x cp
    group), minus what hides, with FSDP2's copy-outs (dp_exposed_parts_s)."""
    return sum(dp_exposed_parts_s(model, train, plan, cluster, sp, rank, times))


def dp_exposed_parts_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                       sp: Spans, rank: int, times: RankTimes) -> tuple[float, float]:
    """(the collectives' exposed time, FSDP2's copy-outs after its gathers: _copy_outs)."""
    if sp.dp.size == 1 and not plan.offload_optimizer:
        return 0.0, 0.0
    held = rank_params(model, plan, rank, cluster.framework)
    groups = dp_groups(model, plan, sp, held, cluster.framework)
    overlap = cluster.device.efficiency.overlap
    exposed, copies = 0.0, 0.0
    for t in dp_terms(model, train, plan, cluster):
        s = t.multiplier * dp_hidden_s(sum(dp_term_comm_s(t, n, cluster, span, unit) for n, unit, span in groups),
                                       dp_window_s(t, times, overlap), dp_bucket_s(model, plan, t, cluster, sp))
        if copies_out(t):
            copies += s
        else:
            exposed += s
    if coordinates(model, plan, cluster.framework):
        passes = (times.forward_s, times.backward_s, times.recompute_s)
        exposed += plan.num_micro_batches * coordinator_wait_s(model, train, plan, cluster, sp.shard, rank, passes,
                                                               (held.embedding, held.head))
    return exposed, copies
