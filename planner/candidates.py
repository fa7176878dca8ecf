"""The search space: every outer choice the search considers (degrees, micro-batch, recompute
mode, virtual stages, schedule, SP, placement), within what the user fixed or narrowed and less
the choices another dominates under the model (planner.search_options). The rules of a valid plan are asked of
costmodel.check_degrees (tp_problems, cp_problems, ep_problems, sp_problems) and the schedule traits, not copied.
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from functools import lru_cache
from typing import Callable, Iterator, NamedTuple

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
from costmodel.check_levers import activation_offload_problems, fp8_problems
from costmodel.frameworks import FrameworkTraits, shards_in_part
from costmodel.groups import group_orders, placement_problems, places_replicas
from costmodel.hardware import ClusterSpec
from costmodel.memory import keeps_whole_grads_under_pp
from costmodel.plan import AXES, Recompute, virtual_stage_options
from costmodel.schedules import Schedule, default_schedule
from costmodel.specs import ModelSpec, TrainSpec
from planner.mesh_orders import distinct_orders, mesh_orders
from planner.search_options import MAX_CP, MAX_MICRO_BATCH, SearchOptions, allowed, dominant, reason_key
from planner.space import Choice, degrees_plan, divisors


def _virtual_stages(options: SearchOptions, num_layers: int, pp: int, empty_ends: bool,
                    mtp_depth: int = 0) -> list[int]:
    """Interleavings searched: equal chunks, the embedding, loss and MTP modules counted as layers
    or not (costmodel.plan.virtual_stage_options; one unit a chunk where the framework runs stages
    without a layer, `empty_ends`); a --vpp the user fixes may split the layers unevenly
    (at least one a chunk) where the framework splits them freely (our runtime, torchtitan,
    Megatron-Core's explicit layout)."""
    found = list(_stage_options(num_layers, pp, empty_ends, mtp_depth))
    fixed = options.fixed.get("vpp")
    free = options.space is None or options.space.split == "free"
    if free and fixed is not None and fixed not in found and 2 <= fixed and pp >= 2 and pp * fixed <= num_layers:
        found.append(fixed)
    return found


@lru_cache(maxsize=4096)   # asked per group of choices: few distinct shapes of pipeline
def _runnable(valid: tuple[Schedule, ...], pp: int, vpp: int, m: int, recomputes: bool,
              torch_pipelining: bool) -> tuple[Schedule, ...]:
    """The schedules of `valid` whose own rules take this pipeline (costmodel.schedules: e.g. 1F1B's m >= pp)."""
    return tuple(s for s in valid
                 if not s.traits.problems(str(s), pp, vpp, m, recomputes, torch_pipelining=torch_pipelining))


@lru_cache(maxsize=256)   # asked per group of choices: a few (layers, pp) pairs
def _stage_options(num_layers: int, pp: int, empty_ends: bool, mtp_depth: int) -> tuple[int, ...]:
    return tuple(virtual_stage_options(num_layers, pp, empty_ends, mtp_depth))


@lru_cache(maxsize=4096)   # asked once per candidate: the traits' rules need not be re-read
def _schedules(pp: int, vpp: int, mode: Recompute,
               allowed: frozenset | None = None) -> tuple[tuple[Schedule, ...], tuple[Schedule, ...]]:
    """(valid schedules, the dominant ones). Under the model GPipe equals 1F1B in time and needs
    more memory, so 1F1B dominates it; ZB-H1 has a smaller fill but holds the deferred weight
    passes' inputs (more memory), so neither it nor 1F1B dominates the other. ZB-H1 cannot run
    with recomputation (check_plan). `allowed` narrows them (pp = 1 needs none)."""
    if pp == 1:
        return (default_schedule(1),), (default_schedule(1),)
    # the schedules check_plan accepts here (pp, vpp, recompute mode; the micro-batch rule is met:
    # interleaving is offered only when pp divides the micro-batches) that have a closed form:
    # ZBV is priced only by simulation
    valid = [s for s in Schedule if s.traits.closed_form and (allowed is None or s in allowed)
             and not s.traits.problems(str(s), pp, vpp, pp, mode is not Recompute.NONE, torch_pipelining=True)]
    dominant = [s for s in valid if s.traits.dominated_by not in valid] or valid
    return tuple(valid), tuple(dominant)   # cached: never handed out to be changed


class Group(NamedTuple):
    """Outer choices alike but for their rank placement, virtual stages, schedule and states:
    `base` (one virtual stage, no schedule, placed by the first of `orders`), its (vpp, schedule)
    `variants`, and the mesh `orders` it is priced under. Memory does not depend on the order."""

    base: Choice
    variants: list[tuple[int, Schedule]]
    orders: list[tuple[str, ...]]


def time_groups(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions,
                prune: Callable[[str], None]) -> Iterator[tuple[Choice, list[tuple[int, Schedule]]]]:
    """Every outer choice except the ZeRO stage (which the time bound does not depend on), as
    (a choice with one virtual stage and no schedule, its (vpp, schedule) variants): the
    variants share one rank time model."""
    for group in placement_groups(model, train, cluster, options, prune):
        for order in group.orders:
            yield replace(group.base, mesh_axis_order=order), group.variants


def placement_groups(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions,
                     prune: Callable[[str], None], share: tuple[int, int] = (0, 1)) -> Iterator[Group]:
    """time_groups' choices, those that differ only in their mesh order as one Group. `share`
    (i, n): the groups of every n-th (tp, cp, ep, etp, micro-batch size), from the i-th in
    listing order, at every pp (planner.halves)."""
    world, L = cluster.world_size, model.num_layers
    index, count = share
    # the kernel times of one (tp, cp, ep, etp, micro-batch size), which read no pp or dp, and its
    # rank time models (which read only whether there is a pipeline) are priced in one process
    owner: dict[tuple, int] = {}
    mine = lambda shape: owner.setdefault(shape, len(owner) % count) == index  # noqa: E731
    for tp, cp in _tp_cp(model, train, cluster, options):
        if refused := mtp_cp_problems(model, cp, cluster.framework):   # none of its choices is a plan
            prune(reason_key(refused[0]))
            continue
        for pp in allowed(options, "pp", [p for p in divisors(world // (tp * cp)) if p <= L]):
            dp = world // (tp * cp * pp)
            if train.global_batch_size % dp:
                prune("global batch not divisible by dp")
            elif options.fixed.get("dp", dp) == dp:
                for ep, etp in _expert_grids(model, cluster, options, tp, cp, pp, dp):
                    orders: dict[int, tuple[list, list]] = {}   # per replica count: alike for every fp8 and offload
                    for fp8, act, rep in itertools.product(
                            allowed(options, "fp8_linears", fp8_options(model, train, cluster, tp)),
                            allowed(options, "offload_activations", _act_offload_options(cluster, tp)),
                            replica_counts(model, cluster, options, tp, cp, dp, ep, pp)):
                        yield from _groups_for_degrees(model, train, cluster, options, tp, cp, pp, dp, ep,
                                                       fp8, act, etp, mine, rep, orders)


def replica_counts(model: ModelSpec, cluster: ClusterSpec, options: SearchOptions, tp: int, cp: int, dp: int,
                   ep: int, pp: int = 1) -> list[int]:
    """Hybrid sharding's replica counts the space holds (Plan.dp_replicate): 1, and where the
    framework runs it (costmodel.frameworks `hybrid_shard`) on a dense model and a uniform
    cluster (costmodel.check), every count whose shard groups (tp x cp x dp / r ranks each) fill
    HYBRID_SHARD_NODES whole nodes with two replicas or more; a pinned count (--fix
    dp_replicate=R) wherever check_plan takes it."""
    traits = cluster.framework
    stage = hybrid_zero_stage(traits, options)
    if "dp_replicate" in options.fixed:
        r = options.fixed["dp_replicate"]
        return [r] if r == 1 or not hsdp_problems(model, dp, r, stage, traits) else []
    if (not shards_in_part(traits, stage) or model.is_moe or ep > 1 or cluster.is_mixed
            or keeps_whole_grads_under_pp(pp, traits)):
        return [1]
    out = [1]
    for r in divisors(dp)[1:-1]:
        nodes, rest = divmod(tp * cp * dp // r, cluster.devices_per_node)
        if not rest and nodes in HYBRID_SHARD_NODES:
            out.append(r)
    return out


def hybrid_zero_stage(traits: FrameworkTraits, options: SearchOptions) -> int:
    """The least ZeRO stage hybrid sharding is weighed with: FSDP's (ZeRO-3) where the framework
    shards in part at every stage (torchtitan, FSDP1's HYBRID_SHARD: each micro-batch's gathers
    stay inside the shard group), the distributed optimizer's (ZeRO-1) where only there
    (Megatron-Core's optimizer instances); pinned (--fix dp_replicate), any ZeRO >= 1."""
    return 1 if "dp_replicate" in options.fixed or not traits.hybrid_shard else 3


# The shard groups hybrid sharding is searched with, in nodes: a node's NVLink domain, as FSDP1's
# HYBRID_SHARD takes it, or a few nodes' (torchtitan's dp_shard spans any); larger groups approach
# full sharding, whose rings span every replica anyway
HYBRID_SHARD_NODES = frozenset({1, 2, 4, 8})


def _expert_grids(model: ModelSpec, cluster: ClusterSpec, options: SearchOptions, tp: int, cp: int, pp: int,
                  dp: int) -> list[tuple[int, int]]:
    """The (ep, etp) pairs the space holds: _eps at etp 1, and where the framework splits experts
    (costmodel.frameworks `expert_tensor_parallel`) each etp > 1 dividing tp (the expert-TP group
    inside the dense TP ranks, in a node; predict takes any etp x ep that tiles tp x cp x dp) with
    the ep check_plan takes beside it under some mesh order the search lays out."""
    pairs = [(ep, 1) for ep in allowed(options, "ep", _eps(model, cluster, options, tp, cp, pp, dp))]
    traits = cluster.framework
    if not (model.is_moe and traits.expert_tensor_parallel):
        return [p for p in pairs if p[1] in allowed(options, "etp", [1]) and _dispatchable(model, cluster, *p)]
    orders = tuple(options.space.mesh_orders if options.space is not None else itertools.permutations(AXES))
    for etp in (e for e in divisors(tp)[1:] if not model.moe_ffn_hidden_size % e):
        pairs += [(ep, etp) for ep in allowed(options, "ep", divisors(tp * cp * dp // etp))
                  if any(not ep_problems(model, ep, dp=dp, tp=tp, cp=cp, pp=pp, order=o, traits=traits, etp=etp)
                         for o in orders)]
    return [p for p in pairs if p[1] in allowed(options, "etp", [p[1]]) and _dispatchable(model, cluster, *p)]


def _dispatchable(model: ModelSpec, cluster: ClusterSpec, ep: int, etp: int) -> bool:
    """Whether the framework's expert dispatcher runs a group of etp x ep ranks."""
    return not dispatcher_problems(model, ep, etp, cluster.framework, cluster.devices_per_node)


def _eps(model: ModelSpec, cluster: ClusterSpec, options: SearchOptions, tp: int, cp: int, pp: int,
         dp: int) -> list[int]:
    """The expert-parallel degrees check_plan takes under some mesh order the search lays out
    (_placements keeps the orders each one folds over): divisors of dp where EP is carved from
    data parallelism, of tp x cp x dp where the framework folds it (costmodel.params.folds_ep)."""
    if not model.is_moe:
        return [1]
    traits = cluster.framework
    if not traits.ep_folds_over_tp:
        return [e for e in divisors(dp) if not ep_problems(model, e, dp=dp)]
    orders = options.space.mesh_orders if options.space is not None else itertools.permutations(AXES)
    orders = tuple(orders)
    return [e for e in divisors(tp * cp * dp)
            if any(not ep_problems(model, e, dp=dp, tp=tp, cp=cp, pp=pp, order=o, traits=traits) for o in orders)]


def _tp_cp(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions) -> Iterator[tuple[int, int]]:
    """The tensor- and context-parallel degrees the space holds."""
    world = cluster.world_size
    max_tp = options.max_tp or cluster.devices_per_node
    tp_all = [t for t in divisors(world) if t <= max(max_tp, options.fixed.get("tp", 0)) and not tp_problems(model, t)
              and not shared_expert_tp_problems(model, t, cluster.framework)]
    for tp in allowed(options, "tp", tp_all):
        cp_all = [c for c in divisors(world // tp) if c <= MAX_CP and not cp_problems(model, train, c)]
        for cp in allowed(options, "cp", cp_all):
            yield tp, cp


def replica_degrees(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
                    options: SearchOptions) -> Iterator[tuple[int, int, int, list[tuple[str, ...]], list[bool]]]:
    """Without a pipeline (planner.shares): (tp, cp, dp, every mesh order that lays the ranks out
    differently, the SP options) per degree choice the user's constraints allow."""
    for tp, cp in _tp_cp(model, train, cluster, options):
        dp = cluster.world_size // (tp * cp)
        if options.fixed.get("dp", dp) != dp:
            continue
        sps = dominant(options, "sequence_parallel", [True, False] if not sp_problems(train, tp, cp) else [False], True)
        sps = [sp for sp in sps if not moe_tp_problem(model, tp, sp)]
        yield tp, cp, dp, distinct_orders({"tp": tp, "cp": cp, "pp": 1, "dp": dp, "ep": 1}, cluster), sps


def fp8_options(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, tp: int) -> list[bool]:
    """Float8 linears where the user accepts them and check_plan would (costmodel.check.fp8_problems);
    bf16 linears always: casts can cost more than a small GEMM saves."""
    return [False, True] if train.float8 and not fp8_problems(model, train, cluster, tp) else [False]


def _act_offload_options(cluster: ClusterSpec, tp: int) -> list[bool]:
    """Activations on the host where check_plan would take them at all (a host, no TP); which
    recompute modes and schedules go with them is asked per choice below."""
    possible = not activation_offload_problems(cluster, True, Recompute.NONE, Schedule.ONE_F_ONE_B, tp)
    return [False, True] if possible else [False]


def _group_orders(cluster: ClusterSpec, options: SearchOptions, tp: int, cp: int, pp: int,
                  dp: int) -> list[tuple[int, ...]]:
    """A mixed cluster's orders of its groups along the pipeline under which every stage lies in
    one group (costmodel.groups.placement_problems); a uniform cluster's one empty order."""
    if not cluster.is_mixed:
        return [()]
    if places_replicas(degrees_plan(tp=tp, cp=cp, pp=pp, dp=dp), cluster):   # planner.shares' part
        return []
    orders = allowed(options, "group_order", group_orders(cluster))
    return [g for g in orders if not placement_problems(degrees_plan(tp=tp, cp=cp, pp=pp, dp=dp, group_order=g),
                                                        cluster)]


def _orders(cluster: ClusterSpec, options: SearchOptions, tp: int, cp: int, pp: int, dp: int, ep: int, etp: int,
            rep: int) -> tuple[list, list]:
    """The mesh orders and (mixed clusters) group orders a set of degrees is priced under."""
    degrees = {"tp": tp, "cp": cp, "pp": pp, "dp": dp, "ep": ep, "etp": etp, "dp_replicate": rep}
    return mesh_orders(degrees, cluster, options.space), _group_orders(cluster, options, tp, cp, pp, dp)


def _groups_for_degrees(model, train, cluster, options, tp, cp, pp, dp, ep, fp8, act, etp=1, mine=lambda shape: True,
                        rep=1, orders_memo: dict | None = None):
    L, per_replica = model.num_layers, train.global_batch_size // dp
    # every size asked, in listing order, so that both processes' shares agree (placement_groups)
    sizes = [b for b in allowed(options, "micro_batch_size", [b for b in divisors(per_replica) if b <= MAX_MICRO_BATCH])
             if mine((tp, cp, ep, etp, b))]
    if not sizes:   # the other process's share
        return
    modes = [Recompute.NONE] if options.no_recompute else list(Recompute)
    if options.space is not None and options.space.recompute_modes is not None:
        modes = [mode for mode in modes if mode in options.space.recompute_modes]
    # offloaded activations are an alternative to recomputation (costmodel.check)
    modes = [mode for mode in modes if not activation_offload_problems(cluster, act, mode, Schedule.ONE_F_ONE_B, tp)]
    # SP dominates no-SP: the same collective volume (AG + RS = AR), less memory, less elementwise work
    sps = dominant(options, "sequence_parallel", [True, False] if not sp_problems(train, tp, cp) else [False],
                   True if options.space is None or options.space.sequence_parallel else False)
    sps = [sp for sp in sps if not moe_tp_problem(model, tp, sp)]
    memo = {} if orders_memo is None else orders_memo
    if rep not in memo:
        memo[rep] = _orders(cluster, options, tp, cp, pp, dp, ep, etp, rep)
    orders, group_orders = memo[rep]
    for mbs in sizes if orders and group_orders else []:
        m = per_replica // mbs
        vpps = [1] + (_virtual_stages(options, L, pp, cluster.framework.empty_end_stages, model.mtp_depth)
                      if m % pp == 0 else [])
        for mode in allowed(options, "recompute", modes):
            variants = []
            for vpp in allowed(options, "vpp", vpps):
                valid, best = _schedules(pp, vpp, mode, options.schedules)
                runnable = _runnable(valid, pp, vpp, m, mode is not Recompute.NONE,
                                     not cluster.framework.own_pipeline_schedules)
                if runnable != valid:   # a rule on the micro-batch count (1F1B: m >= pp): dominance among the rest
                    valid = runnable
                    best = tuple(s for s in valid if s.traits.dominated_by not in valid) or valid
                if act:   # nor with every schedule (a split backward)
                    valid = tuple(s for s in valid if not activation_offload_problems(cluster, act, mode, s, tp))
                    best = tuple(s for s in best if s in valid) or valid
                if valid:
                    variants += [(vpp, sched) for sched in dominant(options, "schedule", valid, best)]
            if not variants:
                continue
            for sp, groups in itertools.product(sps, group_orders):
                yield Group(Choice(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, etp=etp, zero_stage=0, recompute=mode,
                                   sequence_parallel=sp,
                                   micro_batch_size=mbs, vpp=1, schedule=None, mesh_axis_order=orders[0],
                                   fp8_linears=fp8, offload_activations=act, group_order=groups, dp_replicate=rep),
                            variants, orders)
