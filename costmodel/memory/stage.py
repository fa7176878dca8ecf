"""A pipeline rank's peak memory: its states, the activations its schedule holds in flight,
pipeline buffers and working memory, as one ledger (StageMemory) and as affine shapes in the
layers it holds (for the search's memory constraints)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Sequence

from costmodel.frameworks import RUNTIME, FrameworkTraits, tp_comm_overlaps, tp_in_one_node
from costmodel.fsdp_units import fsdp_unit_params
from costmodel.memory.activations import (
    backward_working_bytes,
    edge_bytes_per_micro_batch,
    layer_activation_bytes,
    local_tokens,
)
from costmodel.memory.deferred import edge_weight_grad_output_bytes, weight_grad_input_bytes
from costmodel.memory.dispatcher import dispatcher_buffer_bytes
from costmodel.memory.states import float8_weight_cache_bytes, reduces_every_micro_batch, state_bytes_for
from costmodel.params import (
    dense_layers_by_stage,
    dense_layers_first_rank,
    dense_layers_on_rank,
    layer_params,
    rank_params,
    rank_params_at,
)
from costmodel.plan import Plan, Recompute
from costmodel.schedules import interleaved_warmup_chunks, stage_owner
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.zero3_coordinator import coordinates, live_params

if TYPE_CHECKING:
    from costmodel.hardware import DeviceProfile


@dataclass(frozen=True, kw_only=True, slots=True)
class StageMemory:
    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    buffers_bytes: float
    reserved_bytes: float

    @property
    def total_bytes(self) -> float:
        return (self.params_bytes + self.grads_bytes + self.optimizer_bytes
                + self.activations_bytes + self.buffers_bytes + self.reserved_bytes)

    def to_dict(self) -> dict[str, float]:
        # field by field: dataclasses.asdict deep-copies, and the search calls this a lot
        return {"params": self.params_bytes, "grads": self.grads_bytes, "optimizer": self.optimizer_bytes,
                "activations": self.activations_bytes, "buffers": self.buffers_bytes,
                "reserved": self.reserved_bytes}


def send_bytes(model: ModelSpec, train: TrainSpec, plan: Plan) -> float:
    """One activation (or its gradient) a pipeline stage sends: this rank's sequence shard under SP."""
    sp = plan.tp if plan.sequence_parallel else 1
    return train.compute_dtype.num_bytes * local_tokens(train, plan) * model.hidden_size / sp


def held_send_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                    traits: FrameworkTraits = RUNTIME) -> float:
    """What a rank's sends keep alive by the step's end where the framework waits them only
    then (frameworks.pipeline_sends_held): one tensor per micro-batch per stage edge that
    crosses to another rank, forward and backward."""
    if plan.pp == 1 or not (traits.pipeline_sends_held and plan.schedule.traits.multi_stage):
        return 0.0
    edges = _crossing_edges(plan.pp, plan.vpp, plan.schedule.traits.v_placement)[rank]
    return edges * plan.num_micro_batches * send_bytes(model, train, plan)


@lru_cache(maxsize=1024)
def _crossing_edges(p: int, v: int, v_placement: bool) -> tuple[int, ...]:
    """Per pipeline rank, its stages' edges (forward and backward) to a stage on another rank
    (cached: the search asks for every candidate)."""
    def owner(j: int) -> int:
        return stage_owner(j, p, v_placement)
    n, out = p * v, [0] * p
    for j in range(n):
        out[owner(j)] += (j < n - 1 and owner(j + 1) != owner(j)) + (j > 0 and owner(j - 1) != owner(j))
    return tuple(out)


def in_flight_micro_batches(plan: Plan, rank: int, traits: FrameworkTraits = RUNTIME) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of the
    rank's whole layer set (Narayanan et al. SC'21 Sec. 2.2; Korthikanti et al. Sec. 4.2.3 for
    the interleaved schedule: p·(1 + (p-1)/(p·v)) on the first rank). Megatron-Core's expert
    all-to-all overlap (`ep_a2a_overlap`) warms an interleaved pipeline up one virtual micro-batch
    more and holds it (costmodel.rank_time.ep_overlap)."""
    m, p, v = plan.num_micro_batches, plan.pp, plan.vpp
    kind = plan.schedule.traits.in_flight
    if kind == "all" and p > 1:   # pp = 1 accumulates one micro-batch at a time
        return m
    # torch's interleaved zero-bubble order holds as many chunks as interleaved 1F1B, at most
    # (with v > 1 the 1F1B count below would be short: tests/costmodel/test_memory.py)
    if kind == "interleaved" or (kind == "1f1b" and v > 1):
        overlap_warmup = 1 if traits.ep_a2a_overlap and plan.ep > 1 else 0   # one more to pair
        chunks = min(m * v, interleaved_warmup_chunks(p, v, rank) + overlap_warmup)
        return chunks / v
    if kind == "v":
        return min(m, p)
    if kind == "dualpipev":   # 2p + 1 of its two stages' chunks on every rank (m >= 2p; simulated)
        return min(2 * m, 2 * p + 1) / 2
    return min(m, p - rank)  # 1F1B and ZB-H1 (which keeps 1F1B's peak by design)


@dataclass(frozen=True, kw_only=True, slots=True)
class AffineBytes:
    """Bytes as a function of a rank's layer count L and recomputed-layer count n:
    base + per_layer·L + per_recomputed·n (+ jump once n > 0: the layer being rebuilt)."""

    base: float
    per_layer: float
    per_recomputed: float
    jump: float

    def at(self, layers: int, recomputed: int) -> float:
        return (self.base + self.per_layer * layers + self.per_recomputed * recomputed
                + (self.jump if recomputed else 0.0))


def _micro_batch_shape(model: ModelSpec, train: TrainSpec, plan: Plan,
                       traits: FrameworkTraits = RUNTIME) -> AffineBytes:
    """What one micro-batch keeps across a rank's layers: a full layer's activations, the
    recomputed layers only their checkpoint, plus the rebuilt layer's bytes during backward."""
    if plan.offload_activations:   # on the host (host_activation_bytes)
        return AffineBytes(base=0.0, per_layer=0.0, per_recomputed=0.0, jump=0.0)
    full = layer_activation_bytes(model, train, plan, Recompute.NONE, traits)
    kept = layer_activation_bytes(model, train, plan, plan.recompute, traits)
    return AffineBytes(base=0.0, per_layer=full, per_recomputed=kept - full, jump=full - kept)


def host_activation_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int, layers: int,
                          traits: FrameworkTraits = RUNTIME) -> float:
    """Host memory of one device's offloaded activations (Plan.offload_activations): every
    in-flight micro-batch's layers, as the device would otherwise hold them."""
    if not plan.offload_activations:
        return 0.0
    full = layer_activation_bytes(model, train, plan, Recompute.NONE, traits)
    return in_flight_micro_batches(plan, rank, traits) * layers * full


def _layers_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, layers: int,
                  recomputed: int, traits: FrameworkTraits = RUNTIME) -> tuple[float, float]:
    """(bytes one micro-batch keeps across `layers` layers, `recomputed` of them recomputed;
    extra bytes while the backward pass rebuilds one recomputed layer)."""
    shape = _micro_batch_shape(model, train, plan, traits)
    rebuilt = shape.jump if recomputed else 0.0
    return shape.at(layers, recomputed) - rebuilt, rebuilt


def activation_shape(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                     micro_batch: AffineBytes | None = None,
                     traits: FrameworkTraits = RUNTIME,
                     backward: tuple[float, float] | None = None, dense: int | None = None) -> AffineBytes:
    """A rank's peak activations: every in-flight micro-batch's layers, one layer being rebuilt,
    and the embedding / LM-head tensors of the first / last rank, and what its `dense` dense
    first layers add (by default as the plan's split places them: dense_layers_on_rank).
    `backward`: the rank's backward_working_bytes alone and beside the rebuilt layer
    (_backward_bytes), where the caller has them."""
    mb = micro_batch or _micro_batch_shape(model, train, plan, traits)
    held = in_flight_micro_batches(plan, rank, traits)
    dense = dense_layers_on_rank(model, plan, rank) if dense is None else dense
    deferred = edges = 0.0
    if plan.schedule.defers_weight_grad:
        passes = deferred_weight_passes(plan, rank)
        deferred = passes * weight_grad_input_bytes(model, train, plan, traits)
        if traits.deferred_w_keeps_graph:   # the embedding's and the loss's tensors too
            first, last = rank == plan.stage_rank(0), rank == plan.stage_rank(plan.num_virtual_stages - 1)
            edges = passes * (edge_bytes_per_micro_batch(model, train, plan, first, last, traits, dense)
                              + edge_weight_grad_output_bytes(model, train, plan, first, last))
    last = rank == plan.stage_rank(plan.num_virtual_stages - 1)
    working, beside_rebuilt = backward or _backward_bytes(model, train, plan, last, mb, traits)
    base = (edges + held_send_bytes(model, train, plan, rank, traits)
            + _edge_activation_bytes(model, train, plan, rank, dense, traits) + working)
    # a rebuilt layer and the loss's gradient are not held at once (backward_working_bytes)
    jump = mb.jump + beside_rebuilt - working
    return AffineBytes(base=base, per_layer=held * mb.per_layer + deferred,
                       per_recomputed=held * mb.per_recomputed, jump=jump)


def _backward_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, last: bool, mb: AffineBytes,
                    traits: FrameworkTraits) -> tuple[float, float]:
    """A rank's backward_working_bytes alone and beside the layer it rebuilds (its micro-batch's
    jump): the same for every rank but the last."""
    return (backward_working_bytes(model, train, plan, last, traits),
            backward_working_bytes(model, train, plan, last, traits, mb.jump))


def rebuilt_layer_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                        traits: FrameworkTraits = RUNTIME) -> float:
    """One micro-batch's extra bytes while the rank's backward rebuilds a recomputed layer (0
    on a rank that recomputes none)."""
    return _layers_bytes(model, train, plan, plan.layers_on_rank(rank), plan.recompute_num_layers[rank], traits)[1]


def deferred_weight_passes(plan: Plan, rank: int) -> float:
    """Weight-gradient passes a zero-bubble rank has put off at once, at most, in units of its
    whole layer set: torch's ZB-H1 order defers rank + 1 stage chunks, ZBV 2·rank + 1 half-ranks,
    DualPipeV rank + 1 (counted by costmodel.pipeline_simulation with unit costs; tests/costmodel/test_memory.py). Added to the
    in-flight activations this is an upper bound of the simulated peak, which frees and holds
    them at their real times."""
    chunks = plan.schedule.traits.deferred_chunks_per_rank * rank + 1
    return min(plan.num_micro_batches * plan.vpp, chunks) / plan.vpp


def activation_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                     layers: int, recomputed: int, traits: FrameworkTraits = RUNTIME) -> float:
    return activation_shape(model, train, plan, rank, traits=traits).at(layers, recomputed)


def _edge_activation_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int, dense: int,
                           traits: FrameworkTraits = RUNTIME) -> float:
    """Embedding output on the first stage and what the rank's dense first layers add (per
    in-flight micro-batch); final norm, logits and fp32 softmax on the last (Megatron's
    vocab-parallel cross entropy works in fp32), held for one micro-batch (all of them under
    GPipe)."""
    total = 0.0
    first = rank == plan.stage_rank(0)
    if first or dense:
        total += in_flight_micro_batches(plan, rank, traits) * edge_bytes_per_micro_batch(model, train, plan, first, False,
                                                                                   traits, dense)
    if rank == plan.stage_rank(plan.num_virtual_stages - 1):
        held = plan.num_micro_batches if plan.schedule.traits.in_flight == "all" and plan.pp > 1 else 1
        total += held * edge_bytes_per_micro_batch(model, train, plan, False, True, traits)
    return total


def micro_batch_activation_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, layers: int,
                                 recomputed: int, first: bool, last: bool,
                                 traits: FrameworkTraits = RUNTIME, dense: int | None = None) -> tuple[float, float]:
    """(bytes one micro-batch holds on a stage of `layers` layers, `recomputed` of them
    recomputed, `dense` of them dense first layers (by default all of them, on the first stage);
    extra bytes while its backward rebuilds a recomputed layer). The simulator counts these per
    in-flight micro-batch; `activation_bytes` is its closed form."""
    held, rebuilt = _layers_bytes(model, train, plan, layers, recomputed, traits)
    return held + edge_bytes_per_micro_batch(model, train, plan, first, last, traits, dense), rebuilt


def overlap_warmup_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                         traits: FrameworkTraits = RUNTIME) -> float:
    """What Megatron-Core's expert all-to-all overlap holds beyond the interleaved order the
    pipeline simulation runs: the virtual micro-batch its warmup adds (in_flight_micro_batches),
    one micro-batch of the rank's largest chunk; none where every chunk is in flight already."""
    v, n = plan.vpp, plan.num_virtual_stages
    if not (traits.ep_a2a_overlap and plan.ep > 1 and plan.pp > 1 and v > 1):
        return 0.0
    if interleaved_warmup_chunks(plan.pp, v, rank) >= plan.num_micro_batches * v:
        return 0.0
    recomputed, dense = plan.recompute_per_stage(traits.recompute_placement), dense_layers_by_stage(model, plan)
    return max(micro_batch_activation_bytes(model, train, plan, plan.layers_per_stage[j], recomputed[j], j == 0,
                                            j == n - 1, traits, dense[j])[0]
               for j in plan.stages_of_rank(rank))


def pipeline_buffer_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                          traits: FrameworkTraits = RUNTIME) -> float:
    """A pipeline rank's send and receive buffers: one activation and one gradient each way in
    flight, or, where the framework keeps torch's PipelineStage receive buffers (frameworks
    `recv_buffers_kept`), one per micro-batch for the output gradient of every local stage before
    the last and for the activation of every local stage after the first, less those of the
    micro-batches in flight: a received activation is the stage's first saved input, which the
    activations already count."""
    if plan.pp == 1:
        return 0.0
    boundary = send_bytes(model, train, plan)
    if not traits.recv_buffers_kept:
        return 4 * boundary
    stages = plan.stages_of_rank(rank)
    activations = sum(j > 0 for j in stages) * max(0.0, plan.num_micro_batches - in_flight_micro_batches(plan, rank, traits))
    gradients = sum(j < plan.num_virtual_stages - 1 for j in stages) * plan.num_micro_batches
    return boundary * (activations + gradients)


def buffer_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                 traits: FrameworkTraits = RUNTIME) -> float:
    """Communication buffers of pipeline rank `rank`: its pipeline sends and receives
    (pipeline_buffer_bytes), and where every micro-batch reduces,
    ZeRO-3's gathered layers (the current one and the prefetched next one) and one FSDP unit's
    gradient in the reduce dtype, the reduce-scatter's input (fsdp_units.fsdp_unit_params: a layer
    under ZeRO-3, a stage of small layers whole below it); none of these where a pipeline keeps
    weights and gradients whole (state_bytes_for). A once-a-step reduction's input is not counted:
    it comes after the backward has freed the activations, which the peak counts instead (the
    closed loops' two models in bf16, dp2, micro-batch 1, a stage one unit: ZeRO-1 measured 9 and
    16 % below the prediction, ZeRO-0 within 2 % of it, as with a unit a layer: `python
    benchmarks/memory.py dp`)."""
    return pipeline_buffer_bytes(model, train, plan, rank, traits) + _state_buffer_bytes(model, train, plan, rank, traits)


def _state_buffer_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                        traits: FrameworkTraits = RUNTIME) -> float:
    """buffer_bytes' part that the placement of states decides: ZeRO-3's gathered layers and
    the reduce-scatter's input, where every micro-batch reduces."""
    a = train.compute_dtype.num_bytes
    total = 0.0
    if reduces_every_micro_batch(plan, traits):
        if coordinates(model, plan, traits):   # DeepSpeed's coordinator: what its prefetch bounds allow
            held = rank_params(model, plan, rank, traits)
            gathered = a * live_params(model, train, plan, traits, plan.layers_on_rank(rank),
                                       (held.embedding, held.head))
        else:
            layer = layer_params(model, plan.tp, plan.ep, plan.etp, traits.shared_expert_tp)
            gathered = 2 * layer * a if plan.zero_stage >= 3 else 0
        total += gathered + fsdp_unit_params(model, plan, traits) * train.grad_dtype.num_bytes
    return total


# Transformer Engine's TP-overlap communicators (transformer_engine/pytorch/module/base.py
# initialize_ub, which Megatron-Core's --tp-comm-overlap calls with the shape seq x micro-batch / cp
# by hidden): 12 of them (qkv, proj, fc1 and fc2 forward, their data and weight gradients), each a
# buffer of that whole shape, registered outside torch's allocator; under float8 the 8 all-gather
# ones hold 1-byte elements
TP_OVERLAP_BUFFERS, TP_OVERLAP_GATHERS = 12, 8


def reserved_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, device: DeviceProfile,
                   traits: FrameworkTraits, devices_per_node: int) -> float:
    """What a rank holds outside torch's allocator: the device's reserve (CUDA context, NCCL's
    buffers: Efficiency.reserved_memory_bytes), the expert dispatcher's buffers where the framework
    runs DeepEP (memory.dispatcher) and, where the framework overlaps TP with TE's userbuffers
    (`tp_overlap_userbuffers` where frameworks.tp_comm_overlaps holds), their buffers."""
    reserve = (device.efficiency.reserved_memory_bytes
               + dispatcher_buffer_bytes(model, train, traits, plan.ep, plan.etp, devices_per_node))
    if not (traits.tp_overlap_userbuffers
            and tp_comm_overlaps(traits, device.tp_comm_gemm_overlap, plan.tp, plan.sequence_parallel,
                                 tp_within_node=tp_in_one_node(plan.tp, devices_per_node))):
        return reserve
    a = train.compute_dtype.num_bytes
    per_element = (TP_OVERLAP_GATHERS * (1 if plan.fp8_linears else a)
                   + (TP_OVERLAP_BUFFERS - TP_OVERLAP_GATHERS) * a)
    return reserve + per_element * local_tokens(train, plan) * model.hidden_size


def stage_memory(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                 reserved_bytes: float, traits: FrameworkTraits = RUNTIME) -> StageMemory:
    return stage_memory_at(model, train, plan, rank, plan.layers_on_rank(rank),
                           plan.recompute_num_layers[rank], reserved_bytes, traits)


def stage_memory_at(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int, layers: int,
                    recomputed: int, reserved_bytes: float,
                    traits: FrameworkTraits = RUNTIME) -> StageMemory:
    """Memory of pipeline rank `rank` were it to hold `layers` layers, `recomputed` of them
    recomputed (the search reads the same quantity as `stage_memory_shapes`)."""
    first, last = plan.stage_rank(0), plan.stage_rank(plan.num_virtual_stages - 1)
    held = rank_params_at(model, plan, layers, rank == first, rank == last, traits,
                          dense_layers_on_rank(model, plan, rank))
    weights, grads, optim = state_bytes_for(train, plan, held.total, traits, experts=held.experts)
    weights += float8_weight_cache_bytes(plan, traits) * held.float8_linears
    return StageMemory(params_bytes=weights, grads_bytes=grads, optimizer_bytes=optim,
                       activations_bytes=activation_bytes(model, train, plan, rank, layers, recomputed, traits),
                       buffers_bytes=buffer_bytes(model, train, plan, rank, traits),
                       reserved_bytes=reserved_bytes)


def stage_memory_shapes(model: ModelSpec, train: TrainSpec, plan: Plan,
                        reserved_bytes: float, traits: FrameworkTraits = RUNTIME,
                        dense: Sequence[int] | None = None) -> list[AffineBytes]:
    """Per pipeline rank, its total memory as an affine function of its layer and
    recomputed-layer counts: `stage_memory_at(...).total_bytes` for every (L, n) at once. States
    are linear in the rank's parameters, which are affine in L. `dense`: per rank, how many of
    DeepSeek's dense first layers it holds (by default all of them on the first)."""
    return stage_memory_shapes_by_zero(model, train, [plan], reserved_bytes, traits, dense)[0]


def stage_memory_shapes_by_zero(model: ModelSpec, train: TrainSpec, plans: list[Plan],
                                reserved_bytes: float, traits: FrameworkTraits = RUNTIME,
                                dense: Sequence[int] | None = None) -> list[list[AffineBytes]]:
    """`stage_memory_shapes` of plans that differ only in their ZeRO stage (activations, the
    costly part, do not depend on it and are computed once)."""
    # the dense first layers where the caller's split puts them (per rank), whatever the probe
    # plan's own split: by default all on the first rank (the parameters' default, rank_params_at)
    dense = dense or dense_layers_first_rank(model.first_k_dense, plans[0])
    return stage_memory_shapes_by_dense(model, train, plans, reserved_bytes, traits, [dense])[0]


def stage_memory_shapes_by_dense(model: ModelSpec, train: TrainSpec, plans: list[Plan], reserved_bytes: float,
                                 traits: FrameworkTraits, placements: Sequence[Sequence[int]]
                                 ) -> list[list[list[AffineBytes]]]:
    """`stage_memory_shapes_by_zero` per placement of DeepSeek's dense first layers (per rank, how
    many it holds), each rank's activations priced once per count of them."""
    plan = plans[0]
    first, last = plan.stage_rank(0), plan.stage_rank(plan.num_virtual_stages - 1)
    mb = _micro_batch_shape(model, train, plan, traits)
    # (edge's replicated and expert parameters, replicated per layer, experts per layer, the edge's
    # layer parameters): one per kind of rank (an edge holds experts and layers where the first
    # layers are dense or MTP modules follow)
    params: dict[tuple[bool, bool, int], tuple[int, int, int, int, int]] = {}
    activations: dict[tuple[int, int], AffineBytes] = {}
    backward = {last_rank: _backward_bytes(model, train, plan, last_rank, mb, traits) for last_rank in (False, True)}
    by_placement = []
    for dense in placements:
        ranks = []
        for rank in range(plan.pp):
            kind = (rank == first, rank == last, dense[rank])
            if kind not in params:
                edge, one = (rank_params_at(model, plan, layers, *kind[:2], traits, kind[2]) for layers in (0, 1))
                params[kind] = (edge.replicated, edge.experts, one.replicated - edge.replicated,
                                one.experts - edge.experts, edge.float8_linears)
            if (rank, dense[rank]) not in activations:
                activations[rank, dense[rank]] = activation_shape(model, train, plan, rank, mb, traits,
                                                                  backward[kind[1]], dense[rank])
            ranks.append((params[kind], activations[rank, dense[rank]]))
        by_placement.append(ranks)
    pipeline_buffers = [pipeline_buffer_bytes(model, train, plan, rank, traits) for rank in range(plan.pp)]
    out: list[list[list[AffineBytes]]] = [[] for _ in placements]
    for sharded in plans:
        # states are linear in each kind of parameter: bytes per replicated one and per expert one
        per_param = sum(state_bytes_for(train, sharded, 1.0, traits))
        per_expert = sum(state_bytes_for(train, sharded, 1.0, traits, experts=1.0))
        cache = float8_weight_cache_bytes(sharded, traits)
        fixed = [pipeline_buffers[rank] + _state_buffer_bytes(model, train, sharded, rank, traits) + reserved_bytes
                 for rank in range(plan.pp)]
        for shapes, ranks in zip(out, by_placement):
            shapes.append([AffineBytes(base=(fixed[rank] + per_param * edge + per_expert * edge_experts
                                             + cache * edge_layers + act.base),
                                       per_layer=((per_param + cache) * per_layer + (per_expert + cache) * experts
                                                  + act.per_layer),
                                       per_recomputed=act.per_recomputed, jump=act.jump)
                           for rank, ((edge, edge_experts, per_layer, experts, edge_layers), act) in enumerate(ranks)])
    return out
