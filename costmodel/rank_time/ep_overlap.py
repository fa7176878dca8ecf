"""Megatron-Core's expert all-to-all overlap (`--overlap-moe-expert-parallel-comm`,
FrameworkTraits.ep_a2a_overlap).

Each steady-state step of its schedule pairs one micro-batch's forward with another's backward,
layer by layer (TransformerLayerSchedulePlan.run): the backward's combine runs under the
forward's attention, the forward's dispatch under the backward's expert GEMMs, the backward's
dispatch under the forward's experts and the forward's combine under the backward's attention,
each all-to-all on its own stream. A hidden all-to-all costs the device's `comm_contention` per
second, as a hidden DP or TP collective does; what outlasts the compute it hides behind is
exposed. The warmup forwards and the cooldown backwards have no partner and run theirs alone:
one forward and one backward where pp = 1 (combined_1f1b.py), and on an interleaved pipeline's
first rank 2(p - 1) + (v - 1)p + 1 virtual micro-batches each way (schedules.py: one more than
interleaved 1F1B's warmup, so that every steady step's two halves are independent).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from costmodel.hardware import ClusterSpec
from costmodel.plan import Plan, Recompute
from costmodel.rank_time.contention import partly_hidden_cost
from costmodel.schedules import interleaved_warmup_chunks
from costmodel.specs import DType, ModelSpec

if TYPE_CHECKING:   # costmodel.rank_time.times applies the factor (and imports this module)
    from costmodel.rank_time.times import RankTimes


def unpaired_share(plan: Plan) -> float:
    """The share of a rank's layer passes each way that run without a partner, on the first
    pipeline rank (the longest warmup)."""
    m, p, v = plan.num_micro_batches, plan.pp, plan.vpp
    unpaired = 1 if p == 1 else interleaved_warmup_chunks(p, v, 0)
    return min(1.0, unpaired / (m * v))


def overlapped_ep_s(ep_s: float, cover_s: float, unpaired: float, contention: float) -> float:
    """A layer's all-to-alls per micro-batch (`ep_s`, both ways) as the overlap runs them: whole
    in the `unpaired` share of passes; paired, hidden behind the partner's layer compute
    (`cover_s`) at `contention` a second, and what outlasts it exposed."""
    hidden = min(ep_s, cover_s)
    paired = ep_s * partly_hidden_cost((ep_s - hidden) / ep_s, contention) if ep_s > 0 else 0.0
    return unpaired * ep_s + (1.0 - unpaired) * paired


def ep_overlap_factor(layer: "RankTimes", plan: Plan, cluster: ClusterSpec) -> float:
    """What the rank's expert all-to-all time is multiplied by where the framework overlaps it
    (`ep_a2a_overlap`, EP > 1): a layer's (`layer`: its per-micro-batch times) as
    overlapped_ep_s runs it, its cover the layer's forward and backward compute; 1 elsewhere."""
    return _factor(layer, plan.ep, cluster, unpaired_share(plan))


def ep_overlap_floor_factor(layer: "RankTimes", ep: int, cluster: ClusterSpec) -> float:
    """ep_overlap_factor's least over every schedule and micro-batch count (no pass unpaired: the
    factor grows with their share), what a lower bound over plans the search has not fixed reads."""
    return _factor(layer, ep, cluster, 0.0)


def _factor(layer: "RankTimes", ep: int, cluster: ClusterSpec, unpaired: float) -> float:
    if not (cluster.framework.ep_a2a_overlap and ep > 1) or layer.ep_comm_s <= 0.0:
        return 1.0
    contention = cluster.device.efficiency.comm_contention
    cover_s = layer.forward_s + layer.backward_s
    return overlapped_ep_s(layer.ep_comm_s, cover_s, unpaired, contention) / layer.ep_comm_s


def model_overlap_problems(model: ModelSpec, compute_dtype: DType) -> list[str]:
    """Why Megatron-Core would refuse its expert all-to-all overlap on this model and compute dtype
    whatever the layout (TransformerConfig.__post_init__'s checks of
    `overlap_moe_expert_parallel_comm`, Megatron-LM d98e8a64)."""
    out = []
    if not model.is_moe:
        out.append(f"needs a mixture of experts, and {model.name} is dense")
    if model.mtp_depth > 1:
        out.append(f"takes one multi-token prediction layer at most ({model.name} has {model.mtp_depth})")
    if compute_dtype not in (DType.BF16, DType.FP16):
        out.append(f"needs bf16 or fp16 compute (got {compute_dtype.value})")
    return out


def overlap_problems(model: ModelSpec, compute_dtype: DType, *, ep: int, full_recompute: bool, pp: int,
                     vpp: int) -> list[str]:
    """model_overlap_problems, and the checks of the same TransformerConfig that a plan decides.
    The token dispatcher is alltoall or flex in every plan the model prices; the shared expert's
    own overlap is never turned on."""
    out = model_overlap_problems(model, compute_dtype)
    if ep < 2:
        out.append("needs expert parallelism (ep of 2 or more)")
    if full_recompute:
        out.append("runs without full recomputation (Megatron-Core refuses the two together)")
    if pp > 1 and vpp < 2:
        out.append("needs an interleaved pipeline (vpp of 2 or more) where pp > 1, as Megatron-Core does")
    if model.mtp_depth and pp == 1:
        out.append("needs a pipeline (pp of 2 or more) beside a multi-token prediction layer, as Megatron-Core does")
    return out


def plan_overlap_problems(model: ModelSpec, compute_dtype: DType, plan: Plan) -> list[str]:
    """overlap_problems of a whole plan."""
    return overlap_problems(model, compute_dtype, ep=plan.ep, full_recompute=plan.recompute is Recompute.FULL,
                            pp=plan.pp, vpp=plan.vpp)
