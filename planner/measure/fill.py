"""What a published row leaves unstated, filled as the source describes it (profiles/runs/README.md):
the planner's own search with every stated field fixed, over the values the row's framework runs
(its ZeRO stages under its pipeline, the schedules it offers, V searched where the row names the
interleaved schedule without it); its best plans laid out as the framework runs them and the
fastest that fits kept, or, where none fits, the one that overflows least (OOM rows).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Any

from costmodel.check import check_plan, world_problem
from costmodel.estimate import Estimate, estimate
from costmodel.frameworks import FrameworkTraits, framework_known, framework_traits
from costmodel.hardware import ClusterSpec
from costmodel.inputs import UserError
from costmodel.plan import Plan, Recompute, virtual_stage_options
from costmodel.schedules import Schedule
from costmodel.specs import ModelSpec, TrainSpec
from planner.exports import deepspeed, megatron, torchtitan
from planner.measure.cells import choice_cell, flag_cell, int_cell
from planner.measure.runs_table import SELECTIVE_AND_SP_ARXIV_ID, framework_name, published_before
from planner.search import SearchOptions, search
from planner.search_options import replicas_beside_parallelism
from planner.space import Choice, build_plan, divisors

MAX_MICRO_BATCH = 16   # an unstated micro_batch is filled from the divisors of a replica's batch up to this


# Frameworks whose activation checkpointing wraps whole layers (DeepSpeed's engine over a Hugging
# Face-style model, PyTorch FSDP's checkpoint wrapper in llm-foundry, fms-fsdp and the FSDP paper's
# runs) and whose tensor parallelism, where they have one, has no sequence parallelism (DeepSpeed's
# AutoTP: planner.exports.deepspeed): neither Megatron's selective recomputation nor its SP
_WHOLE_LAYER_CHECKPOINTING = frozenset({"deepspeed", "composer-fsdp", "fms-fsdp", "pytorch-fsdp"})
# torchtitan's tensor parallelism always shards the norms' sequence (planner.exports.torchtitan)
_TP_WITH_SP = frozenset({"torchtitan"})


def _options(row: dict[str, str], model: ModelSpec, tp: int, pp: int, dp: int,
             global_batch: int, beside: bool = False) -> tuple[dict[str, list[Any]], set[str]]:
    """Candidate values for every fillable field: the stated one, or all sensible ones; neither
    selective recomputation nor sequence parallelism for a run a paper describes before they
    existed (SELECTIVE_AND_SP_ARXIV_ID) or for a framework that has neither
    (_WHOLE_LAYER_CHECKPOINTING); sequence parallelism alone where the framework's TP has it
    always (_TP_WITH_SP). `beside`: the replicas share the mesh with TP, PP, CP or EP."""
    stated_sp = (row.get("sp") or "").strip()
    name = framework_name(row)
    without_megatron_modes = published_before(row, SELECTIVE_AND_SP_ARXIV_ID) or name in _WHOLE_LAYER_CHECKPOINTING
    sp_options = [False] if tp == 1 or without_megatron_modes else [True] if name in _TP_WITH_SP else [False, True]
    rc = choice_cell(row, "recompute", tuple(r.value for r in Recompute), "")
    if global_batch % dp:
        raise UserError(f"row {row['id']!r}: global_batch {global_batch} does not split over dp = {dp} "
                        "data-parallel replicas")
    per_replica = global_batch // dp
    opts = {
        "micro_batch": [int_cell(row, "micro_batch")] if row.get("micro_batch", "").strip()
        else [d for d in divisors(per_replica) if d <= MAX_MICRO_BATCH],
        "recompute": [Recompute(rc)] if rc else [r for r in Recompute
                                                  if not (without_megatron_modes and r is Recompute.SELECTIVE)],
        "vpp": _vpp_options(row, model, pp),
        "sp": [flag_cell(row, "sp", False)] if stated_sp else sp_options,
        "zero_stage": [int_cell(row, "zero_stage", low=0, high=3)] if row.get("zero_stage", "").strip()
        else sorted(_framework_zero_stages(row, pp, beside)),
    }
    fillable = {k for k in opts if not (row.get(k) or "").strip()}
    return opts, fillable | ({"vpp"} if _says_interleaved(row) else set())


ZERO_STAGES = frozenset({0, 1, 2, 3})
# The export target whose ZeRO rules a row's framework follows (planner.exports: ZERO_STAGES,
# ZERO_STAGES_WITH_PP); Megatron-DeepSpeed pipelines with DeepSpeed's PipelineEngine.
_RULES_OF = {"megatron-core": megatron, "deepspeed": deepspeed, "megatron-deepspeed": deepspeed,
             "torchtitan": torchtitan,
             # PyTorch FSDP's sharding strategies (NO_SHARD, SHARD_GRAD_OP, FULL_SHARD), torchtitan's
             # FSDP2's: no ZeRO-1
             "composer-fsdp": torchtitan, "fms-fsdp": torchtitan, "pytorch-fsdp": torchtitan}
# Megatron-LM before Megatron-Core: its distributed optimizer (ZeRO-1) alone, no FSDP
_MEGATRON_LM_ZERO_STAGES = frozenset({0, 1})


def _framework_zero_stages(row: dict[str, str], pp: int, beside: bool = False) -> frozenset[int]:
    """What an unstated zero_stage may be filled with: the stages the row's framework runs under
    its pipeline, and torchtitan's where its replicas share the mesh with other parallelism
    (`beside`: its DDP runs on a one-dimensional mesh; a rule of torchtitan's own, not of the
    FSDP strategies the other FSDP frameworks share with it); every stage for a framework the
    table does not know."""
    name = framework_name(row)
    if name == "megatron-lm":
        return _MEGATRON_LM_ZERO_STAGES
    rules = _RULES_OF.get(name)
    alone = getattr(rules, "ZERO_STAGES", None) or ZERO_STAGES
    with_pp = getattr(rules, "ZERO_STAGES_WITH_PP", None) or alone
    stages = with_pp if pp > 1 else alone
    return stages & torchtitan.ZERO_STAGES_BESIDE_PARALLELISM if name == "torchtitan" and beside else stages


# A vpp cell for a source that names the interleaved schedule without its number of virtual stages
INTERLEAVED_VPP = "interleaved"


def _says_interleaved(row: dict[str, str]) -> bool:
    return (row.get("vpp") or "").strip().lower() == INTERLEAVED_VPP


def _vpp_options(row: dict[str, str], model: ModelSpec, pp: int) -> list[int]:
    """The stated V; `interleaved` (V unstated): every V >= 2 that splits the layers into equal
    chunks, with or without the embedding and the loss counted (what the published runs' Megatron
    versions ran; an explicit layout came later); empty (the schedule unstated too): those and 1."""
    empty_ends = _row_framework(row).empty_end_stages
    interleavings = virtual_stage_options(model.num_layers, pp, empty_ends)
    if _says_interleaved(row):
        if not interleavings:
            raise UserError(f"row {row['id']!r}: vpp = {INTERLEAVED_VPP} but {model.num_layers} layers "
                            f"over pp = {pp} leave no interleaving (pp >= 2 and pp x V chunks of equal layers)")
        return interleavings
    if (row.get("vpp") or "").strip():
        return [int_cell(row, "vpp")]
    return [1] + ([] if _one_f_one_b_only(row) else interleavings)


def _row_framework(row: dict[str, str]) -> FrameworkTraits:
    return framework_traits(framework_name(row) or None)


def _one_f_one_b_only(row: dict[str, str]) -> bool:
    """Whether the row's framework pipelines with DeepSpeed's PipelineEngine (`pipe_engine_sends`),
    which runs one 1F1B-style schedule with one stage per rank (planner.exports.deepspeed)."""
    return _row_framework(row).pipe_engine_sends


# What the published frameworks' pipelines run: 1F1B, or interleaved 1F1B with virtual stages
# (none of them ran a zero-bubble schedule); our own runtime runs them all.
PUBLISHED_SCHEDULES = frozenset({Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED})


def _schedules(row: dict[str, str]) -> frozenset[Schedule]:
    """The schedules the row's pipeline may have run: interleaved 1F1B alone where it says so,
    1F1B alone under DeepSpeed's PipelineEngine where it does not."""
    if _says_interleaved(row):
        return frozenset({Schedule.INTERLEAVED})
    return frozenset({Schedule.ONE_F_ONE_B}) if _one_f_one_b_only(row) else PUBLISHED_SCHEDULES


SEARCH_FIELDS = {"micro_batch": "micro_batch_size", "recompute": "recompute", "vpp": "vpp",
                 "sp": "sequence_parallel", "zero_stage": "zero_stage"}


def best_plan_for_row(row: dict[str, str], model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
                      time_limit_s: float = 20.0) -> tuple[Plan, Estimate, dict[str, Any]]:
    """The planner's own search fills the unstated fields with every stated one fixed (and the
    schedules the framework offers); its best plans (FRAMEWORK_LAYOUTS) are then laid out as the
    framework runs them (equal layers per stage, or the split the row states in layers_per_stage;
    every layer of the chosen recompute mode recomputed, Megatron's rank order) and the fastest
    that fits is kept.
    When no plan fits, the enumeration below finds the one that overflows least (OOM rows)."""
    tp, pp, cp, ep = int_cell(row, "tp"), int_cell(row, "pp"), int_cell(row, "cp", 1), int_cell(row, "ep", 1)
    dp = int_cell(row, "dp", cluster.world_size // (tp * pp * cp))
    if problem := world_problem(dp, tp, pp, cp, cluster.world_size):   # dp 0: tp*pp*cp above num_gpus
        raise UserError(f"row {row['id']!r}: {problem}")
    deadline = time.perf_counter() + time_limit_s
    beside = replicas_beside_parallelism(Choice(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep))
    opts, fillable = _options(row, model, tp, pp, dp, train.global_batch_size, beside)
    # stated, and an unstated sp with one option left (a run or a framework without SP, or whose TP has it always)
    stated = {SEARCH_FIELDS[k]: v[0] for k, v in opts.items() if k not in fillable or (k == "sp" and len(v) == 1)}
    # a ZeRO stage left unstated is searched among those the framework runs: one search each
    # where that is not every stage (the search's own ZeRO choice knows no framework)
    zeros = [{}] if set(opts["zero_stage"]) == ZERO_STAGES or "zero_stage" not in fillable else \
        [{"zero_stage": z} for z in opts["zero_stage"]]
    # an unstated recompute mode: one search each, for the framework recomputes every layer of the
    # mode, where the search's best may recompute a few and so hide each mode's own best plan
    # behind one that is faster and leaner only as the search splits it
    modes = [{"recompute": r} for r in opts["recompute"]] if "recompute" in fillable else [{}]
    found = []
    for zero, mode in itertools.product(zeros, modes):
        fixed = {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "ep": ep, "dp_replicate": _replicas(row, dp), **stated, **zero,
                 **mode, **_offloads(row), "fp8_linears": train.float8}
        options = SearchOptions(top_k=FRAMEWORK_LAYOUTS, fixed=fixed, max_tp=max(tp, cluster.devices_per_node),
                                time_limit_s=time_limit_s / (len(zeros) * len(modes)), schedules=_schedules(row),
                                error_band=0.0)
        found += search(model, train, cluster, options).plans
    found.sort(key=lambda f: f.estimate.step_time_s)
    split = _stated_split(row, "layers_per_stage", model.num_layers, pp)
    if found:
        # plans differing only in their split or rank order lay out alike: each choice once
        searched = {_choice_of(f.plan): f.plan.layers_per_stage for f in reversed(found)}   # each choice's best split
        laid_out = [_as_framework_runs(model, train, cluster, replace(choice, layers_per_stage=split))
                    for choice in dict.fromkeys(_choice_of(f.plan) for f in found)]
        if not split and not framework_known(framework_name(row)):
            laid_out = [_rebalanced(model, train, cluster, plan, est, searched) for plan, est in laid_out]
        problems = [check_plan(model, train, cluster, plan, memory=False) for plan, _ in laid_out]
        if split and all(problems):   # the stated split, which the search did not choose
            raise UserError(f"row {row['id']!r}: no valid plan for the stated fields: {problems[0][0]}")
        valid = [pair for pair, problem in zip(laid_out, problems) if not problem]
        fitting = [pair for pair in valid if pair[1].fits]
        if fitting:
            plan, est = min(fitting, key=lambda pair: pair[1].step_time_s)
        elif split:   # the stated split overflows: priced as stated, the least overflowing
            plan, est = min(valid, key=lambda pair: pair[1].max_peak_memory_bytes)
        else:  # the framework's layout overflows where the search's split fits
            plan, est = found[0].plan, found[0].estimate
    else:
        plan, est = _least_overflow(row, model, train, cluster, opts, (tp, pp, cp, dp, ep), deadline)
    filled = {"micro_batch": plan.micro_batch_size, "recompute": str(plan.recompute),
              "vpp": plan.vpp, "sp": plan.sequence_parallel, "zero_stage": plan.zero_stage}
    filled = {k: v for k, v in filled.items() if k in fillable}
    if not split and plan.layers_per_stage != build_plan(model, train, cluster, _choice_of(plan)).layers_per_stage:
        filled["layers_per_stage"] = plan.layers_per_stage   # the search's (_rebalanced, or the fallback above)
    return plan, est, filled


def _offloads(row: dict[str, str]) -> dict[str, bool]:
    """Optional columns offload_optimizer and offload_activations (empty: no): states and their
    step on the host (ZeRO-Offload, FSDP's CPUOffload); the layers' saved activations on the host
    instead of recomputing them. DeepSpeed's cpu_checkpointing, the checkpointed inputs of full
    recomputation on the host, is neither (no plan has it)."""
    return {"offload_optimizer": flag_cell(row, "offload_optimizer", False),
            "offload_activations": flag_cell(row, "offload_activations", False)}


def _replicas(row: dict[str, str], dp: int) -> int:
    """Optional column dp_replicate: hybrid sharding's replicas of the ZeRO shard groups
    (Plan.dp_replicate; FSDP's HYBRID_SHARD, torchtitan's data_parallel_replicate_degree); empty:
    one shard group of every data-parallel rank."""
    return int_cell(row, "dp_replicate", 1, high=dp)


def _stated_split(row: dict[str, str], key: str, num_layers: int, pp: int) -> tuple[int, ...]:
    """A layer count per (virtual) pipeline stage, in pipeline order, as "11,12,12,9": the split
    the run's framework made (DeepSpeed's PipelineModule partitions by its partition_method, not
    evenly); () when empty. pp x vpp counts, so vpp must be stated beside it (1 where empty)."""
    value = (row.get(key) or "").strip()
    if not value:
        return ()
    where = f"row {row.get('id')!r}: {key} = {value!r}"
    try:
        counts = tuple(int(part) for part in value.split(","))
    except ValueError:
        raise UserError(f"{where} is not comma-separated integers") from None
    if min(counts) < 0 or sum(counts) != num_layers:
        raise UserError(f"{where} must be counts of at least 0 adding up to the model's {num_layers} layers")
    vpp = (row.get("vpp") or "").strip()
    if vpp and not vpp.isdigit():
        raise UserError(f"{where} needs vpp stated as a number, not {vpp!r}")
    stages = pp * (int_cell(row, "vpp") if vpp else 1)
    if len(counts) != stages:
        raise UserError(f"{where} must give pp x vpp = {stages} counts")
    return counts


# The search's best plans laid out as the framework runs them, the fastest kept: a search plan that
# recomputes some layers may lead a no-recompute one by a hair and lose by a quarter once every
# layer is recomputed (megatron_h100_119B: a plan recomputing 2 layers leads by a hair and,
# every layer recomputed as Megatron runs it, loses by about a quarter). Eight reach past such
# near-ties at a search's cost each.
FRAMEWORK_LAYOUTS = 8


def _choice_of(plan: Plan) -> Choice:
    """What the framework's layout keeps of a search plan: its degrees and modes."""
    return Choice(tp=plan.tp, pp=plan.pp, cp=plan.cp, dp=plan.dp, ep=plan.ep, zero_stage=plan.zero_stage,
                  recompute=plan.recompute, sequence_parallel=plan.sequence_parallel,
                  micro_batch_size=plan.micro_batch_size, vpp=plan.vpp, fp8_linears=plan.fp8_linears,
                  dp_replicate=plan.dp_replicate, offload_optimizer=plan.offload_optimizer,
                  offload_activations=plan.offload_activations)


def _rebalanced(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan, est: Estimate,
                searched: dict[Choice, tuple[int, ...]]) -> tuple[Plan, Estimate]:
    """A framework the model does not know, whose even split overflows: split as the search split
    it. No column states a split, and such frameworks take other splits (torchtitan's and
    DeepSpeed's pipelines any, Megatron-Core its first and last stage's), which experts use where
    memory makes them: a layer fewer on the stages that hold the most micro-batches in flight."""
    if est.fits:
        return plan, est
    choice = _choice_of(plan)
    return _as_framework_runs(model, train, cluster, replace(choice, layers_per_stage=searched[choice]))


def _as_framework_runs(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
                       choice: Choice) -> tuple[Plan, Estimate]:
    """A search plan's choice laid out by build_plan (equal layers per stage, every layer of its
    recompute mode recomputed, Megatron's rank order) and priced."""
    plan = build_plan(model, train, cluster, choice)
    return plan, estimate(model, train, cluster, plan)


def _least_overflow(row: dict[str, str], model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
                    opts: dict[str, list[Any]], degrees: tuple[int, int, int, int, int],
                    deadline: float) -> tuple[Plan, Estimate]:
    """Nothing fits: the framework-laid-out plan of the stated fields that overflows least (of
    those priced before the deadline: a row's time is bounded like its search)."""
    tp, pp, cp, dp, ep = degrees
    best: tuple[float, Plan, Estimate] | None = None
    first_problem = ""   # why the first choice of the stated fields is no plan, for the error
    split = _stated_split(row, "layers_per_stage", model.num_layers, pp)
    for mb, rc, vpp, sp, zero in itertools.product(*opts.values()):
        if best is not None and time.perf_counter() > deadline:
            break
        choice = Choice(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, zero_stage=zero, recompute=rc,
                        sequence_parallel=sp, micro_batch_size=mb, vpp=vpp, fp8_linears=train.float8,
                        dp_replicate=_replicas(row, dp), layers_per_stage=split, **_offloads(row))
        try:
            plan = build_plan(model, train, cluster, choice)
        except ValueError as exc:
            first_problem = first_problem or str(exc)
            continue
        if problems := check_plan(model, train, cluster, plan, memory=False):
            first_problem = first_problem or problems[0]
            continue
        est = estimate(model, train, cluster, plan)
        if best is None or est.max_peak_memory_bytes < best[0]:
            best = (est.max_peak_memory_bytes, plan, est)
    if best is None:
        raise UserError(f"row {row['id']!r}: no valid plan for the stated fields: {first_problem}")
    return best[1], best[2]
