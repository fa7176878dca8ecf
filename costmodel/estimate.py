"""`estimate(model, train, cluster, plan) -> Estimate`: the ledger of one optimizer step.

The pipeline phase is simulated event by event (costmodel.pipeline_simulation, in torch's operation order).
The step time is a sum of ledger items under hierarchical keys (a test checks the sum): the
critical pipeline rank's (the busiest in the simulation) work over all micro-batches, split into
compute and the communication on its path, then its idle time in the pipeline (the bubble), then
what happens once per step (exposed data-parallel synchronisation, tied-embedding sync, the
gradient sync of parameters whole on every TP rank (a mixture, Q/K norms), optimizer), and the
gradient accumulation, on a plan of one data-parallel replica FSDP's one-rank reduce and
gathers, and with more replicas FSDP2's copies of what it gathers, which run inside the passes
but are booked once a step beside them (costmodel.rank_time.grad_accumulation_s,
one_replica_fsdp_s, dp_exposed_parts_s). Peak activation memory per rank is the simulated peak.

The closed forms of costmodel.pipeline_closed_form are kept beside it as `closed_form_step_time_s`: the
search optimises layer splits against them (they are affine enough for CP-SAT) and the tests use
them as an oracle (equal to the simulation on uniform stages).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

from costmodel.flops import executed_flops_per_step, model_flops_per_step, utilization
from costmodel.frameworks import RUNTIME, FrameworkTraits
from costmodel.groups import (
    group_plan,
    group_replicas,
    group_samples,
    group_train,
    places_replicas,
    rank_budgets_bytes,
    rank_groups,
    rank_views,
    replica_view,
    world_peak_flops_per_s,
)
from costmodel.hardware import ClusterSpec
from costmodel.memory import (
    StageMemory,
    backward_working_bytes,
    host_activation_bytes,
    host_state_bytes,
    overlap_warmup_bytes,
    rebuilt_layer_bytes,
    reserved_bytes,
    stage_memory,
)
from costmodel.params import ceil_div, rank_params
from costmodel.pipeline_closed_form import pipeline_time_s
from costmodel.pipeline_simulation import Simulation, simulate
from costmodel.plan import Plan
from costmodel.rank_time import (
    RankTimes,
    Spans,
    after_pipeline_s,
    dp_exposed_parts_s,
    grad_accumulation_s,
    one_replica_fsdp_parts_s,
    rank_times,
    spans,
    stage_pair_all_reduce_s,
)
from costmodel.selective_modules import priced_modules
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.stage_costs import stage_costs


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    model_flops: float
    executed_flops: float
    peak_memory_bytes: list[float]
    memory_capacity_bytes: float   # the least of memory_capacity_per_rank_bytes
    fits: bool
    # The bubble: a pipeline rank's idle time in the pipeline phase, as a share of the step. The
    # plan's is its critical rank's (the ledger's "pipeline/bubble" over the step time, so it adds
    # up with the other items); every report shows this one figure.
    bubble_fraction: float
    time_breakdown_s: dict[str, float]
    memory_breakdown_bytes: list[dict[str, float]]
    critical_rank: int
    rank_time_per_micro_batch_s: list[float] = field(default_factory=list)
    bubble_fraction_per_rank: list[float] = field(default_factory=list)   # the same, each rank's (simulated)
    # per pipeline rank, seconds per step of its own work: compute, the TP/CP collectives and
    # the gradient accumulation inside it (what the runtime times as a stage's busy time), FSDP's
    # one-rank gathers and, without a pipeline, its one-rank reduce, and FSDP2's copy-outs
    rank_work_s: list[float] = field(default_factory=list)
    # per pipeline rank, a pipeline's once-a-step one-rank FSDP reduce, which the runtime times
    # as the stage's DP sync (runtime.pipeline's perform_reduce_grad); 0 without a pipeline
    rank_fsdp_reduce_s: list[float] = field(default_factory=list)
    closed_form_step_time_s: float | None = None   # None: the schedule has no closed form (zbv)
    # offloaded states (Plan.offload_optimizer): host memory per device of each pipeline rank,
    # and what a device's share of its node's host may hold
    host_memory_bytes: list[float] = field(default_factory=list)
    host_capacity_bytes: float = 0.0
    # per pipeline rank: what its predicted total may reach (they differ on a mixed cluster, whose
    # groups have their own memory), and the device group it runs on (costmodel.groups; a uniform
    # cluster: all 0)
    memory_capacity_per_rank_bytes: list[float] = field(default_factory=list)
    rank_groups: list[int] = field(default_factory=list)
    # replicas placed on device groups (pp = 1 on a mixed cluster): per group, its replicas,
    # micro-batch size, samples per step, step time, peak memory and budget (rank_groups then
    # names the group whose memory the per-rank fields show)
    group_shares: list[dict[str, Any]] = field(default_factory=list)

    @property
    def max_peak_memory_bytes(self) -> float:
        return max(self.peak_memory_bytes)

    @property
    def capacity_per_rank_bytes(self) -> list[float]:
        """Each pipeline rank's budget (one value repeated on a uniform cluster)."""
        return self.memory_capacity_per_rank_bytes or [self.memory_capacity_bytes] * len(self.peak_memory_bytes)

    @property
    def tightest_rank(self) -> int:
        """The pipeline rank that leaves the least share of its own budget free (on a uniform
        cluster the one with the highest peak)."""
        caps = self.capacity_per_rank_bytes
        return min(range(len(caps)), key=lambda r: (1 - self.peak_memory_bytes[r] / caps[r], r))

    @property
    def min_headroom_fraction(self) -> float:
        """The least share of its own budget any pipeline rank leaves free (negative: over)."""
        r = self.tightest_rank
        return 1 - self.peak_memory_bytes[r] / self.capacity_per_rank_bytes[r]

    @property
    def exposed_comm_s(self) -> float:
        return sum(v for k, v in self.time_breakdown_s.items() if k.startswith("comm/"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _replicas_on_groups(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan,
                        simulate: bool) -> Estimate:
    """Data-parallel replicas placed on device groups (costmodel.groups): each group's ranks are
    priced as the uniform plan of their micro-batch size on the group's replica view; the
    gradient collectives join every replica (under ZeRO-3 so do each micro-batch's gathers), so
    the step is the slowest group's. Memory: the group closest to its own budget."""
    groups = range(len(cluster.groups))
    parts = [estimate(model, group_train(train, plan, cluster, g), replica_view(cluster, g),
                      group_plan(plan, cluster, g), simulate=simulate) for g in groups]
    slowest = max(groups, key=lambda g: parts[g].step_time_s)
    tight = min(groups, key=lambda g: parts[g].min_headroom_fraction)
    replicas, samples, step_s = group_replicas(plan, cluster), group_samples(plan, cluster), parts[slowest].step_time_s
    model_flops = float(model_flops_per_step(model, train))
    executed = sum(parts[g].executed_flops * replicas[g] / plan.dp for g in groups)
    world_peak = world_peak_flops_per_s(cluster, train.compute_dtype)
    closed = [p.closed_form_step_time_s for p in parts]
    return replace(
        parts[slowest], step_time_s=step_s, tokens_per_s=train.tokens_per_step / step_s,
        mfu=utilization(model_flops, step_s, 1, world_peak), hfu=utilization(executed, step_s, 1, world_peak),
        model_flops=model_flops, executed_flops=executed,
        peak_memory_bytes=parts[tight].peak_memory_bytes, memory_breakdown_bytes=parts[tight].memory_breakdown_bytes,
        memory_capacity_bytes=parts[tight].memory_capacity_bytes,
        memory_capacity_per_rank_bytes=parts[tight].memory_capacity_per_rank_bytes,
        host_memory_bytes=parts[tight].host_memory_bytes, host_capacity_bytes=parts[tight].host_capacity_bytes,
        fits=all(p.fits for p in parts), rank_groups=[tight],
        closed_form_step_time_s=None if None in closed else max(closed),
        group_shares=[{"group": g, "replicas": replicas[g], "micro_batch_size": group_plan(plan, cluster, g).micro_batch_size,
                       "samples": samples[g], "step_time_s": parts[g].step_time_s, "peak_memory_bytes": parts[g].max_peak_memory_bytes,
                       "capacity_bytes": parts[g].memory_capacity_bytes, "fits": parts[g].fits} for g in groups])


def _tied_embedding_sync_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec,
                           sp: Spans) -> float:
    """Tied input/output embeddings, or the embedding MTP modules read, on different pipeline
    ranks: all-reduce their gradient between the first and last stage once per step (Megatron-LM)."""
    first, last = plan.stage_rank(0), plan.stage_rank(plan.num_virtual_stages - 1)
    if not (model.tied_embeddings or model.mtp_depth) or first == last:
        return 0.0
    num_bytes = ceil_div(model.vocab_size, plan.tp) * model.hidden_size * train.grad_dtype.num_bytes
    return stage_pair_all_reduce_s(num_bytes, sp, cluster)


def _ledger(plan: Plan, critical: RankTimes, pp_s: float, bubble_s: float, dp_s: tuple[float, float],
            emb_s: float, after: tuple[float, float, float, float, float]) -> dict[str, float]:
    m = plan.num_micro_batches
    optim_s, host_s, replica_s, accumulate_s, fsdp_s = after
    return {
        "compute/forward": m * critical.forward_s,
        "compute/backward": m * critical.backward_s,
        "compute/recompute": m * critical.recompute_s,
        "grads/accumulation": accumulate_s,
        "grads/fsdp_one_rank": fsdp_s,
        "params/fsdp_copy_out": dp_s[1],
        "comm/tp_exposed": m * critical.tp_comm_s,
        "comm/cp_exposed": m * critical.cp_comm_s,
        "comm/ep_exposed": m * critical.ep_comm_s,
        "comm/activation_offload": m * critical.offload_s,
        "comm/pp_exposed": pp_s,
        "pipeline/bubble": bubble_s,
        "comm/dp_exposed": dp_s[0],
        "comm/embedding_sync": emb_s,
        "comm/tp_replica_sync": replica_s,
        "optimizer/step": optim_s,
        "host/step": host_s,
    }


def simulate_plan(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan,
                  *, keep_events: bool = False) -> Simulation:
    return simulate(plan, stage_costs(model, train, plan, cluster), keep_events=keep_events)


def offloads(plan: Plan) -> bool:
    """Whether the plan keeps anything in host memory (states or activations)."""
    return plan.offload_optimizer or plan.offload_activations


def host_state_bytes_per_rank(model: ModelSpec, train: TrainSpec, plan: Plan,
                              traits: FrameworkTraits = RUNTIME) -> list[float]:
    """Host memory of one device of each pipeline rank for its offloaded ZeRO shard's states."""
    return [host_state_bytes(train, plan, rank_params(model, plan, r, traits).zero_shard(plan, traits)) for r in range(plan.pp)]


def host_budgets_bytes(plan: Plan, cluster: ClusterSpec) -> list[float]:
    """Host memory a device of each pipeline rank may use (ClusterSpec.host_budget_bytes of its view)."""
    return [view.host_budget_bytes for view in rank_views(plan, cluster)]


def host_bytes_per_rank(model: ModelSpec, train: TrainSpec, plan: Plan,
                        traits: FrameworkTraits = RUNTIME) -> list[float]:
    """Host memory of one device of each pipeline rank: offloaded states and activations."""
    states = host_state_bytes_per_rank(model, train, plan, traits)
    return [states[r] + host_activation_bytes(model, train, plan, r, plan.layers_on_rank(r), traits)
            for r in range(plan.pp)]


def memory_per_rank(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan,
                    sim: Simulation | None = None) -> list[StageMemory]:
    """States, buffers and reserve per formula; activations at their simulated peak (with what the
    expert all-to-all overlap's warmup adds to the order simulated: overlap_warmup_bytes)."""
    sim = sim or simulate_plan(model, train, cluster, plan)
    reserved = [reserved_bytes(model, train, plan, view.device, view.framework, cluster.devices_per_node)
                for view in rank_views(plan, cluster)]
    last = plan.stage_rank(plan.num_virtual_stages - 1)
    traits = cluster.framework
    return [replace(stage_memory(model, train, plan, r, reserved[r], traits),
                    activations_bytes=sim.peak_activation_bytes[r]
                    + overlap_warmup_bytes(model, train, plan, r, traits)
                    + backward_working_bytes(model, train, plan, r == last, traits,
                                             rebuilt_layer_bytes(model, train, plan, r, traits)))
            for r in range(plan.pp)]




@dataclass(frozen=True, slots=True)
class _AfterPipeline:
    """What each rank does after (or once a step beside) its pipeline passes."""
    accumulate_s: list[float]                 # its gradient accumulation (rank_time.grad_accumulation_s)
    fsdp_s: list[tuple[float, float]]         # a one-replica plan's FSDP (reduce, gathers)
    slowest: tuple[float, ...]                # the five parts of the rank that finishes last


def _after_pipeline(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec, views: list,
                    sp) -> _AfterPipeline:
    """Per rank: the optimizer step, the step's host work and a TP-replicated mixture's gradient
    all-reduce (after_pipeline_s), its gradient accumulation, priced beside them once a step
    (rank_time.grad_accumulation_s), and FSDP's reduce and gathers where a one-replica plan is
    wrapped (rank_time.one_replica_fsdp_parts_s); the rank that finishes last sets all five."""
    held = [rank_params(model, plan, r, cluster.framework) for r in range(plan.pp)]
    accumulate = [grad_accumulation_s(model, train, plan, views[r], held[r], plan.layers_on_rank(r))
                  for r in range(plan.pp)]
    fsdp = [one_replica_fsdp_parts_s(model, train, plan, views[r], held[r], plan.layers_on_rank(r))
            for r in range(plan.pp)]
    slowest = max(((*after_pipeline_s(model, train, plan, views[r], sp, held[r], plan.layers_on_rank(r)),
                    accumulate[r], sum(fsdp[r])) for r in range(plan.pp)), key=sum)
    return _AfterPipeline(accumulate_s=accumulate, fsdp_s=fsdp, slowest=slowest)


def _pipeline_phase(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan, views: list,
                    ranks: list[RankTimes], closed: float | None, critical: int | None,
                    ledger_of: Callable[..., dict[str, float]], simulate: bool):
    """The step's ledger, the memory per rank, each rank's idle time and the critical rank: from
    the simulated pipeline, or from its closed form (`ledger_of`: _ledger with the terms outside
    the pipeline bound)."""
    if simulate:
        sim = simulate_plan(model, train, cluster, plan)
        critical = max(range(plan.pp), key=lambda r: sim.busy_s[r])
        # the busiest rank's sends, and its idle time in the simulated pipeline phase
        # (a rank busy all along idles for no time: the difference's rounding is not a bubble)
        idle = [max(0.0, sim.time_s - busy) for busy in sim.busy_s]
        ledger = ledger_of(ranks[critical], sim.send_s[critical], idle[critical])
        return ledger, memory_per_rank(model, train, cluster, plan, sim), idle, critical
    if closed is None:
        raise ValueError(f"schedule {plan.schedule} has no closed form: simulate it")
    crit, m = ranks[critical], plan.num_micro_batches
    ledger = ledger_of(crit, m * crit.pp_comm_s, closed - m * crit.total_s)
    memory = [stage_memory(model, train, plan, r, reserved_bytes(model, train, plan, views[r].device, views[r].framework,
                                                                cluster.devices_per_node),
                           cluster.framework) for r in range(plan.pp)]
    return ledger, memory, [], critical


def _closed_form_step_s(plan: Plan, crit: RankTimes, closed: float, ledger_of: Callable[..., dict[str, float]]) -> float:
    """The step with the pipeline's closed form: its ledger's sum, as `estimate(simulate=False)`
    sums it (the search's times, to the last bit)."""
    m = plan.num_micro_batches
    return sum(ledger_of(crit, m * crit.pp_comm_s, closed - m * crit.total_s).values())


def estimate(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan,
             *, simulate: bool = True) -> Estimate:
    """Predict one optimizer step. The plan must pass `check_plan` structurally.

    `simulate=False` prices the pipeline by its closed form instead (fast, affine in the layer
    split: what the search's branch and bound and CP-SAT reason with); a schedule without one
    (ScheduleTraits.closed_form) is refused."""
    if places_replicas(plan, cluster):
        return _replicas_on_groups(model, train, cluster, plan, simulate)
    sp = spans(plan, cluster)
    views = rank_views(plan, cluster)   # each rank priced by its device group's profile
    ranks = [rank_times(model, train, plan, views[r], sp, r) for r in range(plan.pp)]
    dp_parts = [dp_exposed_parts_s(model, train, plan, views[r], sp, r, ranks[r]) for r in range(plan.pp)]
    dp_s = max(dp_parts, key=sum)   # the rank whose collectives and FSDP2 copy-outs take longest
    after = _after_pipeline(model, train, plan, cluster, views, sp)
    # what the runtime times as a stage's DP sync: a pipeline's once-a-step reduce
    sync_reduce = [reduce if plan.pp > 1 else 0.0 for reduce, _ in after.fsdp_s]
    emb_s = _tied_embedding_sync_s(model, train, plan, views[0], sp)
    closed, closed_critical = pipeline_time_s(plan, ranks) if plan.schedule.traits.closed_form else (None, None)
    ledger_of = partial(_ledger, plan, dp_s=dp_s, emb_s=emb_s, after=after.slowest)
    ledger, memory, idle, critical = _pipeline_phase(model, train, cluster, plan, views, ranks, closed, closed_critical,
                                                     ledger_of, simulate)
    step_s = sum(ledger.values())
    peak = [m.total_bytes for m in memory]
    capacity = rank_budgets_bytes(plan, cluster)
    host = host_bytes_per_rank(model, train, plan, cluster.framework)
    host_capacity = host_budgets_bytes(plan, cluster) if offloads(plan) else [0.0] * plan.pp
    model_flops = float(model_flops_per_step(model, train))
    fw = cluster.framework
    executed = float(executed_flops_per_step(model, train, plan, fw.recompute_early_stop,
                                               priced_modules(fw.selective_modules, fw.selective_op_policy)))
    world_peak = world_peak_flops_per_s(cluster, train.compute_dtype)
    return Estimate(
        step_time_s=step_s, tokens_per_s=train.tokens_per_step / step_s,
        mfu=utilization(model_flops, step_s, 1, world_peak), hfu=utilization(executed, step_s, 1, world_peak),
        model_flops=model_flops, executed_flops=executed, peak_memory_bytes=peak,
        memory_capacity_bytes=min(capacity), memory_capacity_per_rank_bytes=capacity,
        rank_groups=[int(g) for g in rank_groups(plan, cluster)],
        fits=all(p <= c for p, c in zip(peak, capacity)) and all(h <= c for h, c in zip(host, host_capacity)),
        bubble_fraction=ledger["pipeline/bubble"] / step_s, time_breakdown_s=ledger,
        memory_breakdown_bytes=[m.to_dict() for m in memory], critical_rank=critical,
        rank_time_per_micro_batch_s=[r.total_s for r in ranks],
        bubble_fraction_per_rank=[s / step_s for s in idle],
        # the accumulation, the one-rank gathers (and reduce, without a pipeline) and FSDP2's copy-outs
        # run inside the rank's passes, which the runtime times as its work
        rank_work_s=[plan.num_micro_batches * (r.total_s - r.pp_comm_s) + a + gather + (reduce if plan.pp == 1 else 0.0)
                     + copy for r, a, (reduce, gather), (_, copy) in zip(ranks, after.accumulate_s, after.fsdp_s, dp_parts)],
        rank_fsdp_reduce_s=sync_reduce,
        closed_form_step_time_s=None if closed is None else _closed_form_step_s(plan, ranks[closed_critical], closed,
                                                                                 ledger_of),
        host_memory_bytes=host, host_capacity_bytes=min(host_budgets_bytes(plan, cluster)))
