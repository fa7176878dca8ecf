"""Memory per device, per pipeline rank: states, activations, buffers.

States follow the ZeRO paper (Rajbhandari et al. 2020, Sec. 3.1 and 5): mixed-precision Adam
holds 16-bit weights (2 bytes), gradients (`grad_dtype`), and fp32 master weights, momentum and
variance (12 bytes); ZeRO-1 shards the optimizer states, ZeRO-2 also the gradients, ZeRO-3 also
the weights, over the data-parallel (x context-parallel) group. How a framework departs from the
paper is one of its traits (costmodel.frameworks): our runtime (FSDP2, the default) keeps the fp32
shard as the master weight and holds whole gradients under a pipeline until its last micro-batch.

Activations follow Korthikanti et al. 2022 (arXiv 2205.05198) Sec. 4: per layer, per micro-batch
s·b·h·(34 + 5·a·s/h) bytes for a GPT layer with t = 1, s·b·h·(10 + 24/t + 5·a·s/(h·t)) with tensor
parallelism, s·b·h·(34/t + 5·a·s/(h·t)) with sequence parallelism, the 5·a·s/h term gone under
selective recomputation and 2·s·b·h (/t with SP) under full recomputation. `layer_activation_bytes`
re-derives those terms tensor by tensor so they hold for GQA (smaller K, V), SwiGLU (four f-wide
tensors instead of two), no dropout (Llama), fp32 activations, and flash attention (no s x s
tensors; the softmax statistics instead); how many SwiGLU tensors are saved is a framework trait.
Tests check the published coefficients.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from costmodel.compute import cp_chunk_scores, expert_rows, moe_tokens
from costmodel.frameworks import RUNTIME, FrameworkTraits
from costmodel.layout import Style, layer_blocks
from costmodel.params import ceil_div, expert_dp, fsdp_unit_params, layer_params, rank_params, rank_params_at
from costmodel.plan import Plan, Recompute, stage_owner
from costmodel.specs import Arch, AttentionKernel, DType, ModelSpec, NormKind, Optimizer, PositionKind, TrainSpec

ADAM_MOMENT_BYTES = 8  # fp32 momentum + variance


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


def optimizer_bytes_per_param(train: TrainSpec) -> int:
    master = 4 if train.master_weights_fp32 else 0
    moments = ADAM_MOMENT_BYTES if train.optimizer is Optimizer.ADAMW else 0
    return master + moments


def state_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                traits: FrameworkTraits = RUNTIME) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) on one device of pipeline rank `rank`."""
    held = rank_params(model, plan, rank)
    return state_bytes_for(train, plan, held.total, traits, experts=held.experts)


def runtime_wraps_in_fsdp(plan: Plan, train: TrainSpec) -> bool:
    """Whether our runtime puts the plan's stages under FSDP2 (runtime.parallel.apply_data_parallel):
    always with more than one data-parallel replica; with one, only where FSDP has something to do
    (16-bit compute for its mixed precision, TP's DTensors, offloaded states)."""
    return not (plan.dp * plan.cp == 1 and plan.tp == 1 and train.compute_dtype is DType.FP32
                and not plan.offload_optimizer)


def unsharded_between_micro_batches(plan: Plan, traits: FrameworkTraits) -> bool:
    """ZeRO-2/3 under a pipeline whose framework keeps full gradients (and ZeRO-3's gathered
    weights) until the last micro-batch (costmodel.frameworks: torch pipelining over FSDP2)."""
    return plan.pp > 1 and plan.zero_stage >= 2 and not traits.sharded_grads_under_pp


def reduces_every_micro_batch(plan: Plan, traits: FrameworkTraits) -> bool:
    """ZeRO-2/3 with sharded gradients between micro-batches: each micro-batch's gradients are
    reduced (and the shard accumulated) at once, not held whole until the step's last."""
    return plan.zero_stage >= 2 and not unsharded_between_micro_batches(plan, traits)


def state_bytes_for(train: TrainSpec, plan: Plan, n: float, traits: FrameworkTraits = RUNTIME,
                    *, experts: float = 0.0) -> tuple[float, float, float]:
    """States of `n` parameter elements on a device, `experts` of them routed experts: CP ranks
    hold the same weights, so ZeRO shards the others over dp x cp, and the experts over the
    edp x cp ranks that hold the same ones (Plan.ep)."""
    replicated = n - experts
    out = state_bytes_from_counts(train, plan, replicated, replicated / (plan.dp * plan.cp), traits)
    if not experts:
        return out
    more = state_bytes_from_counts(train, plan, experts, experts / (expert_dp(plan, traits) * plan.cp), traits)
    return out[0] + more[0], out[1] + more[1], out[2] + more[2]


def state_bytes_from_counts(train: TrainSpec, plan: Plan, whole: float, shard: float,
                            traits: FrameworkTraits = RUNTIME) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) of a rank holding `whole` parameter elements, a
    ZeRO shard of `shard` of them (the dry run counts both on the real model)."""
    z = plan.zero_stage
    held = unsharded_between_micro_batches(plan, traits)
    sharded = whole > shard
    a = train.compute_dtype.num_bytes
    if plan.offload_optimizer:
        return _offloaded_device_bytes(train, plan, whole, held)
    grads = train.grad_dtype.num_bytes * (shard if z >= 2 and not held else whole)
    if traits.fsdp_master_params and train.master_weights_fp32:
        # FSDP mixed precision: the (sharded) fp32 parameter is the master weight; 16-bit copies
        # exist while gathered: all step below ZeRO-3 (kept from forward to backward), only
        # the prefetched units under ZeRO-3 (buffer_bytes) unless a pipeline keeps them
        master = 4 * (shard if z >= 1 else whole)
        copies = a * whole if z < 3 or (held and sharded) else 0.0
        moments = ADAM_MOMENT_BYTES if train.optimizer is Optimizer.ADAMW else 0
        return master + copies, grads, moments * (shard if z >= 1 else whole)
    weights = a * (shard if z >= 3 else whole)
    if z >= 3 and held and sharded:  # the gathered copy stays from the first backward on
        weights += a * whole
    optim = optimizer_bytes_per_param(train) * (shard if z >= 1 else whole)
    return weights, grads, optim


def _offloaded_device_bytes(train: TrainSpec, plan: Plan, whole: float, held: bool) -> tuple[float, float, float]:
    """What stays on the device when FSDP2's CPUOffloadPolicy keeps the shards on the host: the
    gathered compute-dtype weights (all step below ZeRO-3, kept from forward to backward; under
    ZeRO-3 only the prefetched units, in buffer_bytes, unless a pipeline keeps them) and the
    unsharded gradients where they accumulate before their one reduce-scatter (ZeRO-1, or a
    pipeline's micro-batches); the reduced shards, master weights and moments live on the host
    (host_state_bytes)."""
    z = plan.zero_stage
    weights = train.compute_dtype.num_bytes * whole if z < 3 or held else 0.0
    grads = train.grad_dtype.num_bytes * whole if z == 1 or held else 0.0
    return weights, grads, 0.0


def host_state_bytes(train: TrainSpec, plan: Plan, shard: float) -> float:
    """Host memory one device's offloaded states take (`shard`: its ZeRO shard's parameters):
    the fp32 sharded parameter (FSDP2 keeps it as the master weight), the optimizer's moments and
    the reduced fp32 gradient shard. 0 without offload."""
    if not plan.offload_optimizer:
        return 0.0
    moments = ADAM_MOMENT_BYTES if train.optimizer is Optimizer.ADAMW else 0
    return shard * (4 + moments + 4)


def _cp_cpu_mask_elements(train: TrainSpec, plan: Plan, traits: FrameworkTraits) -> float:
    """torch's CPU flash kernel takes a chunk's bottom-right causal mask materialised (c x keys
    before the chunk's end, in the compute dtype) and keeps it for backward; CUDA's kernels take
    the causal offset instead. Per layer, for the CP rank with the most: chunks r and 2cp-1-r
    of c = s/2cp tokens need c·(r+1)c + c·(2cp-r)c elements, c²(2cp+1) for any r > 0 (rank 0's
    first chunk is plain causal). Not per sample or head: one mask broadcast over both."""
    if plan.cp == 1 or not (traits.cp_all_gather_kv and traits.cpu_kernels):
        return 0.0
    return cp_chunk_scores(train.seq_len, plan.cp)


def _moe_saved_bytes(model: ModelSpec, train: TrainSpec, tokens: int, ep: int, traits: FrameworkTraits) -> float:
    """What runtime.moe keeps for backward in one layer (measured per tensor by
    tests/runtime/test_activation_memory.py): the router's fp32 probabilities, the chosen experts
    (int64) and their fp32 weights (and their sum where renormalised); per routed slot (tokens·k)
    the expert output before and after weighting, its weight, its token's index and its sort
    index; per row the device's experts take (tokens·k, times the imbalance under expert
    parallelism: costmodel.compute.expert_rows) its input and the expert's SwiGLU tensors, and
    under expert parallelism its two reorder indices; the shared expert's SwiGLU tensors, and
    with a gate its output and the gate's value. (Its input is the MLP input
    `layer_activation_bytes` counts already.)"""
    a, h, k, e = train.compute_dtype.num_bytes, model.hidden_size, model.experts_per_token, model.num_experts
    router = tokens * (4 * e + 8 * k + 4 * k + (4 if model.moe_norm_topk_prob else 0))
    per_slot = a * (2 * h + 1) + 16
    per_row = a * (h + traits.swiglu_saved_tensors * model.moe_ffn_hidden_size) + (16 if ep > 1 else 0)
    fs = model.shared_expert_ffn_hidden_size
    shared = a * tokens * (traits.swiglu_saved_tensors * fs + ((h + 1) if model.shared_expert_gate else 0))
    return router + tokens * k * per_slot + expert_rows(model, train, tokens, ep) * per_row + shared


def layer_activation_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, mode: Recompute,
                           traits: FrameworkTraits = RUNTIME) -> float:
    """Bytes one layer keeps for backward, for one micro-batch, on one device."""
    a = train.compute_dtype.num_bytes
    t, sp = plan.tp, plan.tp if plan.sequence_parallel else 1
    b, s = plan.micro_batch_size, train.seq_len // plan.cp
    tokens, h, kv, f = b * s, model.hidden_size, model.kv_hidden_size, model.ffn_hidden_size
    q = model.q_hidden_size
    # dropout masks: 1 byte on CUDA, the compute dtype on CPU (costmodel.frameworks.cpu_kernels)
    drop = (a if traits.cpu_kernels else 1) if model.dropout else 0
    if mode is Recompute.FULL:
        return a * tokens * h / sp  # the layer input only
    # 2 norm inputs (and, CPU RMSNorm, their normalised copies) and 2 dropout masks on sequence
    # shards; the attention and MLP inputs whole where TP keeps them gathered (frameworks). CPU's
    # composite RMSNorm computes in fp32 and keeps both tensors in fp32 whatever the compute
    # dtype (measured: bf16 layers kept 20 % more than a count in bf16)
    cpu_rms = model.norm_kind is NormKind.RMSNORM and traits.cpu_kernels
    # a parallel residual's two norms read one tensor, the layer input (kept once)
    norm_inputs = 1 if model.parallel_residual else 2
    norms = norm_inputs * 4 + model.layer_norms * 4 if cpu_rms else norm_inputs * a
    # a mixture of experts takes this rank's sequence shard as it is (runtime.parallel); one norm
    # shared by both branches gives them one input, unless each block gathers its own (SP)
    mlp_input_split = t if model.is_moe else _proj_input_split(plan, traits)
    mlp_input = 0.0 if model.shared_norm and not _gathers_per_block(plan, traits) else a * tokens * h / mlp_input_split
    replicated = (tokens * h * (norms + 2 * drop) / sp + a * tokens * h / _proj_input_split(plan, traits)
                  + mlp_input)
    qkv = a * tokens * (q + 2 * kv) / t + cp_gathered_kv_bytes(model, train, plan, traits)
    if model.arch is Arch.GPT and model.position_kind is PositionKind.ROPE:
        # a fused QKV (GPT-NeoX): attention keeps the rotated Q and K, and V, a view, keeps the
        # whole fused output alive beside them (measured: test_activation_memory's neox cases)
        qkv += a * tokens * (q + kv) / t
    if model.qk_norm:   # Qwen3's per-head norms keep Q and K as projected (CPU's composite RMSNorm: both in fp32)
        qkv += tokens * (q + kv) * (2 * 4 if cpu_rms else a) / t
    if model.position_kind is PositionKind.ROPE:   # RoPE's cos and sin, for Q and for K (any batch)
        qkv += 4 * a * s * model.rotary_dims
    out_proj_input = a * tokens * q / t
    # SwiGLU in eager torch saves gate, up, silu(gate) and the product; a fused kernel keeps the
    # 2f-wide first projection and the product (costmodel.frameworks)
    mlp = (_moe_saved_bytes(model, train, moe_tokens(tokens, t), plan.ep, traits) if model.is_moe else
           (traits.swiglu_saved_tensors if model.ffn_kind.gated else 2) * a * tokens * f / t)
    if mode is Recompute.SELECTIVE:
        core = 0.0
    elif train.attention_kernel is AttentionKernel.FLASH and not (drop and traits.cpu_kernels):
        core = 4.0 * b * (model.num_heads // t) * s  # fp32 log-sum-exp per query row
        if plan.cp > 1 and traits.cp_all_gather_kv:
            # one kernel per chunk, each keeping its output; the projection keeps their
            # concatenation (without CP it keeps the kernel's output itself)
            core += out_proj_input + a * _cp_cpu_mask_elements(train, plan, traits)
    else:  # softmax output (+ dropout mask and output), over local queries x all keys
        core = b * (model.num_heads / t) * s * train.seq_len * (a + (drop + a if drop else 0))
    return replicated + qkv + out_proj_input + mlp + core


def cp_gathered_kv_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, traits: FrameworkTraits = RUNTIME) -> float:
    """What one layer's attention keeps, per micro-batch, of the K and V gathered from the other
    CP ranks (all-gathered CP, costmodel.frameworks `cp_all_gather_kv`; a ring keeps none)."""
    if plan.cp == 1 or not traits.cp_all_gather_kv:
        return 0.0
    others = train.seq_len - train.seq_len // plan.cp
    return train.compute_dtype.num_bytes * plan.micro_batch_size * others * 2 * model.kv_hidden_size / plan.tp


def expert_state_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                       traits: FrameworkTraits = RUNTIME) -> float:
    """The routed experts' share of a rank's weights, gradients and optimizer states (its
    num_experts/ep experts per layer, ZeRO-sharded over edp x cp): a part of state_bytes."""
    experts = rank_params(model, plan, rank).experts
    return (sum(state_bytes_from_counts(train, plan, experts, experts / (expert_dp(plan, traits) * plan.cp), traits))
            if experts else 0.0)


def _gathers_per_block(plan: Plan, traits: FrameworkTraits) -> bool:
    """Under SP each block all-gathers its own input, and a framework that keeps the gathered
    input keeps one per block."""
    return plan.tp > 1 and plan.sequence_parallel and traits.tp_keeps_gathered_input


def _proj_input_split(plan: Plan, traits: FrameworkTraits) -> int:
    """Over how many ranks the saved input of a column-parallel projection is split: the
    sequence shards under SP, unless the framework keeps the gathered input (frameworks)."""
    return plan.tp if plan.sequence_parallel and not traits.tp_keeps_gathered_input else 1


def send_bytes(model: ModelSpec, train: TrainSpec, plan: Plan) -> float:
    """One activation (or its gradient) a pipeline stage sends: this rank's sequence shard under SP."""
    sp = plan.tp if plan.sequence_parallel else 1
    return train.compute_dtype.num_bytes * _local_tokens(train, plan) * model.hidden_size / sp


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


def in_flight_micro_batches(plan: Plan, rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of the
    rank's whole layer set (Narayanan et al. SC'21 Sec. 2.2; Korthikanti et al. Sec. 4.2.3 for
    the interleaved schedule: p·(1 + (p-1)/(p·v)) on the first rank)."""
    m, p, v = plan.num_micro_batches, plan.pp, plan.vpp
    kind = plan.schedule.traits.in_flight
    if kind == "all" and p > 1:   # pp = 1 accumulates one micro-batch at a time
        return m
    # torch's interleaved zero-bubble order holds as many chunks as interleaved 1F1B, at most
    # (with v > 1 the 1F1B count below would be short: tests/costmodel/test_memory.py)
    if kind == "interleaved" or (kind == "1f1b" and v > 1):
        chunks = min(m * v, 2 * (p - rank - 1) + (v - 1) * p + 1)
        return chunks / v
    if kind == "v":
        return min(m, p)
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
    return in_flight_micro_batches(plan, rank) * layers * full


def _layers_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, layers: int,
                  recomputed: int, traits: FrameworkTraits = RUNTIME) -> tuple[float, float]:
    """(bytes one micro-batch keeps across `layers` layers, `recomputed` of them recomputed;
    extra bytes while the backward pass rebuilds one recomputed layer)."""
    shape = _micro_batch_shape(model, train, plan, traits)
    rebuilt = shape.jump if recomputed else 0.0
    return shape.at(layers, recomputed) - rebuilt, rebuilt


def activation_shape(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                     micro_batch: AffineBytes | None = None,
                     traits: FrameworkTraits = RUNTIME) -> AffineBytes:
    """A rank's peak activations: every in-flight micro-batch's layers, one layer being rebuilt,
    and the embedding / LM-head tensors of the first / last rank."""
    mb = micro_batch or _micro_batch_shape(model, train, plan, traits)
    held = in_flight_micro_batches(plan, rank)
    deferred = edges = 0.0
    if plan.schedule.defers_weight_grad:
        passes = deferred_weight_passes(plan, rank)
        deferred = passes * weight_grad_input_bytes(model, train, plan, traits)
        if traits.deferred_w_keeps_graph:   # the embedding's and the loss's tensors too
            first, last = rank == plan.stage_rank(0), rank == plan.stage_rank(plan.num_virtual_stages - 1)
            edges = passes * (edge_bytes_per_micro_batch(model, train, plan, first, last, traits)
                              + edge_weight_grad_output_bytes(model, train, plan, first, last))
    base = (edges + held_send_bytes(model, train, plan, rank, traits)
            + _edge_activation_bytes(model, train, plan, rank, traits)
            + backward_working_bytes(model, train, plan, rank == plan.stage_rank(plan.num_virtual_stages - 1),
                                     traits))
    return AffineBytes(base=base, per_layer=held * mb.per_layer + deferred,
                       per_recomputed=held * mb.per_recomputed, jump=mb.jump)


def deferred_weight_passes(plan: Plan, rank: int) -> float:
    """Weight-gradient passes a zero-bubble rank has put off at once, at most, in units of its
    whole layer set: torch's ZB-H1 order defers rank + 1 stage chunks, ZBV 2·rank + 1 half-ranks
    (counted by costmodel.pipeline_simulation with unit costs; tests/costmodel/test_memory.py). Added to the
    in-flight activations this is an upper bound of the simulated peak, which frees and holds
    them at their real times."""
    chunks = plan.schedule.traits.deferred_chunks_per_rank * rank + 1
    return min(plan.num_micro_batches * plan.vpp, chunks) / plan.vpp


def activation_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                     layers: int, recomputed: int, traits: FrameworkTraits = RUNTIME) -> float:
    return activation_shape(model, train, plan, rank, traits=traits).at(layers, recomputed)


def _edge_activation_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                           traits: FrameworkTraits = RUNTIME) -> float:
    """Embedding output on the first stage (per in-flight micro-batch); final norm, logits and
    fp32 softmax on the last (Megatron's vocab-parallel cross entropy works in fp32), held for
    one micro-batch (all of them under GPipe)."""
    total = 0.0
    if rank == plan.stage_rank(0):
        total += in_flight_micro_batches(plan, rank) * edge_bytes_per_micro_batch(model, train, plan, True, False,
                                                                                   traits)
    if rank == plan.stage_rank(plan.num_virtual_stages - 1):
        held = plan.num_micro_batches if plan.schedule.traits.in_flight == "all" and plan.pp > 1 else 1
        total += held * edge_bytes_per_micro_batch(model, train, plan, False, True, traits)
    return total


def edge_bytes_per_micro_batch(model: ModelSpec, train: TrainSpec, plan: Plan, first: bool,
                               last: bool, traits: FrameworkTraits = RUNTIME) -> float:
    a, b, s = train.compute_dtype.num_bytes, plan.micro_batch_size, train.seq_len // plan.cp
    sp = plan.tp if plan.sequence_parallel else 1
    tokens = b * s
    total = 0.0
    if first:
        total += tokens * model.hidden_size * (a + model.dropout) / sp
    if last:
        total += logits_held_bytes(model, train, plan, traits) + a * tokens * model.hidden_size * (1 + 1 / sp)
    return total


def _local_tokens(train: TrainSpec, plan: Plan) -> int:
    """Tokens of one micro-batch on one device: its sequences, each cut into cp pieces."""
    return plan.micro_batch_size * (train.seq_len // plan.cp)


def _logits_elems(model: ModelSpec, train: TrainSpec, plan: Plan, traits: FrameworkTraits = RUNTIME) -> float:
    """Logits of one micro-batch on one device: its vocabulary shard, or the whole vocabulary
    where the framework gathers them before the loss (frameworks.vocab_parallel_loss)."""
    return _local_tokens(train, plan) * loss_vocab(model, plan, traits)


def loss_vocab(model: ModelSpec, plan: Plan, traits: FrameworkTraits = RUNTIME) -> int:
    """The vocabulary one device's loss runs over."""
    return ceil_div(model.vocab_size, plan.tp) if traits.vocab_parallel_loss else model.vocab_size


def logits_held_bytes(model: ModelSpec, train: TrainSpec, plan: Plan,
                      traits: FrameworkTraits = RUNTIME) -> float:
    """What the loss keeps of one micro-batch's logits until its backward: the fp32 log-probs
    cross entropy saves (4 bytes whatever the compute dtype: the loss runs in fp32), and, under
    a pipeline, the last stage's output in the compute dtype, which torch pipelining (like
    Megatron's schedules) keeps for the backward call. Without a pipeline the 16-bit logits die
    once upcast."""
    kept_output = train.compute_dtype.num_bytes if plan.pp > 1 else 0
    return _logits_elems(model, train, plan, traits) * (4 + kept_output)


def backward_working_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, last: bool,
                           traits: FrameworkTraits = RUNTIME) -> float:
    """Transient bytes of the backward pass beyond what the forward kept: a layer's input
    gradients of its widest block (SwiGLU: gate, up and product gradients, f wide; attention:
    dQ, dK, dV and FlashAttention-2's fp32 dQ accumulator) plus its largest weight gradient in
    the compute dtype before it is added to the fp32 main gradient; on the last stage the
    loss's gradient (fp32 then cast back) over the logits, if larger. One backward runs at a
    time, so a rank adds this once."""
    a, t = train.compute_dtype.num_bytes, plan.tp
    tokens = _local_tokens(train, plan)
    h, kv, f = model.hidden_size, model.kv_hidden_size, model.ffn_hidden_size
    mlp_weight = a * h * f / t
    if model.is_moe:   # one expert's backward at a time; it may have got every token of the shard
        f = max(model.moe_ffn_hidden_size, model.shared_expert_ffn_hidden_size)
        mlp_weight = a * h * f   # whole on every TP rank
    mlp = (traits.swiglu_saved_tensors - 1 if model.ffn_kind.gated else 2) * a * tokens * f / t
    q = model.q_hidden_size
    attention = a * tokens * (q + 2 * kv) / t + 4 * tokens * q / t
    widest_weight = max(mlp_weight, a * h * (q + 2 * kv) / t)
    layer = max(mlp, attention) + widest_weight
    # a loss whose backward writes the gradient over its saved softmax needs only the cast
    head = _logits_elems(model, train, plan, traits) * (a if traits.loss_grad_in_place else 4 + a) if last else 0.0
    # offloaded activations: the layer whose saved tensors are back on the device for its backward
    back = layer_activation_bytes(model, train, plan, Recompute.NONE, traits) if plan.offload_activations else 0.0
    return max(layer, head) + back


def weight_grad_input_bytes(model: ModelSpec, train: TrainSpec, plan: Plan,
                            traits: FrameworkTraits = RUNTIME) -> float:
    """Per layer and micro-batch, what a deferred weight-gradient pass (ZB-H1, ZBV) still needs
    once the input-gradient pass has freed the rest: the input of every projection (the two
    norm outputs feeding QKV and the MLP, the attention output, the MLP's activated product);
    the whole layer where the framework keeps the graph (frameworks.deferred_w_keeps_graph)."""
    if traits.deferred_w_keeps_graph:
        return (layer_activation_bytes(model, train, plan, plan.recompute, traits)
                + weight_grad_output_bytes(model, train, plan))
    a, t = train.compute_dtype.num_bytes, plan.tp
    tokens = _local_tokens(train, plan)
    return a * tokens * (2 * model.hidden_size / _proj_input_split(plan, traits)
                         + model.q_hidden_size / t + model.ffn_hidden_size / t)


def weight_grad_output_bytes(model: ModelSpec, train: TrainSpec, plan: Plan) -> float:
    """Per layer and micro-batch, the output gradients torch pipelining's input pass captures
    for a deferred weight pass (`stage_backward_input` hooks): every projection's (a column-
    parallel one's 1/t slice, a row-parallel one's whole partial output) and the two norm scales'.
    Measured on a 2-stage ZB-H1 run: 232 MiB held per micro-batch, 228 MiB by this count."""
    sp = plan.tp if plan.sequence_parallel else 1
    width = model.layer_norms * model.hidden_size / sp
    for block in layer_blocks(model):
        width += sum(lin.out_features / plan.tp if lin.style is Style.COLWISE else lin.out_features
                     for lin in block.linears)
    return train.compute_dtype.num_bytes * _local_tokens(train, plan) * width


def edge_weight_grad_output_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, first: bool,
                                   last: bool) -> float:
    """The same for the embedding (its whole output) and the final norm and output projection
    (its vocabulary slice)."""
    sp = plan.tp if plan.sequence_parallel else 1
    width = (model.hidden_size if first else 0) + \
        (model.hidden_size / sp + ceil_div(model.vocab_size, plan.tp) if last else 0)
    return train.compute_dtype.num_bytes * _local_tokens(train, plan) * width


def micro_batch_activation_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, layers: int,
                                 recomputed: int, first: bool, last: bool,
                                 traits: FrameworkTraits = RUNTIME) -> tuple[float, float]:
    """(bytes one micro-batch holds on a stage of `layers` layers, `recomputed` of them
    recomputed; extra bytes while its backward rebuilds a recomputed layer). The simulator
    counts these per in-flight micro-batch; `activation_bytes` is its closed form."""
    held, rebuilt = _layers_bytes(model, train, plan, layers, recomputed, traits)
    return held + edge_bytes_per_micro_batch(model, train, plan, first, last, traits), rebuilt


def buffer_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, traits: FrameworkTraits = RUNTIME) -> float:
    """Communication buffers: pipeline send/receive, and where every micro-batch reduces,
    ZeRO-3's gathered layers (the current one and the prefetched next one) and one FSDP unit's
    gradient in the reduce dtype, the reduce-scatter's input (params.fsdp_unit_params: a layer
    under ZeRO-3, a stage of small layers whole below it); none of these where a pipeline keeps
    weights and gradients whole (state_bytes_for). A once-a-step reduction's input is not counted:
    it comes after the backward has freed the activations, which the peak counts instead (the
    closed loops' two models in bf16, dp2, micro-batch 1, a stage one unit: ZeRO-1 measured 9 and
    16 % below the prediction, ZeRO-0 within 2 % of it, as with a unit a layer; `python
    benchmarks/dp_memory.py`, README "FSDP units of a bucket's size")."""
    a = train.compute_dtype.num_bytes
    sp = plan.tp if plan.sequence_parallel else 1
    total = 0.0
    if plan.pp > 1:
        total += 4 * a * _local_tokens(train, plan) * model.hidden_size / sp
    if reduces_every_micro_batch(plan, traits):
        gathered = 2 * layer_params(model, plan.tp, plan.ep) * a if plan.zero_stage >= 3 else 0
        total += gathered + fsdp_unit_params(model, plan, traits) * train.grad_dtype.num_bytes
    return total


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
    held = rank_params_at(model, plan, layers, rank == first, rank == last)
    weights, grads, optim = state_bytes_for(train, plan, held.total, traits, experts=held.experts)
    return StageMemory(params_bytes=weights, grads_bytes=grads, optimizer_bytes=optim,
                       activations_bytes=activation_bytes(model, train, plan, rank, layers, recomputed, traits),
                       buffers_bytes=buffer_bytes(model, train, plan, traits),
                       reserved_bytes=reserved_bytes)


def stage_memory_shapes(model: ModelSpec, train: TrainSpec, plan: Plan,
                        reserved_bytes: float, traits: FrameworkTraits = RUNTIME) -> list[AffineBytes]:
    """Per pipeline rank, its total memory as an affine function of its layer and
    recomputed-layer counts: `stage_memory_at(...).total_bytes` for every (L, n) at once. States
    are linear in the rank's parameters, which are affine in L."""
    return stage_memory_shapes_by_zero(model, train, [plan], reserved_bytes, traits)[0]


def stage_memory_shapes_by_zero(model: ModelSpec, train: TrainSpec, plans: list[Plan],
                                reserved_bytes: float,
                                traits: FrameworkTraits = RUNTIME) -> list[list[AffineBytes]]:
    """`stage_memory_shapes` of plans that differ only in their ZeRO stage (activations, the
    costly part, do not depend on it and are computed once)."""
    plan = plans[0]
    first, last = plan.stage_rank(0), plan.stage_rank(plan.num_virtual_stages - 1)
    mb = _micro_batch_shape(model, train, plan, traits)
    # (edge, replicated per layer, experts per layer): one per kind of rank
    params: dict[tuple[bool, bool], tuple[int, int, int]] = {}
    ranks = []
    for rank in range(plan.pp):
        kind = (rank == first, rank == last)
        if kind not in params:
            edge, one = rank_params_at(model, plan, 0, *kind), rank_params_at(model, plan, 1, *kind)
            params[kind] = edge.total, one.replicated - edge.total, one.experts
        ranks.append((params[kind], activation_shape(model, train, plan, rank, mb, traits)))
    out = []
    for sharded in plans:
        # states are linear in each kind of parameter: bytes per replicated one and per expert one
        per_param = sum(state_bytes_for(train, sharded, 1.0, traits))
        per_expert = sum(state_bytes_for(train, sharded, 1.0, traits, experts=1.0))
        fixed = buffer_bytes(model, train, sharded, traits) + reserved_bytes
        out.append([AffineBytes(base=fixed + per_param * edge + act.base,
                                per_layer=per_param * per_layer + per_expert * experts + act.per_layer,
                                per_recomputed=act.per_recomputed, jump=act.jump)
                    for (edge, per_layer, experts), act in ranks])
    return out
