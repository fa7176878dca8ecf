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

from dataclasses import replace

from costmodel.hardware import ClusterSpec
from costmodel.plan import Plan
from costmodel.rank_time.times import RankTimeModel, RankTimes, _rank_times


def unpaired_share(plan: Plan) -> float:
    """The share of a rank's layer passes each way that run without a partner, on the first
    pipeline rank (the longest warmup)."""
    m, p, v = plan.num_micro_batches, plan.pp, plan.vpp
    unpaired = 1 if p == 1 else 2 * (p - 1) + (v - 1) * p + 1
    return min(1.0, unpaired / (m * v))


def overlapped_ep_s(ep_s: float, cover_s: float, unpaired: float, contention: float) -> float:
    """A layer's all-to-alls per micro-batch (`ep_s`, both ways) as the overlap runs them: whole
    in the `unpaired` share of passes; paired, hidden behind the partner's layer compute
    (`cover_s`) at `contention` a second, and what outlasts it exposed."""
    hidden = min(ep_s, cover_s)
    paired = (ep_s - hidden) + contention * hidden
    return unpaired * ep_s + (1.0 - unpaired) * paired


def with_ep_overlap(rtm: RankTimeModel, plan: Plan, cluster: ClusterSpec) -> RankTimeModel:
    """The rank's time model with its expert all-to-alls overlapped where the framework does
    (`ep_a2a_overlap`, EP > 1): every part's all-to-all time scaled as a layer's
    (overlapped_ep_s, its cover the layer's forward and backward compute)."""
    layer = rtm.per_layer
    if not (cluster.framework.ep_a2a_overlap and plan.ep > 1) or layer.ep_comm_s <= 0.0:
        return rtm
    contention = cluster.device.efficiency.comm_contention
    cover_s = layer.forward_s + layer.backward_s
    k = overlapped_ep_s(layer.ep_comm_s, cover_s, unpaired_share(plan), contention) / layer.ep_comm_s
    return replace(rtm, per_layer=_ep_scaled(layer, k), per_recomputed_layer=_ep_scaled(rtm.per_recomputed_layer, k),
                   first_edge=_ep_scaled(rtm.first_edge, k), last_edge=_ep_scaled(rtm.last_edge, k))


def _ep_scaled(times: RankTimes, k: float) -> RankTimes:
    return _rank_times(times.forward_s, times.backward_s, times.backward_weight_s, times.recompute_s,
                       times.tp_comm_s, times.cp_comm_s, times.pp_comm_s, times.ep_comm_s * k, times.offload_s)
