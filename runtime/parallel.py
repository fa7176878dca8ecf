"""Apply a plan to a model (or pipeline stage) with PyTorch-native parallelism.

The order is fixed and matters (torchtitan's): pipeline split (runtime.pipeline) -> tensor /
sequence parallel -> activation checkpointing -> FSDP2. Tensor parallelism must come before
checkpoint wrapping: `parallelize_module` finds submodules by name, a wrapper hides them, and
torch only warns that a plan key did not resolve while the numbers silently go wrong. Here that
warning is an error.

Data parallelism is FSDP2 `fully_shard` for every ZeRO stage (one mechanism, composes with TP
and pipelining; all match a single process, see shared/reference/torch-on-cpu-notes.md):
  ZeRO-3: shard parameters, gradients, optimizer states; reshard parameters after forward.
  ZeRO-2: same shards, but parameters stay unsharded from forward to backward.
  ZeRO-1: as ZeRO-2, and gradients accumulate unsharded over micro-batches, reduce-scattered
          once per step (Megatron-LM's distributed optimizer).
  ZeRO-0: replicate everything, all-reduce gradients once per step (DDP): FSDP2 over a
          (dp, 1) mesh, i.e. HSDP whose shard group has one member.
Hybrid sharding (Plan.dp_replicate = r > 1, ZeRO >= 1) is the same FSDP2 over a 2-D mesh: dp
cut into dp_out (r replicas, outer) and dp_in (the shard group, inner, with cp), so each
reduce-scatter inside the group is followed by an all-reduce over the replicas.
An FSDP unit is a layer under ZeRO-3 and expert parallelism; below ZeRO-3 it groups consecutive
layers up to a bucket's size (costmodel.fsdp_units.fsdp_unit_layers, Megatron-Core's DDP bucket),
from the last layer back, the first few (all of a stage's small layers) left to the stage's root
unit with the embedding and head: each unit is a collective, and a collective's latency, not its
bytes, decides the small models' steps.
Expert parallelism (Plan.ep) lays its groups out as costmodel.placement.expert_layout prices
them for the plan's framework: carved from data parallelism (ep consecutive dp ranks; the TP
ranks hold the mixture whole and sum its gradients over TP) or, where the framework folds EP
(Megatron-Core's MoE parallel folding), the ep innermost of the tp x cp x dp ranks, TP first;
under expert tensor parallelism (Plan.etp, folded only) the etp innermost ranks split each
expert's width and the EP group is the next ep (runtime.mesh lays the groups out). Each layer's
experts are a DTensor sharded on dim 0 over "ep" (torchtitan's layout) and on their width over
"etp", and FSDP2 shards them further over "edp" in a unit of their own; every EP and etp rank's tokens reach them through the
all-to-all and the gather, so their gradients are scaled (runtime.moe.Experts,
apply_expert_parallel) before FSDP2 averages them over edp.
Mixed precision follows the TrainSpec: parameters gathered in compute_dtype, gradients reduced
in grad_dtype, fp32 master weights and optimizer states (FSDP2 MixedPrecisionPolicy).
Offloaded states (Plan.offload_optimizer) are FSDP2's CPUOffloadPolicy on every unit: the fp32
shards and their gradients live in host memory (pinned on CUDA), copied in before each gather
and out after each reduce-scatter; the optimizer then steps on the host (runtime.train uses
torch's fused CPU AdamW for it).
"""
from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from costmodel.deepseek import dense_layer_model
from costmodel.fsdp_units import fsdp_unit_layers
from costmodel.layout import Style, dense_blocks
from costmodel.memory import runtime_wraps_in_fsdp
from costmodel.plan import Plan, Recompute
from costmodel.specs import DType, ModelSpec, TrainSpec
from runtime.latent_attention import HeadsInput, LatentAttention
from runtime.mesh import dp_mesh_for, expert_dp_mesh_for, sliced_mesh
from runtime.moe import Experts, MoE
from runtime.sequence_parallel import ColwiseWeights, GatheredColumns

TORCH_DTYPES = {DType.FP32: torch.float32, DType.BF16: torch.bfloat16, DType.FP16: torch.float16}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _layer_tp_plan(spec: ModelSpec, sp: bool) -> dict:
    """Column-parallel projections first, the row-parallel one last, per costmodel.layout. A
    mixture of experts is not split by the dense TP plan: under SP it takes this rank's sequence
    shard as a plain tensor and routes those tokens (Megatron-Core's MoELayer refuses TP without
    SP in training, as costmodel.check_degrees.moe_tp_problem does), its router and shared expert whole
    on every TP rank (their gradients summed over TP: sync_replicated_over_tp), its routed
    experts too unless EP or expert TP folds over TP (apply_expert_parallel splits them). Latent
    attention's down-projections (replicated) stay whole; its column-parallel projections only
    have their weights sharded, the block gathering their input itself (runtime.latent_attention)."""
    out = Shard(1) if sp else Replicate()
    plan: dict = {}
    if spec.is_moe:
        plan["mlp_norm"] = SequenceParallel()
        plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                         use_local_output=True)
    # under SP a block takes its sequence shard as a plain tensor and gathers it itself
    # (runtime.sequence_parallel: Megatron's saved shard, gathered again in backward)
    colwise = ColwiseWeights if sp else ColwiseParallel
    for block in dense_blocks(spec):
        prefix = "attention" if block.name == "attention" else "mlp"
        if sp:
            if not (prefix == "mlp" and spec.shared_norm):   # one norm for both blocks
                plan[f"{prefix}_norm"] = SequenceParallel()
            plan[prefix] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
        for lin in block.linears:
            if lin.style is Style.COLWISE:
                plan[f"{prefix}.{lin.name}"] = ColwiseWeights() if spec.is_mla and prefix == "attention" else colwise()
            elif lin.style is Style.ROWWISE:
                plan[f"{prefix}.{lin.name}"] = RowwiseParallel(output_layouts=out)
    return plan


def _layer_spec(spec: ModelSpec, layer: nn.Module) -> ModelSpec:
    """The model a layer is built as: DeepSeek's dense first layers are dense_layer_model's."""
    return spec if isinstance(layer.mlp, MoE) or not spec.is_moe else dense_layer_model(spec)


def apply_tensor_parallel(stage: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> None:
    """Megatron-style TP (and SP: norms and dropout on sequence shards) on one stage module."""
    top: dict = {}
    embed = stage.embed
    if embed is not None:
        seq_shard_now = sp and embed.pos is None
        top["embed.tok"] = RowwiseParallel(input_layouts=Replicate(),
                                           output_layouts=Shard(1) if seq_shard_now else Replicate())
        if sp and embed.pos is not None:  # add positions first, then take this rank's sequence shard
            top["embed"] = PrepareModuleOutput(output_layouts=Replicate(),
                                               desired_output_layouts=Shard(1))
    if stage.norm is not None:
        if sp:
            top["norm"] = SequenceParallel()
        top["output"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                        output_layouts=Replicate())
    tied = embed is not None and stage.output is not None and stage.output.weight is embed.tok.weight
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Parallelize plan key.*")
        parallelize_module(stage, tp_mesh, top)
        for layer in stage.layers.values():
            parallelize_module(layer, tp_mesh, _layer_tp_plan(_layer_spec(stage.spec, layer), sp))
            for block in dense_block_modules(layer):
                if isinstance(block, LatentAttention):
                    block.heads_in = HeadsInput(tp_mesh.get_group(), sp)
                elif sp:
                    block.project_in = GatheredColumns(tp_mesh.get_group())
    if tied:  # both sides shard the vocab dim alike; keep them one parameter
        stage.output.weight = stage.embed.tok.weight


def dense_block_modules(layer: nn.Module) -> list[nn.Module]:
    """A layer's tensor-parallel blocks: its attention, and its MLP unless it is a mixture."""
    return [layer.attention] + ([] if isinstance(layer.mlp, MoE) else [layer.mlp])


def recomputed_layers(plan: Plan, pp_rank: int, layer_ids: list[int]) -> list[int]:
    """The first `recompute_num_layers[r]` layers of pipeline rank r, in model order."""
    if plan.recompute is Recompute.NONE:
        return []
    return sorted(layer_ids)[:plan.recompute_num_layers[pp_rank]]


def apply_recompute(stage: nn.Module, plan: Plan, layer_ids: list[int]) -> None:
    """Full: checkpoint the whole layer (only its input is kept). Selective: the attention core."""
    for i in layer_ids:
        key = str(i)
        if key not in stage.layers:
            continue
        if plan.recompute is Recompute.FULL:
            stage.layers[key] = checkpoint_wrapper(stage.layers[key], preserve_rng_state=True)
        else:
            stage.layers[key].attention.selective_recompute = True


def _expert_shard_dim(group: int):
    """FSDP2 shards dim 0 by default, padding it to a multiple of the group: with fewer local
    experts than ranks holding them (Mixtral's 8 experts over ep8: one each) every rank would
    keep a whole padded expert. Then shard each expert's rows instead (torchtitan does the same),
    so that a rank keeps 1/group of its experts, as costmodel.memory counts."""

    def placement(param: nn.Parameter) -> Shard:
        return Shard(0) if local_tensor(param).shape[0] % group == 0 else Shard(1)
    return placement


def apply_expert_parallel(stage: nn.Module, mesh: DeviceMesh, plan: Plan) -> None:
    """Keep this rank's num_experts/ep experts of every layer (the model was initialised whole,
    so each rank's slice equals the single process's), each split over the etp ranks under expert
    tensor parallelism (Plan.etp): the gate and up projections' rows and the down projection's
    columns, this rank's 1/etp of the expert's width (column- then row-parallel, as
    Megatron-Core's TEGroupedMLP over its expert-TP group). They are a DTensor sharded on dim 0
    over "ep" and on the width over "etp" (runtime.mesh.build_mesh), so DCP reshards them between layouts.
    Each mixture gets the groups its all-to-alls and its row gather run over (runtime.moe).

    Every EP rank's tokens reach an expert through the all-to-all (and every etp rank's through
    the gather), so its gradient sums theirs, and FSDP2 averages it over the edp ranks holding the
    same expert shards. The mean over the dp x cp replicas, as for every other weight, is that
    times edp/(dp x cp): 1/ep where EP is carved from dp (each TP rank's sum then added by
    runtime.job.sync_replicated_over_tp), tp/(etp x ep) where it folds over tp x cp x dp (the
    experts are left out of that TP sum: the edp group holds every rank with the same shards)."""
    ep, etp = plan.ep, plan.etp
    if ep * etp == 1:
        return
    dims = (["ep"] if ep > 1 else []) + (["etp"] if etp > 1 else [])
    experts_mesh = sliced_mesh(mesh, *dims)
    ep_index = sliced_mesh(mesh, "ep").get_local_rank() if ep > 1 else 0
    etp_index = sliced_mesh(mesh, "etp").get_local_rank() if etp > 1 else 0
    for moe in (m for m in stage.modules() if isinstance(m, MoE)):
        local = moe.num_experts // ep
        for name, full in list(moe.experts.named_parameters(recurse=False)):
            width = Experts.WIDTH_DIM[name]
            part = full.detach()[ep_index * local:(ep_index + 1) * local]
            step = part.shape[width] // etp
            part = part.narrow(width, etp_index * step, step).clone()
            placements = ([Shard(0)] if ep > 1 else []) + ([Shard(width)] if etp > 1 else [])
            # the whole tensor's shape and strides given: inferred from the shard, a second
            # sharded dim would scale the expert dim's stride twice (not contiguous for FSDP2)
            setattr(moe.experts, name, nn.Parameter(DTensor.from_local(
                part, experts_mesh, placements, run_check=False, shape=full.shape, stride=full.stride())))
        if ep > 1:
            moe.ep_group, moe.ep = sliced_mesh(mesh, "ep").get_group(), ep
        if etp > 1:
            moe.etp_group, moe.etp = sliced_mesh(mesh, "etp").get_group(), etp
        moe.experts.grad_scale = sliced_mesh(mesh, "edp").size() / (plan.dp * plan.cp)


def apply_data_parallel(stage: nn.Module, mesh: DeviceMesh, plan: Plan, train: TrainSpec) -> None:
    """FSDP2 per layer, then the stage root (which holds embedding, final norm and head). With
    one data-parallel replica, no tensor parallelism and fp32 there is nothing for FSDP to do,
    and its hooks and copies would only cost time: the stage stays plain. (Under TP, FSDP also
    makes every parameter a DTensor, which the optimizers' foreach kernels need.)"""
    if not runtime_wraps_in_fsdp(plan, train):   # the cost model prices the wrapping by the same rule
        return
    mp = MixedPrecisionPolicy()
    if train.compute_dtype is not DType.FP32:
        mp = MixedPrecisionPolicy(param_dtype=TORCH_DTYPES[train.compute_dtype],
                                  reduce_dtype=TORCH_DTYPES[train.grad_dtype])
    if plan.tp > 1:
        # TP hands the stage's output over as DTensor.to_local()'s view, on which FSDP2 warns (once
        # per rank, in run.log) that an in-place op would drop its backward hook: nothing writes a
        # stage's output in place (the loss and the pipeline's send read it), and the parity tests
        # prove the gradients of TP under every ZeRO stage
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    dp_mesh = dp_mesh_for(mesh, plan)
    reshard = plan.zero_stage == 3
    offload = (CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if plan.offload_optimizer
               else OffloadPolicy())
    for layer in stage.layers.values():
        if plan.ep * plan.etp > 1:   # the experts first: a unit of their own over the edp ranks
            for experts in (m for m in layer.modules() if isinstance(m, Experts)):
                fully_shard(experts, mesh=expert_dp_mesh_for(mesh, plan), reshard_after_forward=reshard,
                            mp_policy=mp, offload_policy=offload,
                            shard_placement_fn=_expert_shard_dim(sliced_mesh(mesh, "edp").size()))
    shard_layer_units(list(stage.layers.values()), fsdp_unit_layers(stage.spec, plan), mesh=dp_mesh,
                      reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp, offload_policy=offload)


def fsdp_units(layers: list[nn.Module], per_unit: int) -> list[list[nn.Module]]:
    """A stage's layers as FSDP units: one each (per_unit 1, FSDP's per-block wrapping), or
    units of `per_unit` consecutive layers from the last (backward reaches those first, so their
    reductions start earliest), the first len % per_unit layers, or all of them when there are no
    more than `per_unit`, left to the stage's root unit, whose reduction comes last anyway."""
    if per_unit == 1:
        return [[layer] for layer in layers]
    if len(layers) <= per_unit:
        return []
    first = len(layers) % per_unit
    return [layers[i:i + per_unit] for i in range(first, len(layers), per_unit)]


def shard_layer_units(layers: list[nn.Module], per_unit: int, **fsdp) -> None:
    """`fully_shard(**fsdp)` on each of fsdp_units(layers, per_unit): a unit of one layer is the
    layer itself, one of several their list; the caller shards the root after."""
    for unit in fsdp_units(layers, per_unit):
        fully_shard(unit[0] if len(unit) == 1 else unit, **fsdp)


def gradient_sync_every_micro_batch(plan: Plan) -> bool:
    """ZeRO-2/3 reduce-scatter after each micro-batch (sharded gradient accumulation); ZeRO-0/1
    accumulate full gradients and reduce once per step."""
    return plan.zero_stage >= 2
