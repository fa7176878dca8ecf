"""What every export shares: the nearest plan a target can run (each change said in one line),
priced as that framework runs it, and refused when it does not fit or does not check.

A target module gives `nearest(pf) -> Adjusted` (the plan it can express and the differences)
and `render(pf, plan) -> (text, launch)`; `planner.exports.export_plan` drives them."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from costmodel.check import check_structure
from costmodel.estimate import Estimate, estimate
from costmodel.frameworks import FrameworkTraits, framework_traits
from costmodel.hardware import run_by
from costmodel.inputs import UserError
from costmodel.plan import Plan, PlanFile, Recompute, even_layers
from costmodel.schedules import Schedule
from costmodel.units import GIB


class CannotExport(UserError):
    """The target cannot run this plan at all (one line, exit 2)."""


@dataclass
class Adjusted:
    """A plan being moved towards what a target can express, and what moved."""

    plan: Plan
    differences: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # recomputation of no layer is none: said that way to every target
        if self.plan.recompute is not Recompute.NONE and not any(self.plan.recompute_num_layers):
            self.plan = replace(self.plan, recompute=Recompute.NONE)

    def change(self, why: str, **fields) -> None:
        self.plan = replace(self.plan, **fields)
        self.differences.append(why)


@dataclass(frozen=True)
class Export:
    target: str
    text: str                      # the file the target reads
    suffix: str                    # its usual extension
    launch: str                    # how to start it
    plan: Plan                     # what the exported configuration runs
    differences: tuple[str, ...]   # what of the plan the target cannot say, and what it runs instead
    estimate: Estimate             # the exported plan as the target's framework runs it (its traits)
    planned: Estimate              # the plan file's plan as it was priced (its own framework's traits)


def target_traits(pf: PlanFile, framework: str) -> FrameworkTraits:
    """The traits a plan runs with under `framework` (a costmodel.frameworks name): the plan
    file's own where it was priced for that framework (with the options it sets, e.g.
    Megatron-Core's recompute modules and expert all-to-all overlap, which the export writes),
    else the framework's defaults."""
    own = pf.cluster.framework
    return own if own.name == framework_traits(framework).name else framework_traits(framework)


def priced(pf: PlanFile, plan: Plan, framework: str) -> Estimate:
    """`plan` as the framework runs it: its traits (target_traits) on the plan's cluster."""
    return estimate(pf.model, pf.train, run_by(pf.cluster, target_traits(pf, framework)), plan)


def checked(pf: PlanFile, plan: Plan, target: str, framework: str) -> None:
    """The adjusted plan must still be a plan of this model on this cluster (memory apart), as
    the target's framework lays it out (its traits: e.g. whether it folds expert parallelism)."""
    problems = check_structure(pf.model, pf.train, run_by(pf.cluster, target_traits(pf, framework)), plan)
    if problems:
        raise CannotExport(f"{target} cannot run this plan: the nearest plan it can express "
                           f"({plan.short()}) is not valid: {'; '.join(problems)}")


def refuse_if_over(target: str, est: Estimate, plan: Plan) -> None:
    if not est.fits:
        worst = max(est.peak_memory_bytes)
        raise CannotExport(f"{target} cannot run this plan: the nearest plan it can express ({plan.short()}) "
                           f"needs {worst / GIB:.1f} GiB per device of the {est.memory_capacity_bytes / GIB:.1f} "
                           f"a plan may use")


# --- moves shared by the targets -----------------------------------------------------------

def to_schedule(adj: Adjusted, num_layers: int, schedule: Schedule, vpp: int, why: str) -> None:
    """Another pipeline schedule; a different number of virtual stages splits layers evenly."""
    plan = adj.plan
    layers = plan.layers_per_stage if vpp == plan.vpp else even_layers(num_layers, plan.pp * vpp)
    adj.change(why, schedule=schedule, vpp=vpp, layers_per_stage=layers)
    clamp_recompute(adj)


def to_even_layers(adj: Adjusted, num_layers: int, why: str) -> None:
    adj.change(why, layers_per_stage=even_layers(num_layers, adj.plan.num_virtual_stages))
    clamp_recompute(adj)


def clamp_recompute(adj: Adjusted) -> None:
    """Per-rank recomputed layers cannot exceed what a rank now holds."""
    plan = adj.plan
    counts = tuple(min(c, plan.layers_on_rank(r)) for r, c in enumerate(plan.recompute_num_layers))
    if counts != plan.recompute_num_layers:
        adj.plan = replace(plan, recompute_num_layers=counts)


def to_uniform_recompute(adj: Adjusted, mode: Recompute, why: str) -> None:
    """`mode` on every layer of every rank (or none)."""
    plan = adj.plan
    counts = tuple(plan.layers_on_rank(r) if mode is not Recompute.NONE else 0 for r in range(plan.pp))
    adj.change(why, recompute=mode, recompute_num_layers=counts)


def activations_on_device(adj: Adjusted, target: str) -> None:
    """Activations on the host (Plan.offload_activations) are our runtime's hooks: no target's
    file says it, so the exported plan keeps them on the device (and is priced, and refused if
    it does not fit, that way)."""
    if adj.plan.offload_activations:
        adj.change(f"activations on the host: not an option {target}'s file can say; kept on the device",
                   offload_activations=False)


def one_shard_group(adj: Adjusted, target: str, what: str) -> None:
    """Hybrid sharding (Plan.dp_replicate) where the target has none: ZeRO over every
    data-parallel rank, as `what` shards."""
    if adj.plan.dp_replicate > 1:
        adj.change(f"hybrid sharding (dp_replicate={adj.plan.dp_replicate}): {target} shards {what} over all "
                   "data-parallel ranks; one shard group", dp_replicate=1)


def recompute_is_uniform(plan: Plan) -> bool:
    """Every rank recomputes all its layers (or there is no recomputation)."""
    return plan.recompute is Recompute.NONE or all(
        c == plan.layers_on_rank(r) for r, c in enumerate(plan.recompute_num_layers))


def fold_cp_into_dp(adj: Adjusted, global_batch: int, why: str) -> None:
    """Context parallelism the target cannot run: its ranks become data-parallel replicas, each
    with its share of the batch at the same micro-batch size."""
    plan = adj.plan
    dp = plan.dp * plan.cp
    per_replica = global_batch // dp
    if global_batch % dp or per_replica % plan.micro_batch_size:
        raise CannotExport(f"{why}, but the global batch {global_batch} does not split into dp={dp} replicas "
                           f"of micro-batches of {plan.micro_batch_size}")
    adj.change(why, dp=dp, cp=1, num_micro_batches=per_replica // plan.micro_batch_size)


def layout(plan: Plan, order: tuple[str, ...]) -> tuple[str, ...]:
    """The axes that have more than one rank, in `order`: two mesh orders with the same layout
    place every rank alike."""
    return tuple(a for a in order if plan.degree(a) > 1)


def to_rank_order(adj: Adjusted, orders: tuple[tuple[str, ...], ...], what: str) -> None:
    """The first of the target's rank `orders` (outermost first) where the plan's lays ranks out
    otherwise; `what` says how the target orders them."""
    plan = adj.plan
    if layout(plan, plan.mesh_axis_order) not in {layout(plan, o) for o in orders}:
        adj.change(f"mesh order {'>'.join(plan.mesh_axis_order)}: {what}", mesh_axis_order=orders[0])


def on_hosts(hosts: int, per_host: int) -> str:
    """Where a launch runs: "each of the 8 hosts (8 GPUs each)", or "the host (8 GPUs)"."""
    gpus = f"{per_host} GPU{'s' if per_host != 1 else ''}"
    return f"the host ({gpus})" if hosts == 1 else f"each of the {hosts} hosts ({gpus} each)"
