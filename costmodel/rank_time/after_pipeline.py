"""What a rank runs once a step beside its pipeline passes: the optimizer step and the step's host
work, the TP-replicated parameters' gradient all-reduce, the gradient accumulation, and FSDP2's
copies on a one-replica plan."""
from __future__ import annotations

from costmodel.comm import Collective, collective_time_s
from costmodel.hardware import ClusterSpec
from costmodel.kernels import (
    fsdp_sync_s,
    gradient_add_s,
    gradient_cast_s,
    host_optimizer_step_s,
    optimizer_step_s,
    step_host_s,
)
from costmodel.memory import reduces_every_micro_batch, runtime_wraps_in_fsdp, unsharded_between_micro_batches
from costmodel.params import (
    RankParams,
    edge_param_tensors,
    expert_dp,
    folds_ep,
    layer_expert_params,
    mla_down_params,
    moe_tp_replicated_params,
    optimized_params,
    qk_norm_params,
    rank_param_tensors,
)
from costmodel.plan import Plan
from costmodel.rank_time.spans import Spans
from costmodel.specs import DType, ModelSpec, TrainSpec


def tp_replica_sync_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec, sp: Spans,
                      layers: int) -> float:
    """Parameters every TP rank holds whole but trains on its own share: a mixture of experts
    (each TP rank routes its sequence shard; a shared expert the framework splits over TP is not
    among them, params.moe_tp_replicated_params), per-head Q/K norms (each rank's heads) and, under
    sequence parallelism, latent attention's down-projections (each rank's sequence shard; Megatron
    all-reduces their gradients over TP as it does the norms'). Once the data-parallel reduction
    has left each rank its gradient shards (replicated ones over dp x cp, experts over edp x cp),
    they are all-reduced over TP before the optimizer step in one collective, exposed
    (runtime.job.sync_replicated_over_tp). Affine in the rank's layers."""
    mla = mla_down_params(model) if plan.sequence_parallel else 0
    if plan.tp == 1 or not (model.is_moe or model.qk_norm or mla):
        return 0.0
    # ZeRO-0 keeps whole gradients (FSDP2 over a unit shard axis: runtime.mesh.dp_mesh_for)
    sharded = plan.zero_stage > 0
    # experts folded over TP (params.folds_ep) are each on one TP rank: their gradient group
    # (expert_dp) holds every rank with the same experts, nothing left to sum over TP
    experts = 0 if folds_ep(plan, cluster.framework) else layer_expert_params(model, plan.ep, plan.etp)
    whole = moe_tp_replicated_params(model, cluster.framework.shared_expert_tp)
    shard = (whole + qk_norm_params(model) + mla) / (plan.zero_ranks if sharded else 1)
    if experts:
        shard += experts / (expert_dp(plan, cluster.framework) if sharded else 1)
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
    takes 26.6 ms a step of a 10.9M-parameter fp32 model's 8 micro-batches (`python
    benchmarks/step_trace.py PLAN --steps 2 --rows 400 --shapes` on benchmarks/closed_loop.py's
    one-rank micro-batch-1 fp32 plan).
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
