"""One rank's share of a plan: mesh coordinates, stage modules, optimizer, schedule.

Built in the documented order (runtime.parallel): model on the meta device -> pruned to this
rank's pipeline stages -> materialised and initialised deterministically -> tensor/sequence
parallel -> activation checkpointing -> FSDP2. The same builder serves `planner run` (real
process group) and `--dry-run` (fake process group, parameters left on the meta device).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from costmodel.check_degrees import moe_tp_problem
from costmodel.groups import replica_samples
from costmodel.inputs import UserError
from costmodel.plan import Plan, PlanFile
from costmodel.specs import ModelSpec, RouterScoring
from runtime.compile import apply_compile, compile_problem
from runtime.context_parallel import CpShard
from runtime.float8 import apply_float8
from runtime.latent_attention import LatentAttention
from runtime.mesh import build_mesh, in_root_order, mesh_coords
from runtime.model import Transformer
from runtime.moe import MoE
from runtime.mtp import MtpHead, mtp_tensor_parallel
from runtime.offload import apply_activation_offload
from runtime.parallel import (
    apply_data_parallel,
    apply_expert_parallel,
    apply_recompute,
    apply_tensor_parallel,
    local_tensor,
    recomputed_layers,
)
from runtime.pipeline import StepClock, build_schedule, local_stages, stage_layer_ids


@dataclass(kw_only=True)
class Job:
    plan: Plan
    mesh: DeviceMesh
    device: torch.device
    coords: dict[str, int]
    modules: dict[int, nn.Module]          # virtual stage -> its module on this rank
    schedule: object | None = None         # torch pipelining schedule when pp > 1
    tied_params: list[nn.Parameter] = field(default_factory=list)
    tied_group: object | None = None       # ranks holding the two copies of a tied embedding
    # the last stage's copy of the embedding (a tied output layer's, or the one MTP reads) on this rank
    embedding_copy: nn.Parameter | None = None
    clock: StepClock = field(default_factory=StepClock)   # this rank's split of the current step
    cp: CpShard | None = None              # context parallelism: this rank's chunks of each sequence
    tp_replicated: list[nn.Parameter] = field(default_factory=list)   # whole on each TP rank, trained on its share
    stage_group: object | None = None      # the ranks holding this rank's layers, where routers count (None: all)
    # sequences each data-parallel replica trains on per step when they differ (replicas on
    # device groups, costmodel.groups.replica_samples); () when every replica takes an equal share
    samples: tuple[int, ...] = ()

    @property
    def loss_weight(self) -> float:
        """This replica's loss weight: FSDP2 averages gradients over the replicas, so a replica
        of s of the batch's S sequences scales its mean loss by dp·s/S (1 when shares are equal):
        the average is then the mean over every sequence of the global batch."""
        if not self.samples:
            return 1.0
        return self.plan.dp * self.samples[self.coords["dp"]] / sum(self.samples)

    @property
    def num_stages(self) -> int:
        return self.plan.num_virtual_stages

    @property
    def holds_loss(self) -> bool:
        """The ranks of the last stage with TP rank 0 report the loss: one per replica and CP rank
        (each CP rank's loss is the mean over as many tokens of the same sequences)."""
        return (self.num_stages - 1) in self.modules and self.coords["tp"] == 0

    def local_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """(batch, seq) of whole sequences -> the part this rank trains on (its CP chunks)."""
        return tokens if self.cp is None else self.cp.local(tokens, dim=1)

    def parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for mod in self.modules.values():
            for p in mod.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean over the micro-batch's tokens, in fp32 (Megatron's cross entropy works in fp32)."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(0, 1))


def build_job(pf: PlanFile, device: torch.device, *, seed: int, materialize: bool = True,
              before_data_parallel=None, compile: bool = False) -> Job:
    """`before_data_parallel(stage, module)`, if given, sees each stage module after tensor
    parallelism and before FSDP2 (the dry run counts unsharded parameters there); `compile`:
    each layer's forward through torch.compile (runtime.compile), after checkpointing."""
    plan, model = pf.plan, pf.model
    if problem := moe_tp_problem(model, plan.tp, plan.sequence_parallel):   # even for an unchecked plan
        raise UserError(f"model {model.name}: {problem}")
    if compile and (problem := compile_problem(plan)):
        raise UserError(problem)
    fold = pf.cluster.framework.ep_folds_over_tp   # EP laid out as the plan's framework does
    mesh = build_mesh(plan, device.type, fold)
    coords = mesh_coords(mesh, plan)
    cp = CpShard(coords["cp"], plan.cp, mesh["cp"].get_group()) if plan.cp > 1 else None
    layer_ids = stage_layer_ids(plan)
    mine = local_stages(plan, coords["pp"])
    rc_layers = recomputed_layers(plan, coords["pp"], [i for j in mine for i in layer_ids[j]])
    modules = {}
    for j in mine:
        with torch.device("meta"):
            mod = Transformer(model, pf.train.attention_kernel)
        mod.keep_only(layer_ids[j], first=j == 0, last=j == plan.num_virtual_stages - 1)
        if materialize:
            mod.materialize(device, seed)
        if cp is not None:
            mod.set_context_parallel(cp, pf.train.seq_len)
        _scale_aux_losses(mod, plan, _token_group(mesh, plan, cp))
        apply_expert_parallel(mod, mesh, plan)
        if plan.fp8_linears:   # torchao swaps the modules: before TP, checkpointing and FSDP2 see them
            apply_float8(mod, compile=device.type == "cuda" and materialize)
        if plan.offload_activations:
            apply_activation_offload(mod, pin=device.type == "cuda")
        if plan.tp > 1:
            apply_tensor_parallel(mod, mesh["tp"], plan.sequence_parallel)
            mtp_tensor_parallel(mod, mesh["tp"], plan.sequence_parallel)
        apply_recompute(mod, plan, rc_layers)
        if compile:
            apply_compile(mod, plan)
        if before_data_parallel is not None:
            before_data_parallel(j, mod)
        apply_data_parallel(mod, mesh, plan, pf.train)
        modules[j] = mod
    experts_over_tp = not (fold and plan.ep * plan.etp > 1)   # folded: the experts' own group sums them
    job = Job(plan=plan, mesh=mesh, device=device, coords=coords, modules=modules, cp=cp,
              tp_replicated=_tp_replicated(modules, plan.sequence_parallel, experts_over_tp)
              if plan.tp > 1 else [],
              # every rank makes the groups (new_group is collective), whether its layers route or not
              stage_group=_stage_group(mesh, plan) if materialize and _balancing_biases_in(model) else None,
              samples=tuple(replica_samples(plan, pf.cluster)) if plan.micro_batch_sizes else ())
    _tie_embeddings(job, pf)
    for mod in modules.values():   # the MTP loss's gradient weighs as the main loss of a micro-batch does
        mod.mtp_grad_scale = 1.0 if plan.pp > 1 else job.loss_weight / plan.num_micro_batches
    if plan.pp > 1 and materialize:
        job.schedule = build_schedule(plan, modules, mesh["pp"].get_group(), device, cross_entropy, job.clock)
    return job


def _tp_replicated(modules: dict, sequence_parallel: bool, experts_over_tp: bool = True) -> list[nn.Parameter]:
    """Parameters whole on every TP rank that each rank trains on its own share: a mixture of
    experts (its sequence shard; its routed experts only where `experts_over_tp`, not where EP
    folds over TP and their own gradient group sums them: runtime.parallel.apply_expert_parallel),
    Qwen3's per-head Q/K norms (its heads) and, under sequence parallelism, latent attention's
    down-projections and latent norms and the MTP modules' norms (its sequence shard)."""
    out = []
    for mod in modules.values():
        for sub in mod.modules():
            if isinstance(sub, MoE):
                routed = set(map(id, sub.experts.parameters()))
                out += [p for p in sub.parameters() if experts_over_tp or id(p) not in routed]
            elif isinstance(sub, LatentAttention):
                out += sub.down_parameters() if sequence_parallel else []
            elif isinstance(sub, MtpHead):
                out += sub.norm_parameters() if sequence_parallel else []
            elif getattr(sub, "qk_norm", False):
                out += [*sub.q_norm.parameters(), *sub.k_norm.parameters()]
    return out


def _balancing_biases_in(model: ModelSpec) -> bool:
    """Whether the model's mixtures route by sigmoid scores and a balancing bias (runtime.moe)."""
    return model.is_moe and model.router_scoring is RouterScoring.SIGMOID


def _balancing_biases(modules: dict) -> list[MoE]:
    """This rank's mixtures routed by sigmoid scores and a balancing bias, in model order."""
    return [m for mod in modules.values() for m in mod.modules() if isinstance(m, MoE) and m.sigmoid]


def _stage_group(mesh: DeviceMesh, plan: Plan):
    """The ranks holding this rank's layers (all but other pipeline ranks; None: the world)."""
    if plan.pp == 1:
        return None
    ranks = mesh.mesh.movedim(mesh.mesh_dim_names.index("pp"), 0).reshape(plan.pp, -1)
    mine = None
    for row in ranks.tolist():   # every rank creates every group, in the same order
        group = dist.new_group(row)
        mine = group if dist.get_rank() in row else mine
    return mine


def update_balancing_biases(job: Job, step_taken: bool) -> None:
    """DeepSeek-V3's step-end bias update (runtime.moe.MoE.update_bias) from the step's routed
    slots per expert over the whole batch: this rank's counts summed over the ranks holding the
    same layers (data, expert, context and sequence-parallel shares), one all-reduce. A skipped
    step (runtime.health) moves no bias."""
    routers = _balancing_biases(job.modules)
    if not routers:
        return
    counts = torch.cat([m.routed_counts for m in routers])
    dist.all_reduce(counts, group=job.stage_group)
    for moe, total in zip(routers, counts.split([moe.num_experts for moe in routers])):
        if step_taken:
            moe.update_bias(total)
        moe.routed_counts.zero_()


def _token_group(mesh: DeviceMesh, plan: Plan, cp: CpShard | None):
    """The ranks a micro-batch's tokens are split over at the experts: CP's chunks, and under
    sequence parallelism the TP ranks' shards (None: this rank has them all)."""
    if plan.tp > 1 and plan.cp > 1:
        return mesh[in_root_order(mesh, "cp", "tp")]._flatten("cp_tp").get_group()   # any mesh order
    if plan.tp > 1:
        return mesh["tp"].get_group()
    return cp.group if cp is not None else None


def _scale_aux_losses(module: nn.Module, plan: Plan, token_group) -> None:
    """A mixture's load-balancing gradient gets the factor the step gives each micro-batch's
    loss: 1/m where the step divides the loss itself; 1 under pipelining, whose schedule divides
    every gradient by m at the end (torch's scale_grads). Under context parallelism each rank's
    share of the micro-batch's loss (runtime.moe.load_balancing_loss) is summed, not averaged,
    over the CP ranks, while data parallelism averages gradients over dp x cp: times cp (over
    TP ranks the mixture's gradients are summed: sync_replicated_over_tp)."""
    scale = (1.0 if plan.pp > 1 else 1.0 / plan.num_micro_batches) * plan.cp
    for sub in module.modules():
        if isinstance(sub, MoE):
            sub.aux_grad_scale = scale
            sub.token_group = token_group


def _tie_embeddings(job: Job, pf: PlanFile) -> None:
    """An embedding the last stage reads too (a tied output layer, the MTP modules' input) has two
    copies once split over stages, kept equal by summing their gradients over the ranks that
    hold them (Megatron-LM's embedding group), once per step."""
    last = job.num_stages - 1
    if not (pf.model.tied_embeddings or pf.model.mtp_depth) or last == 0:
        return
    if 0 in job.modules:
        job.tied_params.append(job.modules[0].embed.tok.weight)
    if last in job.modules:
        stage = job.modules[last]
        job.embedding_copy = stage.output.weight if pf.model.tied_embeddings else stage.embed.tok.weight
        job.tied_params.append(job.embedding_copy)
    first_rank, last_rank = job.plan.stage_rank(0), job.plan.stage_rank(last)
    if first_rank == last_rank:
        return
    pp_dim = job.mesh.mesh_dim_names.index("pp")   # the world mesh's dim (EP may cut others in two)
    ranks = job.mesh.mesh.movedim(pp_dim, -1).reshape(-1, job.plan.pp)
    for row in ranks.tolist():   # every rank creates every group, in the same order
        group = dist.new_group([row[first_rank], row[last_rank]])
        if dist.get_rank() in (row[first_rank], row[last_rank]):
            job.tied_group = group


def sync_replicated_over_tp(job: Job) -> None:
    """Parameters whole on every TP rank, each of which trained them on its share (a mixture on
    its sequence shard, Q/K norms on its heads): sum their gradients (after FSDP2 has reduced
    them over dp, shard by shard, the same shards on every TP rank)."""
    if job.plan.tp == 1 or not job.tp_replicated:
        return
    group = job.mesh["tp"].get_group()
    grads = [local_tensor(p.grad) for p in job.tp_replicated if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():   # one all-reduce per dtype, as costmodel prices it (not one per tensor)
        # offloaded gradients live on the host: the collective runs on the device (NCCL)
        flat = torch.cat([g.reshape(-1) for g in same]).to(job.device)
        dist.all_reduce(flat, group=group)
        for g, part in zip(same, flat.split([g.numel() for g in same])):
            g.copy_(part.view_as(g))


def sync_tied_embedding(job: Job) -> None:
    if not job.tied_params:
        return
    grads = [local_tensor(p.grad) for p in job.tied_params]
    # on the device even when offloaded gradients live on the host (NCCL needs it)
    total = (grads[0].clone() if len(grads) == 1 else grads[0] + grads[1]).to(job.device)
    if job.tied_group is not None:
        dist.all_reduce(total, group=job.tied_group)
    for g in grads:
        g.copy_(total)
