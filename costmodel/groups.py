"""Mixed clusters: which device group each pipeline rank runs on, and the uniform view of the
cluster that prices it.

A mixed cluster (ClusterSpec.groups) lays its groups out along the ranks in the order the plan
gives (Plan.group_order: a permutation of the cluster's groups; empty: as written), each group a
run of whole nodes. A plan runs on it when every pipeline stage lies in one group (the stages
are then placed on groups: Metis, ATC '24, and Sailor plan the same way); the layer split then
follows each group's speed and memory. Within a stage every collective (TP, CP, DP, EP) stays
in the group and is priced by the group's own profile; pipeline sends cross the link between
groups (ClusterSpec.pipeline_tier).

A rank's view is a uniform ClusterSpec of its group's device over the whole cluster's nodes
(spans are read from the plan's layout, which the view keeps) with the link between groups as
its pipeline link: every formula of costmodel prices a rank through it unchanged.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from functools import lru_cache

import numpy as np

from costmodel.hardware import ClusterSpec
from costmodel.inputs import UserError
from costmodel.placement import axis_strides
from costmodel.plan import Plan
from costmodel.specs import TrainSpec


def group_order(plan: Plan, cluster: ClusterSpec) -> tuple[int, ...]:
    """The cluster's groups in the order the plan lays them out along the ranks."""
    return plan.group_order or tuple(range(len(cluster.groups)))


def group_orders(cluster: ClusterSpec) -> list[tuple[int, ...]]:
    """Every distinct order of the groups along the ranks (groups alike in device and size are
    interchangeable: one order of them is enough)."""
    if not cluster.is_mixed:
        return [()]
    seen, out = set(), []
    for order in itertools.permutations(range(len(cluster.groups))):
        key = tuple(cluster.groups[g] for g in order)
        if key not in seen:
            seen.add(key)
            out.append(order)
    return out


def node_groups(plan: Plan, cluster: ClusterSpec) -> tuple[int, ...]:
    """The group of each node, in node-rank order (what a launch must follow)."""
    return tuple(g for g in group_order(plan, cluster) for _ in range(cluster.groups[g].num_nodes))


def rank_groups(plan: Plan, cluster: ClusterSpec) -> tuple[int | None, ...]:
    """The group (an index into cluster.groups) of each pipeline rank's devices; None where a
    rank's stage straddles two groups. A uniform cluster: all 0."""
    if not cluster.is_mixed:
        return (0,) * plan.pp
    return _axis_groups(plan, cluster, "pp")


def replica_groups(plan: Plan, cluster: ClusterSpec) -> tuple[int | None, ...]:
    """The group of each data-parallel replica's devices (all its ranks with that dp
    coordinate); None where a replica straddles two groups. A uniform cluster: all 0."""
    if not cluster.is_mixed:
        return (0,) * plan.dp
    return _axis_groups(plan, cluster, "dp")


def _axis_groups(plan: Plan, cluster: ClusterSpec, axis: str) -> tuple[int | None, ...]:
    node_group = node_groups(plan, cluster)
    degrees = tuple(plan.degree(a) for a in plan.mesh_axis_order)
    return _coordinate_groups(plan.mesh_axis_order, degrees, cluster.devices_per_node, node_group, axis)


@lru_cache(maxsize=4096)
def _coordinate_groups(order: tuple[str, ...], degrees: tuple[int, ...], devices_per_node: int,
                       node_group: tuple[int, ...], axis: str) -> tuple[int | None, ...]:
    """For each coordinate along `axis`, the one group all its ranks lie in, or None."""
    strides = axis_strides(order, degrees)
    others = [(strides[a], d) for a, d in zip(order, degrees) if a != axis]
    ranks = np.zeros(1, dtype=np.int64)
    for stride, degree in others:
        ranks = (ranks[:, None] + np.arange(degree, dtype=np.int64) * stride).ravel()
    groups = np.array(node_group)
    out = []
    for r in range(degrees[order.index(axis)]):
        seen = np.unique(groups[(ranks + r * strides[axis]) // devices_per_node])
        out.append(int(seen[0]) if seen.size == 1 else None)
    return tuple(out)


def places_replicas(plan: Plan, cluster: ClusterSpec) -> bool:
    """Whether a plan places data-parallel replicas on groups (a mixed cluster without a
    pipeline) rather than pipeline stages."""
    return cluster.is_mixed and plan.pp == 1


def replica_micro_batch_sizes(plan: Plan, cluster: ClusterSpec) -> list[int]:
    """The micro-batch size of each data-parallel replica (its group's, Plan.micro_batch_sizes)."""
    if not plan.micro_batch_sizes:
        return [plan.micro_batch_size] * plan.dp
    return [plan.micro_batch_sizes[g] for g in replica_groups(plan, cluster)]


def replica_samples(plan: Plan, cluster: ClusterSpec) -> list[int]:
    """Sequences of the global batch each data-parallel replica trains on per step (the weight
    of its loss: runtime.train and runtime.data read it from here)."""
    return [mbs * plan.num_micro_batches for mbs in replica_micro_batch_sizes(plan, cluster)]


def group_replicas(plan: Plan, cluster: ClusterSpec) -> list[int]:
    """How many data-parallel replicas each group holds (cluster.groups order; every group
    holds some: the replicas cover every node)."""
    counts = [0] * len(cluster.groups)
    for g in replica_groups(plan, cluster):
        counts[g] += 1
    return counts


def group_samples(plan: Plan, cluster: ClusterSpec) -> list[int]:
    """Sequences each group's replicas train on per step together (cluster.groups order)."""
    totals = [0] * len(cluster.groups)
    for g, samples in zip(replica_groups(plan, cluster), replica_samples(plan, cluster)):
        totals[g] += samples
    return totals


def group_plan(plan: Plan, cluster: ClusterSpec, group: int) -> Plan:
    """What one group's ranks run: the plan with its replicas' micro-batch size (a uniform plan,
    priced on `replica_view`)."""
    mbs = plan.micro_batch_sizes[group] if plan.micro_batch_sizes else plan.micro_batch_size
    return replace(plan, micro_batch_size=mbs, micro_batch_sizes=(), group_order=())


def group_train(train: TrainSpec, plan: Plan, cluster: ClusterSpec, group: int) -> TrainSpec:
    """The training spec `group_plan` is consistent with: every replica as this group's."""
    return replace(train, global_batch_size=plan.dp * group_plan(plan, cluster, group).micro_batch_size
                   * plan.num_micro_batches)


def representative(train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> tuple[TrainSpec, ClusterSpec, Plan]:
    """What per-rank pictures of a plan draw (the simulated timeline and memory curves, the dry
    run's states): the plan itself, or with replicas on groups the uniform plan of the group
    with the largest micro-batch (the most activations; the states are alike in every group),
    the slower device among equals."""
    if not places_replicas(plan, cluster):
        return train, cluster, plan
    groups = range(len(cluster.groups))
    g = max(groups, key=lambda g: (group_plan(plan, cluster, g).micro_batch_size,
                                   -cluster.groups[g].device.peak_for(train.compute_dtype)))
    return group_train(train, plan, cluster, g), replica_view(cluster, g), group_plan(plan, cluster, g)


def replica_view(cluster: ClusterSpec, group: int) -> ClusterSpec:
    """The uniform cluster that prices a replica of `group` when replicas are placed on groups:
    its group's device, with the data-parallel collectives (which join every group) over the
    slowest of the groups' networks and the link between them. Every tier beyond a node is the
    slower one: a replica's TP or CP over nodes of its own group is priced at it too (a
    pessimism; they rarely leave a node)."""
    return _replica_view(cluster, group)


@lru_cache(maxsize=256)
def _replica_view(cluster: ClusterSpec, group: int) -> ClusterSpec:
    view = _view(cluster, group)
    # the data-parallel ring crosses every group's nodes and the link between them
    tiers = [cluster.group_link, *(g.device.inter_node for g in cluster.groups)]
    slowest = replace(min(tiers, key=lambda t: t.effective_bandwidth_bytes_per_s),
                      latency_s=max(t.latency_s for t in tiers))
    return replace(view, device=replace(view.device, inter_node=slowest, middle_tiers=()))


# the per-group micro-batch sizes as both a plan file and the command line name them
_SIZES = "micro_batch_sizes (--group-mbs)"


def placement_problems(plan: Plan, cluster: ClusterSpec) -> list[str]:
    """Why a plan cannot be placed on a mixed cluster (check_plan's rule)."""
    if not cluster.is_mixed:
        return ([f"group_order {list(plan.group_order)} needs a mixed cluster"] if plan.group_order else []) + \
            ([f"{_SIZES} {list(plan.micro_batch_sizes)} needs a mixed cluster (one size per device "
              "group)"] if plan.micro_batch_sizes else [])
    n = len(cluster.groups)
    if plan.group_order and sorted(plan.group_order) != list(range(n)):
        return [f"group_order {list(plan.group_order)} is not an order of the cluster's {n} groups"]
    if places_replicas(plan, cluster):
        return _replica_problems(plan, cluster)
    if plan.micro_batch_sizes:
        return [f"{_SIZES} {list(plan.micro_batch_sizes)}: uneven batch shares need pp = 1 (each "
                "data-parallel replica on one group); a pipeline's stages span the groups"]
    groups = rank_groups(plan, cluster)
    if None in groups:
        return [f"a pipeline stage spans two device groups of {cluster.name} (each stage must run on one "
                f"group: pp must split the cluster at its group boundaries, with pp outermost in the mesh)"]
    return []


def _replica_problems(plan: Plan, cluster: ClusterSpec) -> list[str]:
    n, sizes = len(cluster.groups), plan.micro_batch_sizes
    if None in replica_groups(plan, cluster):
        return [f"a data-parallel replica spans two device groups of {cluster.name} (without a pipeline each "
                "replica must run on one group: its tp x cp ranks inside a group, dp outermost)"]
    if sizes and (len(sizes) != n or min(sizes) < 1):
        return [f"{_SIZES} {list(sizes)} needs one positive size per group ({n})"]
    if sizes and plan.micro_batch_size != max(sizes):
        return [f"micro_batch_size {plan.micro_batch_size} must be the largest of {_SIZES} {list(sizes)}"]
    if plan.ep > 1:
        return [f"ep={plan.ep} with replicas on device groups: expert parallelism across groups is not priced"]
    if plan.offload_optimizer or plan.offload_activations or plan.fp8_linears:
        return ["offload and float8 with replicas on device groups are not priced yet"]
    return []


def group_view(cluster: ClusterSpec, group: int) -> ClusterSpec:
    """The uniform cluster that prices a rank of `group` (see the module docstring)."""
    if not cluster.is_mixed:
        return cluster
    return _view(cluster, group)


@lru_cache(maxsize=256)
def _view(cluster: ClusterSpec, group: int) -> ClusterSpec:
    return replace(cluster, device=cluster.groups[group].device, groups=(), group_link=None,
                   pipeline_link=cluster.group_link)


def rank_views(plan: Plan, cluster: ClusterSpec) -> list[ClusterSpec]:
    """Each pipeline rank's view; ValueError when a stage straddles groups (check_plan says why)."""
    if not cluster.is_mixed:
        return [cluster] * plan.pp
    groups = rank_groups(plan, cluster)
    if None in groups:
        raise UserError(placement_problems(plan, cluster)[0])
    return [group_view(cluster, g) for g in groups]


def rank_budgets_bytes(plan: Plan, cluster: ClusterSpec) -> list[float]:
    """What each pipeline rank's predicted total may reach (ClusterSpec.memory_budget_bytes of its view)."""
    return [view.memory_budget_bytes for view in rank_views(plan, cluster)]


def rank_caps_bytes(plan: Plan, cluster: ClusterSpec) -> list[float]:
    """Each rank's budget for memory priced with the first group's fixed reserve (what the
    search's memory shapes hold, costmodel.memory.stage_memory_shapes): its own budget, less
    the difference between its reserve and that one."""
    reserve = cluster.device.efficiency.reserved_memory_bytes
    return [view.memory_budget_bytes - view.device.efficiency.reserved_memory_bytes + reserve
            for view in rank_views(plan, cluster)]


def views(cluster: ClusterSpec) -> list[ClusterSpec]:
    """One view per group (a uniform cluster: itself)."""
    return [group_view(cluster, g) for g in range(len(cluster.groups))] if cluster.is_mixed else [cluster]


def world_peak_flops_per_s(cluster: ClusterSpec, dtype) -> float:
    """The dense peak of every device of the cluster together (MFU's denominator)."""
    if not cluster.is_mixed:
        return cluster.world_size * cluster.device.peak_for(dtype)
    return sum(g.num_nodes * cluster.devices_per_node * g.device.peak_for(dtype) for g in cluster.groups)


def short_device_name(cluster: ClusterSpec, group: int) -> str:
    """A group's device as tables show it (`A100` for A100-SXM4-80GB)."""
    return cluster.groups[group].device.name.split("-")[0]


def _share_lines(plan: Plan, cluster: ClusterSpec, global_batch_size: int) -> list[str]:
    replicas, samples, out = group_replicas(plan, cluster), group_samples(plan, cluster), []
    for g in group_order(plan, cluster):
        mbs = group_plan(plan, cluster, g).micro_batch_size
        out.append(f"{replicas[g]} replica(s) on {cluster.groups[g].label(cluster.devices_per_node)}: "
                   f"micro-batch {mbs} x {plan.num_micro_batches} = {samples[g] // replicas[g]} sequences each, "
                   f"{100 * samples[g] / global_batch_size:.0f}% of the batch (losses weighted by it)")
    out.append(f"no pipeline: each replica runs on one group; link between groups "
               f"{cluster.group_link.bandwidth_bytes_per_s / 1e9:g} GB/s per device (the gradient collectives "
               "join every replica)")
    return out


def _runs(groups: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(group, first rank, last rank) for each run of pipeline ranks on one group."""
    out: list[tuple[int, int, int]] = []
    for r, g in enumerate(groups):
        if out and out[-1][0] == g:
            out[-1] = (g, out[-1][1], r)
        else:
            out.append((g, r, r))
    return out


def stages_on(plan: Plan, cluster: ClusterSpec) -> str:
    """Which pipeline ranks run on which group, compactly (`A100:0-3 H100:4-7`); '' on a uniform cluster."""
    if not cluster.is_mixed:
        return ""
    if places_replicas(plan, cluster):   # replicas on groups: each group's micro-batch size
        return " ".join(f"{short_device_name(cluster, g)}:mbs{group_plan(plan, cluster, g).micro_batch_size}"
                        for g in group_order(plan, cluster))
    return " ".join(f"{short_device_name(cluster, g)}:{a}" + (f"-{b}" if b > a else "")
                    for g, a, b in _runs(rank_groups(plan, cluster)))


def placement_lines(plan: Plan, cluster: ClusterSpec, global_batch_size: int) -> list[str]:
    """The stage placement and the batch each group works through, for a mixed cluster's summary."""
    if not cluster.is_mixed:
        return []
    if places_replicas(plan, cluster):
        return _share_lines(plan, cluster, global_batch_size)
    groups, out = rank_groups(plan, cluster), []
    for g, a, b in _runs(groups):
        layers = [plan.layers_on_rank(r) for r in range(a, b + 1)]
        label = cluster.groups[g].label(cluster.devices_per_node)
        out.append(f"stages {a}-{b} on {label}: {sum(layers)} layers ({'/'.join(map(str, layers))})" if b > a else
                   f"stage {a} on {label}: {layers[0]} layers")
    share = global_batch_size // plan.dp
    out.append(f"batch shares: every group runs its stages for all {global_batch_size} sequences; each of the "
               f"{plan.dp} data-parallel replicas takes {share} ({100 / plan.dp:.0f}%), on every group alike "
               f"(a replica's stages span the groups); link between groups "
               f"{cluster.group_link.bandwidth_bytes_per_s / 1e9:g} GB/s per device")
    return out
