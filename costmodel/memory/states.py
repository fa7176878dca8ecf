"""Training states per device: weights, gradients and optimizer states under ZeRO / FSDP, on
the device or offloaded to the host.

States follow the ZeRO paper (Rajbhandari et al. 2020, Sec. 3.1 and 5): mixed-precision Adam
holds 16-bit weights (2 bytes), gradients (`grad_dtype`), and fp32 master weights, momentum and
variance (12 bytes); ZeRO-1 shards the optimizer states, ZeRO-2 also the gradients, ZeRO-3 also
the weights, over the data-parallel (x context-parallel) group. How a framework departs from the
paper is one of its traits (costmodel.frameworks): our runtime (FSDP2, the default) keeps the fp32
shard as the master weight and holds whole gradients under a pipeline until its last micro-batch.
"""
from __future__ import annotations

from costmodel.frameworks import RUNTIME, FrameworkTraits, float8_params
from costmodel.params import expert_dp, rank_params
from costmodel.plan import Plan
from costmodel.specs import DType, ModelSpec, Optimizer, TrainSpec

ADAM_MOMENT_BYTES = 8  # fp32 momentum + variance


def optimizer_bytes_per_param(train: TrainSpec) -> int:
    master = 4 if train.master_weights_fp32 else 0
    moments = ADAM_MOMENT_BYTES if train.optimizer is Optimizer.ADAMW else 0
    return master + moments


def float8_weight_cache_bytes(plan: Plan, traits: FrameworkTraits = RUNTIME) -> int:
    """Bytes per element of a layer's linear weights (routed experts' included) that the
    framework keeps beside its 16-bit weights for the step: Transformer Engine's float8 copy,
    cached from the first micro-batch on (frameworks `float8_weight_cache`), a byte an element,
    and on a chip whose float8 GEMMs take the TN layout only (Hopper) its transpose beside it
    (`float8_transposed_copy`), for the input gradient's GEMM. None where the weights are float8
    themselves (costmodel.frameworks.float8_params). The embedding and the output layer are no
    float8 linears."""
    if plan.fp8_linears and traits.float8_weight_cache and not float8_params(plan, traits):
        return 1 + traits.float8_transposed_copy
    return 0


def state_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                traits: FrameworkTraits = RUNTIME) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) on one device of pipeline rank `rank`."""
    held = rank_params(model, plan, rank, traits)
    return state_bytes_for(train, plan, held.total, traits, experts=held.experts)


def runtime_wraps_in_fsdp(plan: Plan, train: TrainSpec) -> bool:
    """Whether our runtime puts the plan's stages under FSDP2 (runtime.parallel.apply_data_parallel):
    always with more than one data-parallel replica; with one, only where FSDP has something to do
    (16-bit compute for its mixed precision, TP's DTensors, offloaded states)."""
    return not (plan.dp * plan.cp == 1 and plan.tp == 1 and train.compute_dtype is DType.FP32
                and not plan.offload_optimizer)


def keeps_whole_grads_under_pp(pp: int, traits: FrameworkTraits) -> bool:
    """Whether the framework keeps a pipeline's full gradients until its last micro-batch
    whatever the ZeRO stage (costmodel.frameworks `sharded_grads_under_pp`: torch pipelining over
    FSDP2). ZeRO-2 then holds and moves exactly what ZeRO-1 does: every difference between the two
    in this package goes through `unsharded_between_micro_batches` (tests/costmodel/test_memory.py
    checks whole estimates alike), and the search names one as the other's alternative."""
    return pp > 1 and not traits.sharded_grads_under_pp


def unsharded_between_micro_batches(plan: Plan, traits: FrameworkTraits) -> bool:
    """ZeRO-2/3 under a pipeline whose framework keeps full gradients (and ZeRO-3's gathered
    weights) until the last micro-batch (costmodel.frameworks: torch pipelining over FSDP2)."""
    return plan.zero_stage >= 2 and keeps_whole_grads_under_pp(plan.pp, traits)


def reduces_every_micro_batch(plan: Plan, traits: FrameworkTraits) -> bool:
    """ZeRO-2/3 with sharded gradients between micro-batches: each micro-batch's gradients are
    reduced (and the shard accumulated) at once, not held whole until the step's last."""
    return plan.zero_stage >= 2 and not unsharded_between_micro_batches(plan, traits)


def state_bytes_for(train: TrainSpec, plan: Plan, n: float, traits: FrameworkTraits = RUNTIME,
                    *, experts: float = 0.0) -> tuple[float, float, float]:
    """States of `n` parameter elements on a device, `experts` of them routed experts: CP ranks
    hold the same weights, so ZeRO shards the others over dp x cp (the shard group's dp / dp_replicate
    x cp under hybrid sharding: Plan.zero_ranks), and the experts over the
    edp x cp ranks that hold the same ones (Plan.ep)."""
    replicated = n - experts
    out = state_bytes_from_counts(train, plan, replicated, replicated / plan.zero_ranks, traits)
    if not experts:
        return out
    more = state_bytes_from_counts(train, plan, experts, experts / expert_dp(plan, traits), traits)
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


def expert_state_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, rank: int,
                       traits: FrameworkTraits = RUNTIME) -> float:
    """The routed experts' share of a rank's weights, gradients and optimizer states (its
    num_experts/ep experts per layer, ZeRO-sharded over edp x cp): a part of state_bytes."""
    experts = rank_params(model, plan, rank, traits).experts
    return (sum(state_bytes_from_counts(train, plan, experts, experts / expert_dp(plan, traits), traits))
            if experts else 0.0)
