"""`--framework`: plans for the framework that will run them.

`planner` (the default) is the included runtime: every plan the search knows, priced with its
traits. `megatron`, `torchtitan` and `deepspeed` are the export targets (planner.exports): the
search holds only the plans the target runs as they are, and prices them with the target's
traits (costmodel.frameworks, the vendor attention it calls included). What a target runs is
read from one place, its export module's `nearest`: a plan it would have to change is not in
its space. The search narrows the space before that verdict where the rules are simple (the
target's schedules, rank orders, layer splits and recomputation counts), so that CP-SAT solves
only splits the target can say; the verdict is asked of every plan the search builds.
"""
from __future__ import annotations

from dataclasses import replace
from types import ModuleType

from costmodel.frameworks import FRAMEWORKS, RUNTIME, FrameworkTraits
from costmodel.hardware import ClusterSpec, run_by
from costmodel.inputs import UserError
from costmodel.plan import Plan, PlanFile
from costmodel.rank_time.ep_overlap import plan_overlap_problems
from costmodel.schedules import Schedule
from costmodel.specs import ModelSpec, TrainSpec
from planner.exports import TARGETS, CannotExport, deepspeed, megatron, torchtitan
from planner.search_options import FrameworkSpace, SearchOptions
from planner.space import degrees_plan

PLANNER = "planner"
NAMES = (PLANNER, *TARGETS)

# The schedules each target's pipeline runs (its export module's docstring says why)
_SCHEDULES = {
    "megatron": frozenset({Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED}),
    "torchtitan": torchtitan.SCHEDULES,   # torch.distributed.pipelining's that take compiled stages
    "deepspeed": frozenset({Schedule.ONE_F_ONE_B}),
}
# how each splits layers and recomputes them (planner.partition.SplitRules)
_SPLITS = {
    "megatron": ("free", "block"),   # --pipeline-model-parallel-layout; --recompute-num-layers
    "torchtitan": ("free", "every_nth"),   # module names per stage; checkpointing of every n-th layer
    "deepspeed": ("even", "all"),   # partition_method 'uniform'; every layer checkpointed
}
_ORDERS = {"megatron": (megatron.DEFAULT_ORDER, megatron.TP_PP_DP_ORDER), "torchtitan": (torchtitan.ORDER,),
           "deepspeed": (deepspeed.ORDER,)}


def traits_for(name: str) -> FrameworkTraits:
    """How a `--framework` runs plans (costmodel.frameworks)."""
    return RUNTIME if name == PLANNER else FRAMEWORKS[TARGETS[name].FRAMEWORK]


def name_for(traits: FrameworkTraits) -> str:
    """The `--framework` whose traits these are (a plan file's cluster records the traits)."""
    return next((n for n in NAMES if traits_for(n).name == traits.name), PLANNER)


def _module(name: str) -> ModuleType:
    return TARGETS[name]


def changes(name: str, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> list[str]:
    """What the framework would have to change of `plan` to run it (its export's `nearest`);
    empty for a plan it runs as it is, and always for our runtime."""
    if name == PLANNER:
        return []
    try:
        adjusted = _module(name).nearest(PlanFile(plan=plan, model=model, train=train, cluster=cluster))
    except CannotExport as exc:
        return [str(exc)]
    return list(adjusted.differences) if adjusted.plan != plan else []


def _problems(name: str, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> list[str]:
    """The search's verdict on a plan for the framework: what it would change (changes), and the
    rules of the options the cluster sets for it (Megatron-Core's expert all-to-all overlap), so
    that no plan the search offers, the closest one that does not fit included, breaks them."""
    found = changes(name, model, train, cluster, plan)
    if cluster.framework.ep_a2a_overlap:
        found += [f"ep_overlap: {p}" for p in plan_overlap_problems(model, train.compute_dtype, plan)]
    return found


def cluster_for(name: str, cluster: ClusterSpec) -> ClusterSpec:
    """The cluster as the framework drives it; a mixed cluster only by our runtime."""
    if name == PLANNER:
        return cluster
    if cluster.is_mixed:
        raise UserError(f"{name} cannot run a mixed cluster ({cluster.name}): its configuration assumes one "
                        "device kind; mixed clusters are planned for the included runtime only (no --framework "
                        "or --export)")
    return run_by(cluster, traits_for(name))


def options_for(name: str, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
                options: SearchOptions, flag: str = "--framework") -> SearchOptions:
    """The search's options narrowed to what the framework runs. Refuses a model the framework
    cannot build at all, and a --schedule it does not run, in one line naming it (and the flag
    that chose it: --framework, or search's --export)."""
    if name == PLANNER:
        return options
    probe = degrees_plan(dp=cluster.world_size, tp=1, pp=1, cp=1, num_layers=model.num_layers)
    try:
        _module(name).nearest(PlanFile(plan=probe, model=model, train=train, cluster=cluster))
    except CannotExport as exc:
        raise UserError(f"{flag} {name}: {exc}") from None
    options = _without_pipeline(name, model, options, flag)
    schedules = _SCHEDULES[name]
    fixed = options.fixed.get("schedule")
    if schedules is not None and fixed is not None and fixed not in schedules:
        runs = ", ".join(sorted(str(s) for s in schedules))
        raise UserError(f"{flag} {name}: schedule {fixed} is not one it runs ({runs})")
    if options.schedules is not None:
        schedules = options.schedules if schedules is None else schedules & options.schedules
    split, recompute = _SPLITS[name]
    module = _module(name)
    space = FrameworkSpace(name=name, mesh_orders=_ORDERS[name], split=split, recompute_counts=recompute,
                           sequence_parallel=has_sequence_parallel(name, model, train, cluster),
                           zero_stages=_zero_stages(module, train),
                           zero_stages_with_pp=getattr(module, "ZERO_STAGES_WITH_PP", None),
                           zero_stages_beside_parallelism=getattr(module, "ZERO_STAGES_BESIDE_PARALLELISM", None),
                           recompute_modes=getattr(module, "RECOMPUTE_MODES", None),
                           problems=lambda plan: _problems(name, model, train, cluster, plan))
    return replace(options, schedules=schedules, space=space)


def _without_pipeline(name: str, model: ModelSpec, options: SearchOptions, flag: str) -> SearchOptions:
    """pp fixed at 1 where the framework builds the model without a pipeline (torchtitan's qwen3);
    a --fix pp above 1 refused in one line."""
    pipelines = getattr(_module(name), "pipelines", None)
    if pipelines is None or pipelines(model):
        return options
    if options.fixed.get("pp", 1) > 1:
        raise UserError(f"{flag} {name}: {name} builds {model.name} without a pipeline (its train spec has no "
                        f"pipelining_fn); pp {options.fixed['pp']} is not one it runs")
    return replace(options, fixed={**options.fixed, "pp": 1})


def has_sequence_parallel(name: str, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec) -> bool:
    """Whether the framework runs sequence parallelism: asked of its export on a TP plan with SP."""
    if name == PLANNER:
        return True
    probe = replace(degrees_plan(dp=1, tp=2, pp=1, cp=1, num_layers=model.num_layers), sequence_parallel=True)
    return _module(name).nearest(PlanFile(plan=probe, model=model, train=train, cluster=cluster)).plan.sequence_parallel


def _zero_stages(module, train: TrainSpec | None = None) -> frozenset[int] | None:
    """The ZeRO stages a target runs (None: every one): its `zero_stages(train)` where they depend
    on the training (DeepSpeed's ZeRO-0 and the gradients' dtype), else its ZERO_STAGES."""
    if train is not None and hasattr(module, "zero_stages"):
        return module.zero_stages(train)
    return getattr(module, "ZERO_STAGES", None)


def default_zero_stage(name: str, pp: int) -> int:
    """predict's ZeRO stage where --zero is not given: 1 (sharded optimizer states, Megatron's
    distributed optimizer, DeepSpeed's stage 1) where the framework runs it at this pipeline
    depth, else the highest stage it runs (torchtitan: FSDP2's full sharding)."""
    if name == PLANNER:
        return 1
    module = _module(name)
    stages = _zero_stages(module) or frozenset(range(4))
    if pp > 1 and (with_pp := getattr(module, "ZERO_STAGES_WITH_PP", None)) is not None:
        stages = stages & with_pp
    return 1 if 1 in stages else max(stages)


def refuse_unless_runs(name: str, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> None:
    """A fixed plan (predict) the framework would have to change: one line with its reasons."""
    if found := changes(name, model, train, cluster, plan):
        raise UserError(f"--framework {name} cannot run this plan as it is: "
                        + "; ".join(_as_reason(name, change) for change in found))


def _as_reason(name: str, change: str) -> str:
    """An export's difference ("what: why; what it runs instead") as a reason that names the
    replacement apart, so that several read as one list."""
    change = change.removeprefix(f"{name} cannot run this plan: ")   # a refusal of the whole plan
    why, _, instead = change.rpartition("; ")
    return f"{why} (it would run {instead})" if why else change
