"""Building concrete plans from degrees and choices, and the small discrete choices around them."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from costmodel.check import world_problem
from costmodel.groups import placement_problems, replica_samples
from costmodel.hardware import ClusterSpec
from costmodel.inputs import UserError
from costmodel.plan import DEFAULT_AXIS_ORDER, Plan, Recompute, even_layers
from costmodel.schedules import Schedule, default_schedule
from costmodel.specs import ModelSpec, TrainSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class Choice:
    """What a user (or the search) picks; `build_plan` turns it into a concrete Plan."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int | None = None  # None: world size / (tp*pp*cp)
    zero_stage: int = 1
    recompute: Recompute = Recompute.NONE
    recompute_layers: int | tuple[int, ...] | None = None  # per pipeline rank (one count or one each); None: all
    layers_per_stage: tuple[int, ...] = ()   # per virtual stage in pipeline order; (): as even as they go
    sequence_parallel: bool | None = None  # None: on whenever tp > 1 (Megatron's recommendation)
    micro_batch_size: int = 1
    vpp: int = 1
    schedule: Schedule | None = None  # None: interleaved-1f1b when vpp > 1, else 1f1b
    mesh_axis_order: tuple[str, ...] = DEFAULT_AXIS_ORDER
    ep: int = 1   # expert-parallel degree (mixtures of experts; costmodel.check_degrees.ep_problems)
    etp: int = 1   # expert tensor-parallel degree (costmodel.check_degrees.etp_problems)
    offload_optimizer: bool = False   # ZeRO-Offload: sharded states and their step on the host
    fp8_linears: bool = False   # the layers' linears in float8 (torchao tensorwise)
    offload_activations: bool = False   # the layers' saved activations on the host
    group_order: tuple[int, ...] = ()   # a mixed cluster's groups along the ranks (Plan.group_order)
    micro_batch_sizes: tuple[int, ...] = ()   # per group, replicas on a mixed cluster (Plan.micro_batch_sizes)
    dp_replicate: int = 1   # hybrid sharding: replicas of the ZeRO shard groups (Plan.dp_replicate)


def build_plan(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, choice: Choice) -> Plan:
    """Fill in what follows from the choice. Raises ValueError when the degrees cannot divide the
    cluster or the batch; everything else is left to check_plan so the user sees every problem."""
    inner = choice.tp * choice.pp * choice.cp
    dp = choice.dp if choice.dp is not None else cluster.world_size // inner
    if choice.dp is None and cluster.world_size % inner:
        raise UserError(f"tp*pp*cp = {inner} does not divide the cluster's {cluster.world_size} devices")
    # before anything is sized by these degrees: a typo of 10^9 must not allocate 10^9 entries
    if problem := world_problem(dp, choice.tp, choice.pp, choice.cp, cluster.world_size):
        raise UserError(problem)
    if choice.pp * choice.vpp > model.num_layers + 2:
        raise UserError(f"pp*vpp = {choice.pp * choice.vpp:,} pipeline stages, but the model has only "
                         f"{model.num_layers} layers")
    _check_layer_counts(model, choice)
    if choice.micro_batch_sizes:
        num_micro_batches = _shared_micro_batches(train, cluster, choice, dp)
    else:
        per_replica = train.global_batch_size // max(dp, 1)
        if dp < 1 or train.global_batch_size % dp or per_replica % choice.micro_batch_size:
            raise UserError(f"global batch {train.global_batch_size} does not split into dp={dp} "
                             f"replicas of micro-batches of {choice.micro_batch_size}")
        num_micro_batches = per_replica // choice.micro_batch_size
    schedule = choice.schedule or default_schedule(choice.vpp)
    layers = choice.layers_per_stage or dense_layers_first(even_layers(model.num_layers, choice.pp * choice.vpp),
                                                           model.first_k_dense)
    probe = Plan(dp=dp, tp=choice.tp, pp=choice.pp, cp=choice.cp, zero_stage=choice.zero_stage,
                 recompute=choice.recompute, recompute_num_layers=(0,) * choice.pp,
                 sequence_parallel=False,
                 micro_batch_size=max(choice.micro_batch_sizes) if choice.micro_batch_sizes else choice.micro_batch_size,
                 micro_batch_sizes=tuple(choice.micro_batch_sizes), num_micro_batches=num_micro_batches, schedule=schedule,
                 vpp=choice.vpp, layers_per_stage=layers, mesh_axis_order=tuple(choice.mesh_axis_order),
                 ep=choice.ep, etp=choice.etp, offload_optimizer=choice.offload_optimizer,
                 fp8_linears=choice.fp8_linears,
                 offload_activations=choice.offload_activations, group_order=tuple(choice.group_order),
                 dp_replicate=choice.dp_replicate)
    if choice.recompute is Recompute.NONE:
        counts = (0,) * choice.pp
    else:
        wanted = choice.recompute_layers
        _check_recompute_counts(wanted, probe)
        counts = tuple(probe.layers_on_rank(r) if wanted is None
                       else min(wanted if isinstance(wanted, int) else wanted[r], probe.layers_on_rank(r))
                       for r in range(choice.pp))
    sp = choice.sequence_parallel if choice.sequence_parallel is not None else choice.tp > 1
    return replace(probe, recompute_num_layers=counts, sequence_parallel=sp)


def _check_layer_counts(model: ModelSpec, choice: Choice) -> None:
    """--recompute-layers and --layers against the plan's pipeline, one line each."""
    if choice.layers_per_stage:
        stages = choice.pp * choice.vpp
        if len(choice.layers_per_stage) != stages or sum(choice.layers_per_stage) != model.num_layers:
            raise UserError(f"--layers {','.join(map(str, choice.layers_per_stage))}: expected {stages} counts "
                            f"(pp x vpp virtual stages, in pipeline order) adding up to the model's "
                            f"{model.num_layers} layers")
    wanted = choice.recompute_layers
    if wanted is None:
        return
    if choice.recompute is Recompute.NONE:
        raise UserError("--recompute-layers needs --recompute selective or full")
    if not isinstance(wanted, int) and len(wanted) != choice.pp:
        raise UserError(f"--recompute-layers {','.join(map(str, wanted))}: one count, or one per pipeline rank "
                        f"({choice.pp})")


def _check_recompute_counts(wanted: int | tuple[int, ...] | None, plan: Plan) -> None:
    """--recompute-layers against the layers the plan's ranks hold (its split: --layers, or the
    default with a mixture's dense first layers first): one count at most the longest rank's, a
    list each rank's own at most."""
    if wanted is None:
        return
    held = [plan.layers_on_rank(r) for r in range(plan.pp)]
    if isinstance(wanted, int):
        if wanted > max(held):
            raise UserError(f"--recompute-layers {wanted}: a pipeline rank holds at most {max(held)} layers")
    elif over := [r for r in range(plan.pp) if wanted[r] > held[r]]:
        raise UserError(f"--recompute-layers {','.join(map(str, wanted))}: pipeline rank {over[0]} holds "
                        f"{held[over[0]]} layers, not {wanted[over[0]]}")


def dense_layers_first(layers: tuple[int, ...], dense: int) -> tuple[int, ...]:
    """An even split whose first stage holds the model's dense first layers (check_structure:
    they are priced there): those on the first stage and the rest spread evenly over the others;
    unchanged where the first stage already holds them or the others would be left empty."""
    total, stages = sum(layers), len(layers)
    if layers[0] >= dense or stages == 1 or total - dense < stages - 1:
        return layers
    return (dense, *even_layers(total - dense, stages - 1))


def _shared_micro_batches(train: TrainSpec, cluster: ClusterSpec, choice: Choice, dp: int) -> int:
    """The micro-batch count every replica runs when each group's run their own size: the global
    batch over one micro-batch of every replica (costmodel.groups.replica_samples)."""
    sizes = tuple(choice.micro_batch_sizes)
    probe = degrees_plan(dp=dp, tp=choice.tp, pp=choice.pp, cp=choice.cp, mesh_axis_order=tuple(choice.mesh_axis_order),
                         group_order=tuple(choice.group_order))
    probe = replace(probe, micro_batch_size=max(sizes), micro_batch_sizes=sizes)
    if problems := placement_problems(probe, cluster):
        raise UserError(problems[0])
    per = sum(replica_samples(probe, cluster))
    if train.global_batch_size % per:
        raise UserError(f"global batch {train.global_batch_size} is no whole number of micro-batches of "
                         f"{per} sequences (micro-batch sizes {list(sizes)} over the groups' replicas)")
    return train.global_batch_size // per


def degrees_plan(*, dp: int, tp: int, pp: int, cp: int, zero_stage: int = 0, num_micro_batches: int = 1,
                 mesh_axis_order: tuple[str, ...] = DEFAULT_AXIS_ORDER, num_layers: int | None = None,
                 ep: int = 1, offload_optimizer: bool = False, group_order: tuple[int, ...] = (),
                 etp: int = 1, dp_replicate: int = 1) -> Plan:
    """A concrete plan that fixes only degrees (and ZeRO stage / micro-batch count): for asking
    the cost model questions that depend on nothing else, such as placement or DP collectives."""
    layers = num_layers or pp
    return Plan(dp=dp, tp=tp, pp=pp, cp=cp, zero_stage=zero_stage, recompute=Recompute.NONE,
                recompute_num_layers=(0,) * pp, sequence_parallel=False, micro_batch_size=1,
                num_micro_batches=num_micro_batches, schedule=default_schedule(1), vpp=1,
                layers_per_stage=even_layers(layers, pp), mesh_axis_order=mesh_axis_order, ep=ep, etp=etp,
                offload_optimizer=offload_optimizer, group_order=group_order, dp_replicate=dp_replicate)


def divisors(n: int) -> list[int]:
    """In O(sqrt n): a world size or a layer count from a user may be large."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def under_schedule(model: ModelSpec, plan: Plan, schedule: Schedule) -> Plan:
    """The same degrees, micro-batches and recomputation under another pipeline schedule: its
    virtual stages (two for schedules that take several), layers split evenly when the stage count
    changes, each rank's recomputed layers capped by what it now holds. Not checked: the caller
    asks check_plan."""
    traits = schedule.traits
    vpp = max(2, traits.min_vpp) if traits.max_vpp != 1 else 1
    layers = plan.layers_per_stage if vpp == plan.vpp else even_layers(model.num_layers, plan.pp * vpp)
    probe = replace(plan, schedule=schedule, vpp=vpp, layers_per_stage=layers)
    counts = tuple(min(n, probe.layers_on_rank(r)) for r, n in enumerate(plan.recompute_num_layers))
    return replace(probe, recompute_num_layers=counts)
