"""`check_plan`: the one validator of a plan against model, training spec and cluster.

The planner prunes with it and the runtime refuses with it. Each problem is one sentence a user
can act on; an empty list means the plan is valid (and fits, when memory is checked).
"""
from __future__ import annotations

from costmodel.check_degrees import (
    cp_problems,
    dispatcher_problems,
    ep_problems,
    hsdp_problems,
    moe_tp_problem,
    mtp_cp_problems,
    shared_expert_tp_problems,
    sp_problems,
    tp_problems,
)
from costmodel.check_levers import activation_offload_problems, fp8_problems, no_host_problem, offload_problems
from costmodel.estimate import host_bytes_per_rank, memory_per_rank, offloads
from costmodel.frameworks import FrameworkTraits
from costmodel.groups import (
    group_plan,
    group_train,
    placement_problems,
    places_replicas,
    rank_views,
    replica_samples,
    replica_view,
    views,
)
from costmodel.hardware import ClusterSpec
from costmodel.memory import StageMemory
from costmodel.plan import AXES, Plan, Recompute
from costmodel.rank_time.ep_overlap import plan_overlap_problems
from costmodel.selective_modules import DEFAULT_SELECTIVE_MODULES, module_problems
from costmodel.specs import ModelSpec, PositionKind, TrainSpec
from costmodel.units import GIB


def world_problem(dp: int, tp: int, pp: int, cp: int, world: int) -> str | None:
    """The one rule that the degrees fill the cluster (build_plan and validate ask it before they
    size anything by the degrees)."""
    if dp * tp * pp * cp == world:
        return None
    return f"dp*tp*pp*cp = {dp}*{tp}*{pp}*{cp} = {dp * tp * pp * cp:,} does not equal the cluster's {world:,} devices"


def check_structure(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> list[str]:
    if problems := _degree_problems(plan):
        return problems
    problems = _spec_problems(model, train, cluster)
    if problem := world_problem(plan.dp, plan.tp, plan.pp, plan.cp, cluster.world_size):
        problems.append(problem)
    elif cluster.is_mixed or plan.group_order or plan.micro_batch_sizes:
        problems += placement_problems(plan, cluster)
    placed = not problems
    return [*problems, *_parallel_problems(model, train, cluster, plan),
            *_batch_problems(model, train, cluster, plan, placed), *_state_problems(model, train, cluster, plan),
            *_schedule_problems(model, train, cluster, plan)]


def _degree_problems(plan: Plan) -> list[str]:
    return [f"{name} must be at least 1 (got {getattr(plan, name)})"
            for name in ("dp", "tp", "pp", "cp", "ep", "etp", "vpp", "micro_batch_size", "num_micro_batches",
                         "dp_replicate") if getattr(plan, name) < 1]


def _spec_problems(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec) -> list[str]:
    """What the specs ask of the devices and of the model, whatever the plan."""
    problems = []
    for view in views(cluster):
        if view.device.peak_flops_per_s.get(str(train.compute_dtype), 0) <= 0:
            has = [d for d, peak in view.device.peak_flops_per_s.items() if peak > 0]
            problems.append(f"device {view.device.name} has no {train.compute_dtype} support in its profile (--dtype "
                            f"{' or '.join(has)})")
    if model.position_kind is PositionKind.LEARNED and train.seq_len > model.max_position_embeddings:
        problems.append(f"seq_len {train.seq_len} is longer than the model's {model.max_position_embeddings} "
                        "learned positions")
    if model.sliding_window is not None and train.seq_len > model.sliding_window:
        problems.append(f"seq_len {train.seq_len} is longer than the model's attention window {model.sliding_window}: "
                        "sliding-window attention beyond the window is neither priced nor run; use --seq-len "
                        f"{model.sliding_window} or less")
    return problems


def _parallel_problems(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> list[str]:
    """TP, CP, EP and SP against the model and the framework."""
    problems = [*tp_problems(model, plan.tp), *cp_problems(model, train, plan.cp),
                *mtp_cp_problems(model, plan.cp, cluster.framework),
                *shared_expert_tp_problems(model, plan.tp, cluster.framework),
                *ep_problems(model, plan.ep, dp=plan.dp, tp=plan.tp, cp=plan.cp, pp=plan.pp,
                             order=plan.mesh_axis_order, traits=cluster.framework, etp=plan.etp),
                *dispatcher_problems(model, plan.ep, plan.etp, cluster.framework, cluster.devices_per_node)]
    if plan.sequence_parallel:
        problems += sp_problems(train, plan.tp, plan.cp)
    if problem := moe_tp_problem(model, plan.tp, plan.sequence_parallel):
        problems.append(problem)
    return problems


def _batch_problems(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan, placed: bool) -> list[str]:
    """The replicas' samples against the global batch (a mixed cluster's replicas each their share)."""
    if plan.micro_batch_sizes:   # each replica its group's share (unplaced: placement_problems said why)
        problems = []
        if model.is_moe:
            problems.append("micro_batch_sizes with experts: the router's balancing loss is not weighted by the "
                            "replicas' shares")
        samples = replica_samples(plan, cluster) if placed else []
        if samples and sum(samples) != train.global_batch_size:
            problems.append(f"the replicas' samples {'+'.join(map(str, samples))} = {sum(samples)} "
                            f"(micro_batch_sizes {list(plan.micro_batch_sizes)} x {plan.num_micro_batches} "
                            f"micro-batches) do not add up to the global batch {train.global_batch_size}")
        return problems
    batch = plan.dp * plan.micro_batch_size * plan.num_micro_batches
    if batch != train.global_batch_size:
        return [f"dp*micro_batch_size*num_micro_batches = {plan.dp}*{plan.micro_batch_size}*"
                f"{plan.num_micro_batches} = {batch} does not equal the global batch {train.global_batch_size}"]
    return []


def _state_problems(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> list[str]:
    """ZeRO, hybrid sharding, what goes to the host, float8."""
    problems = [] if plan.zero_stage in (0, 1, 2, 3) else [f"zero_stage must be 0, 1, 2 or 3 (got {plan.zero_stage})"]
    problems += offload_problems(cluster, plan.zero_stage, plan.offload_optimizer)
    problems += hsdp_problems(model, plan.dp, plan.dp_replicate, plan.zero_stage, cluster.framework)
    if plan.dp_replicate > 1 and cluster.is_mixed:
        problems.append(f"dp_replicate={plan.dp_replicate} (hybrid sharding) on a mixed cluster: its replicas' "
                        "spans over the device groups are not modelled")
    problems += activation_offload_problems(cluster, plan.offload_activations, plan.recompute, plan.schedule,
                                            plan.tp)
    if plan.fp8_linears:
        problems += fp8_problems(model, train, cluster, plan.tp)
    return problems


def _schedule_problems(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> list[str]:
    """The rank order, the pipeline and recomputation, and the framework options the cluster sets."""
    problems = []
    if sorted(plan.mesh_axis_order) != sorted(AXES):
        problems.append(f"mesh_axis_order must order exactly {', '.join(AXES)} (got {', '.join(plan.mesh_axis_order)})")
    problems += _check_pipeline(model, plan, cluster.framework)
    problems += _check_recompute(plan)
    if (modules := cluster.framework.selective_modules) != DEFAULT_SELECTIVE_MODULES:
        problems += [f"recompute_modules: {p}" for p in module_problems(modules, cluster.framework.name, model)]
    if cluster.framework.ep_a2a_overlap:
        problems += [f"ep_overlap: {p}" for p in plan_overlap_problems(model, train.compute_dtype, plan)]
    return problems


def _check_pipeline(model: ModelSpec, plan: Plan, traits: FrameworkTraits) -> list[str]:
    problems: list[str] = []
    add = problems.append
    if len(plan.layers_per_stage) != plan.pp * plan.vpp:
        add(f"layers_per_stage has {len(plan.layers_per_stage)} entries; pp*vpp = {plan.pp * plan.vpp}")
    elif sum(plan.layers_per_stage) != model.num_layers:
        add(f"layers_per_stage sums to {sum(plan.layers_per_stage)}, the model has {model.num_layers} layers")
    elif min(plan.layers_per_stage) < 1 and not _empty_ends_allowed(plan, traits):
        add(f"every pipeline stage needs at least one layer under {traits.name}" + (
            " but the first and the last, which may hold the embedding, or the MTP modules and the loss, alone"
            if traits.empty_end_stages else ""))
    problems += plan.schedule.traits.problems(str(plan.schedule), plan.pp, plan.vpp, plan.num_micro_batches,
                                              plan.recompute is not Recompute.NONE and any(plan.recompute_num_layers),
                                              torch_pipelining=not traits.own_pipeline_schedules)
    return problems


def _empty_ends_allowed(plan: Plan, traits: FrameworkTraits) -> bool:
    """Whether the plan's stages without a layer are the first and the last only, where the
    framework runs such stages (`empty_end_stages`): Megatron-Core's split with the embedding and
    the loss counted as a layer each, or its explicit --pipeline-model-parallel-layout, whose
    first stage may hold the embedding alone and whose last the MTP modules and the loss alone
    (Megatron-Bridge's DeepSeek-V3 layout Et|(tt|)*30mL)."""
    split = plan.layers_per_stage
    return traits.empty_end_stages and all(n > 0 for n in split[1:-1])


def _check_recompute(plan: Plan) -> list[str]:
    if len(plan.recompute_num_layers) != plan.pp:
        return [f"recompute_num_layers has {len(plan.recompute_num_layers)} entries, one per pipeline rank ({plan.pp}) expected"]
    problems = []
    for rank, n in enumerate(plan.recompute_num_layers):
        layers = plan.layers_on_rank(rank) if len(plan.layers_per_stage) == plan.pp * plan.vpp else n
        if not 0 <= n <= layers:
            problems.append(f"recompute_num_layers[{rank}] = {n} is outside 0..{layers}")
    if plan.recompute is Recompute.NONE and any(plan.recompute_num_layers):
        problems.append("recompute is none but recompute_num_layers is not all zero")
    if plan.recompute is not Recompute.NONE and not any(plan.recompute_num_layers):
        problems.append(f"recompute is {plan.recompute} but no layer is recomputed")
    return problems


def check_memory(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> list[str]:
    """Each pipeline rank against its device's budget (a mixed cluster's groups differ)."""
    if places_replicas(plan, cluster):   # each group's replicas against its device
        return [f"the replicas on {cluster.groups[g].device.name} (micro-batch "
                f"{group_plan(plan, cluster, g).micro_batch_size}): {problem}"
                for g in range(len(cluster.groups))
                for problem in check_memory(model, group_train(train, plan, cluster, g), replica_view(cluster, g),
                                            group_plan(plan, cluster, g))]
    ranks = rank_views(plan, cluster)
    problems = _device_overflow(memory_per_rank(model, train, cluster, plan), ranks)
    if offloads(plan) and no_host_problem(cluster, "offload") is None:
        for rank, (host, view) in enumerate(zip(host_bytes_per_rank(model, train, plan, cluster.framework), ranks)):
            if host > view.host_budget_bytes:
                problems.append(f"offloaded {'states' if plan.offload_optimizer else 'activations'} of pipeline "
                                f"stage {rank} need {host / GIB:.1f} GiB of host memory per device, over the "
                                f"{view.host_budget_bytes / GIB:.1f} GiB each device's share of the node's "
                                f"{view.device.host.memory_bytes / GIB:,.0f} GiB may use")
                break
    return problems


def _device_overflow(mems: list[StageMemory], ranks: list[ClusterSpec]) -> list[str]:
    """One line for the pipeline ranks over their device's budget: the rank furthest over, in
    full, and how many others are over too (a deep pipeline would otherwise repeat it per rank)."""
    over = [(mem.total_bytes - view.memory_budget_bytes, rank, mem, view)
            for rank, (mem, view) in enumerate(zip(mems, ranks)) if mem.total_bytes > view.memory_budget_bytes]
    if not over:
        return []
    excess, rank, mem, view = max(over, key=lambda o: (o[0], -o[1]))
    others = "" if len(over) == 1 else f"; {len(over)} of {len(ranks)} pipeline stages are over"
    return [f"pipeline stage {rank} needs {mem.total_bytes / GIB:.1f} GiB per device, {excess / GIB:.1f} GiB over the "
            f"{view.memory_budget_bytes / GIB:.1f} GiB a plan may use of {view.device.name} "
            f"({view.device.usable_memory_bytes / GIB:.2f} GiB less {view.memory_headroom:.0%} headroom and the "
            f"allocator's fragmentation){others}"]


def check_plan(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan,
               *, memory: bool = True) -> list[str]:
    problems = check_structure(model, train, cluster, plan)
    if not problems and memory:
        problems = check_memory(model, train, cluster, plan)
    return problems


