"""Per virtual stage costs for the simulator, from the same formulas that price whole ranks.

A rank's micro-batch time is affine in its layers (costmodel.rank_time.RankTimeModel), so a stage
of L_j layers (R_j recomputed, with the embedding on stage 0 and the LM head on the last) costs
the model evaluated at (L_j, R_j), without the rank's point-to-point term: the simulator charges
transfers itself, per boundary. Tensor- and context-parallel communication sits on the critical
path inside forward, recompute and backward (in proportion to their compute); the
backward-for-weights part needs none.
"""
from __future__ import annotations

from costmodel.groups import rank_views
from costmodel.hardware import ClusterSpec
from costmodel.memory import (
    edge_weight_grad_output_bytes,
    micro_batch_activation_bytes,
    send_bytes,
    weight_grad_input_bytes,
    weight_grad_output_bytes,
)
from costmodel.params import dense_layers_by_stage
from costmodel.pipeline_simulation import StageCost
from costmodel.plan import Plan
from costmodel.rank_time import RankTimeModel, rank_time_model, spans
from costmodel.specs import ModelSpec, TrainSpec


def stage_costs(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                rtm: RankTimeModel | None = None) -> list[StageCost]:
    """`rtm`: the plan's rank time model when the caller has it (a uniform cluster only: on a
    mixed one each rank has its group's, costmodel.groups)."""
    sp = spans(plan, cluster)
    if cluster.is_mixed:
        views = rank_views(plan, cluster)
        models = {view: rank_time_model(model, train, plan, view, sp) for view in set(views)}
        rtms = [models[view] for view in views]
    else:
        rtms = [rtm or rank_time_model(model, train, plan, cluster, sp)] * plan.pp
    # the sends each rank waits for at this plan's micro-batches (RankTimeModel.send_share)
    rtms = [r.with_schedule(plan.vpp, plan.num_micro_batches) for r in rtms]
    n = plan.num_virtual_stages
    defers = plan.schedule.defers_weight_grad
    # torch pipelining keeps a deferred weight pass's whole graph (costmodel.frameworks)
    keeps_graph = defers and cluster.framework.deferred_w_keeps_graph
    w_inputs = weight_grad_input_bytes(model, train, plan, cluster.framework) if defers else 0.0

    def kept_grads(layers: int, first: bool, last: bool) -> float:
        # torch skips the first stage's input pass (no input needs a gradient) and runs its whole
        # backward in the weight slot: the graph waits, no output gradients are captured
        if first:
            return 0.0
        return (weight_grad_output_bytes(model, train, plan, cluster.framework) * layers
                + edge_weight_grad_output_bytes(model, train, plan, first, last))

    # torch's multi-stage runner keeps every send until the step ends (costmodel.frameworks)
    sent_held = send_bytes(model, train, plan) if (
        plan.schedule.traits.multi_stage and cluster.framework.pipeline_sends_held) else 0.0
    out = []
    recomputed = plan.recompute_per_stage(cluster.framework.recompute_placement)
    sends = _boundary_sends(plan, rtms)
    dense = dense_layers_by_stage(model, plan)
    for j, (layers, rc) in enumerate(zip(plan.layers_per_stage, recomputed)):
        first, last = j == 0, j == n - 1
        rtm = rtms[plan.stage_rank(j)]
        send_s, send_back_s = sends[j]
        t = rtm.at(layers, rc, first, last, dense[j])
        compute = t.forward_s + t.backward_s + t.recompute_s
        comm = t.tp_comm_s + t.cp_comm_s + t.ep_comm_s + t.offload_s
        share = comm / compute if compute else 0.0
        held, transient = micro_batch_activation_bytes(model, train, plan, layers, rc, first, last,
                                                         cluster.framework, dense[j])
        backward_s = t.backward_s * (1 + share)
        # torch's first stage runs its whole backward in the weight slot (kept_grads)
        weight_s = backward_s if keeps_graph and first else t.backward_weight_s
        out.append(StageCost(forward_s=t.forward_s * (1 + share), recompute_s=t.recompute_s * (1 + share),
                             backward_s=backward_s, backward_weight_s=weight_s, send_s=send_s,
                             send_back_s=send_back_s,
                             activation_bytes=held, transient_bytes=transient,
                             weight_input_bytes=held + kept_grads(layers, first, last) if keeps_graph
                             else w_inputs * layers, sent_held_bytes=sent_held))
    return out


def _boundary_sends(plan: Plan, rtms: list[RankTimeModel]) -> list[tuple[float, float]]:
    """Per virtual stage, (its output to the next stage's rank, its input's gradient to the
    previous stage's rank), each on its own link (RankTimeModel.sends_s: NVLink where the two
    ranks share a node). A V placement (ZBV, DualPipeV) sends its second chunk's outputs to the
    previous rank; two stages on one rank send nothing (the simulation's own rule)."""
    n, p = plan.num_virtual_stages, plan.pp
    if p == 1:
        return [(0.0, 0.0)] * n
    ranks = [plan.stage_rank(j) for j in range(n)]

    def to(j: int, k: int) -> float:
        if not 0 <= k < n or ranks[k] == ranks[j]:
            return 0.0
        r = ranks[j]
        send = rtms[r].sends_s[r][0 if ranks[k] == (r + 1) % p else 1]
        # an input's gradient: the share of it the step pays (RankTimeModel.send_share)
        return send if k == j + 1 else rtms[r].send_share * send
    return [(to(j, j + 1), to(j, j - 1)) for j in range(n)]
