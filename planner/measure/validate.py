"""`planner validate RUNS.csv`: predicted vs published for measured training runs.

Semantics (profiles/runs/README.md): empty plan cells are filled by the planner's own search with
every stated field fixed, each row priced with the traits of the framework that ran it
(costmodel.frameworks); `status` rows with value OOM are right when the plan is predicted not to fit;
errors are signed, (predicted - published) / published.
"""
from __future__ import annotations

import csv
import io
import itertools
import math
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from costmodel.check import check_plan, world_problem
from costmodel.estimate import Estimate, estimate
from costmodel.frameworks import FrameworkTraits, framework_known, framework_traits
from costmodel.hardware import ClusterSpec, parse_cluster, profile_dir, range_problems, resolve_device, run_by
from costmodel.inputs import UserError, read_text
from costmodel.plan import Plan, Recompute, Schedule, virtual_stage_options
from costmodel.registry import MODELS, gpt_spec, llama_spec
from costmodel.specs import (
    DEFAULT_EXPERT_IMBALANCE,
    MAX_EXPERT_IMBALANCE,
    Arch,
    AttentionKernel,
    DType,
    ModelSpec,
    TrainSpec,
)
from planner.exports import deepspeed, megatron, torchtitan
from planner.search import SearchOptions, search
from planner.space import Choice, build_plan, divisors
from planner.specs import FP8

REQUIRED = ("id", "arch", "layers", "hidden", "heads", "vocab", "seq_len", "gpu", "num_gpus",
            "gpus_per_node", "tp", "pp", "global_batch", "metric_name", "metric_value")
MAX_MICRO_BATCH = 16
# What a published step can measure: a microsecond to 11 days a step, a thousandth of a token to
# a billion tokens a second per GPU. Beyond them an error in percent overflows (a step of 1e308 s
# read as -inf %) or means nothing (1e-300 s: +3.7e301 %).
METRIC_RANGES = {"iteration_time_s": (1e-6, 1e6), "tokens_per_sec_per_gpu": (1e-3, 1e9)}
_ARXIV_ID = re.compile(r"\b(\d{4})\.(\d{4,5})\b")
FLASH_ATTENTION_ARXIV_ID = (2205, 14135)  # FlashAttention, Dao et al., arXiv 2205.14135


@dataclass(frozen=True, kw_only=True, slots=True)
class RowResult:
    id: str
    metric: str
    published: float | str
    predicted: float | str
    error_pct: float | None
    fits: bool
    filled: dict[str, Any]
    plan: Plan
    estimate: Estimate

    @property
    def published_mfu(self) -> float | None:
        """The MFU the published measurement implies, on the cost model's FLOP convention (the
        predicted MFU scaled by predicted over published speed)."""
        if self.error_pct is None:
            return None
        speed_ratio = 1 + self.error_pct / 100   # predicted / published, as a speed or a time
        return self.estimate.mfu * (speed_ratio if self.metric == "iteration_time_s" else 1 / speed_ratio)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "metric": self.metric, "published": self.published,
                "predicted": self.predicted, "error_pct": self.error_pct, "fits": self.fits,
                "filled": self.filled, "plan": self.plan.to_dict(),
                "step_time_s": self.estimate.step_time_s, "mfu": self.estimate.mfu,
                "published_mfu": self.published_mfu}


def read_runs(path: Path) -> list[dict[str, str]]:
    return [row for _, row in read_numbered_runs(path)]


def read_numbered_runs(path: Path) -> list[tuple[int, dict[str, str]]]:
    """(line in the file, row) for every run, checked; errors name the file and the line."""
    text = read_text(path, "runs table")
    numbered = []
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        for row in reader:
            numbered.append((reader.line_num, row))   # blank lines and quoted newlines counted
        header = reader.fieldnames or []
    except csv.Error as exc:
        raise UserError(f"runs table {path} is not a readable CSV file ({exc})") from None
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise UserError(f"{path}: missing columns {', '.join(missing)}")
    if not numbered:
        raise UserError(f"{path}: no runs (only a header)")
    seen: set[str] = set()
    for line, row in numbered:
        _check_row(path, line, row)
        if row["id"] in seen:
            raise UserError(f"{path} line {line}: duplicate id {row['id']!r}")
        seen.add(row["id"])
    return numbered


def _check_row(path: Path, line: int, row: dict[str, str]) -> None:
    """Every required cell present, and a metric that can be compared."""
    where = f"{path} line {line} (row {row.get('id')!r})"
    empty = [c for c in REQUIRED if not (row.get(c) or "").strip()]
    if empty:
        raise UserError(f"{where}: empty {', '.join(empty)} (an OOM row still needs its plan: tp, pp, ...)")
    if not row["id"].isprintable():   # a table row, a JSON key and a line of the report each
        raise UserError(f"{where}: id holds a control character (a newline?); give it on one line")
    metric, value = row["metric_name"].strip(), row["metric_value"].strip()
    if metric == "status":
        if value not in ("OOM", "fits"):
            raise UserError(f"{where}: status must be OOM or fits, not {value!r}")
        return
    if metric not in METRIC_RANGES:
        raise UserError(f"{where}: unknown metric_name {metric!r} "
                         "(iteration_time_s, tokens_per_sec_per_gpu or status)")
    try:
        number = float(value)
    except ValueError:
        raise UserError(f"{where}: metric_value {value!r} is not a number") from None
    low, high = METRIC_RANGES[metric]
    if not low <= number <= high:
        raise UserError(f"{where}: metric_value {value!r} is out of range for {metric} (give {low:g} to {high:g})")


def _int(row: dict[str, str], key: str, default: int | None = None, low: int = 1,
         high: int | None = None) -> int | None:
    """A size or degree in [low, high] (a positive integer unless said), or `default` when empty."""
    return _number(row, key, int, default, low, high)


def _number(row: dict[str, str], key: str, kind: type, default, low, high):
    """An int or float cell in [low, high] (no upper limit: None), or `default` when empty."""
    value = (row.get(key) or "").strip()
    if not value:
        return default
    try:
        number = kind(value)
    except ValueError:
        raise UserError(f"row {row.get('id')!r}: {key} = {value!r} is not "
                         f"{'an integer' if kind is int else 'a number'}") from None
    if number < low or (high is not None and number > high):
        shown = lambda x: f"{x:g}" if isinstance(x, float) else str(x)  # noqa: E731
        raise UserError(f"row {row.get('id')!r}: {key} = {shown(number)} is out of range "
                         f"({f'{shown(low)} to {shown(high)}' if high is not None else f'at least {shown(low)}'})")
    return number


def _flag(row: dict[str, str], key: str, default: bool) -> bool:
    value = (row.get(key) or "").strip().lower()
    if not value:
        return default
    if value not in ("yes", "no", "true", "false", "1", "0"):
        raise UserError(f"row {row.get('id')!r}: {key} = {value!r} is not yes or no")
    return value in ("yes", "true", "1")


def row_specs(row: dict[str, str]) -> tuple[ModelSpec, TrainSpec, ClusterSpec]:
    hidden, heads, seq = _int(row, "hidden"), _int(row, "heads"), _int(row, "seq_len")
    common = dict(layers=_int(row, "layers"), hidden=hidden, heads=heads, vocab=_int(row, "vocab"),
                  ffn=_int(row, "ffn_hidden", 4 * hidden), source=f"published run {row['id']}")
    if (row.get("model") or "").strip():
        model = _named_model(row, seq)
    elif row["arch"] == Arch.GPT:
        model = gpt_spec(row["id"], max_pos=seq, **common)
        if not _flag(row, "dropout", True):   # e.g. MPT trains without dropout
            model = replace(model, dropout=False)
    elif row["arch"] == Arch.LLAMA:
        model = llama_spec(row["id"], kv_heads=_int(row, "kv_heads", heads), max_pos=seq, **common,
                           **_experts(row, common["ffn"]))
    else:
        raise UserError(f"row {row['id']!r}: arch {row['arch']!r} is neither gpt nor llama")
    precision = (row.get("precision") or "bf16").strip()
    # fp8: bf16 training whose linears ran in float8 (Transformer Engine, torchao), as --dtype fp8
    float8 = precision == FP8
    train = TrainSpec(seq_len=seq, global_batch_size=_int(row, "global_batch"),
                      compute_dtype=DType.BF16 if float8 else DType(precision), float8=float8,
                      grad_dtype=_grad_dtype(row),
                      attention_kernel=attention_kernel(row), expert_load_imbalance=_imbalance(row))
    num_gpus, per_node = _int(row, "num_gpus"), _int(row, "gpus_per_node")
    if num_gpus % per_node:
        raise UserError(f"row {row['id']!r}: {num_gpus} GPUs is not a whole number of {per_node}-GPU nodes")
    if row["gpu"].strip().lower() == "local":   # a published run ran on a named device, not on this machine
        raise UserError(f"row {row['id']!r}: gpu 'local' is this machine; a published run names its device")
    cluster = parse_cluster(f"{num_gpus // per_node}x{per_node}x{row['gpu']}")
    # priced with the traits of the framework that ran it (unknown names: generic traits) and
    # judged against the hard limit (what CUDA reports, less the context and NCCL reserve): the
    # question is whether the run as published fits, not whether we would plan that close to
    # the edge; the headroom and fragmentation margins are for the plans we emit
    cluster = run_by(_with_fabric(cluster, row), _traits(row, cluster))
    device = cluster.device
    hard = replace(device, efficiency=replace(device.efficiency, allocator_fragmentation=0.0))
    return model, train, replace(cluster, device=hard, memory_headroom=0.0)


def _traits(row: dict[str, str], cluster: ClusterSpec) -> FrameworkTraits:
    """The traits of the framework that ran the row, with the settings the row states that the
    framework leaves to its user (costmodel.frameworks): optional columns fp8_param_gather (float8
    weights gathered in float8), compiled (_compiled) and async_tp (_async_tp)."""
    traits = framework_traits(row.get("framework"))
    if (row.get("fp8_param_gather") or "").strip():
        traits = replace(traits, float8_param_gather=_flag(row, "fp8_param_gather", False))
    if (row.get("compiled") or "").strip():
        traits = _compiled(traits, _flag(row, "compiled", False))
    if (row.get("async_tp") or "").strip():
        traits = _async_tp(row, traits, cluster)
    return traits


def _compiled(traits: FrameworkTraits, compiled: bool) -> FrameworkTraits:
    """Optional column compiled: whether the run's transformer layers ran under torch.compile
    (torchtitan's --training.compile). yes: inductor fuses each layer's memory-bound work and the
    float8 casts (`compiled_layer`, `float8_casts_fused`); no: torch's eager layer, its norms, RoPE,
    SwiGLU and casts each their own kernels (`eager_layer`, as fms-fsdp's runs)."""
    return replace(traits, compiled_layer=compiled, eager_layer=not compiled, float8_casts_fused=compiled)


def _async_tp(row: dict[str, str], traits: FrameworkTraits, cluster: ClusterSpec) -> FrameworkTraits:
    """Optional column async_tp: whether the run overlapped its sequence-parallel collectives with
    their GEMMs (`tp_comm_overlap`). torch's async TP (torchtitan's
    --parallelism.enable_async_tensor_parallel) decomposes each all-gather and reduce-scatter
    into tp steps over symmetric memory, each behind the matmul of a chunk already there, as
    Transformer Engine's userbuffers do; it is an inductor pass (torchtitan refuses it without
    --training.compile) and runs on SM90 and later, so a row stating it says compiled, and its
    device's profile has `tp_comm_gemm_overlap`."""
    overlap = _flag(row, "async_tp", False)
    if overlap and not cluster.device.tp_comm_gemm_overlap:
        raise UserError(f"row {row['id']!r}: async_tp = yes on {cluster.device.name}, whose profile "
                         "runs no TP collective-GEMM overlap (tp_comm_gemm_overlap)")
    if overlap and (row.get("compiled") or "").strip() and not _flag(row, "compiled", False):
        raise UserError(f"row {row['id']!r}: async_tp = yes needs compiled = yes (torch's async TP is an inductor pass)")
    return replace(traits, tp_comm_overlap=overlap)


# a node's network as sources state it, in Gbit/s; a bound that keeps every later division finite
MAX_NODE_NETWORK_GBPS = 1e6


def _with_fabric(cluster: ClusterSpec, row: dict[str, str]) -> ClusterSpec:
    """The row's inter-node network where the source states one other than the device profile's
    (optional column node_network_gbps: the node's bandwidth to other nodes, Gbit/s per
    direction, shared by its GPUs), e.g. IBM's FSDP runs over 400 and 800 Gbit/s per node
    against a DGX's 8 NICs of 200 (A100) or 400 (H100)."""
    gbps = _number(row, "node_network_gbps", float, None, 1.0, MAX_NODE_NETWORK_GBPS)
    if gbps is None:
        return cluster
    if not math.isfinite(gbps):
        raise UserError(f"row {row.get('id')!r}: node_network_gbps = {gbps!r} is not a finite number")
    dev = cluster.device
    per_device = gbps * 1e9 / 8 / cluster.devices_per_node
    inter = replace(dev.inter_node, name=f"{gbps:g} Gbit/s a node", bandwidth_bytes_per_s=per_device)
    return replace(cluster, device=replace(dev, inter_node=inter))


def _grad_dtype(row: dict[str, str]) -> DType:
    """The dtype gradients accumulate and reduce in (optional column grad_dtype): fp32 unless the
    run's configuration says otherwise (Megatron-Core's grad_reduce_in_fp32=False, as NeMo's
    performance recipes and MLPerf set it, keeps a bf16 gradient buffer)."""
    value = (row.get("grad_dtype") or "").strip().lower()
    if not value:
        return DType.FP32
    if value not in ("fp32", "bf16", "fp16"):
        raise UserError(f"row {row.get('id')!r}: grad_dtype = {value!r} is not fp32, bf16 or fp16")
    return DType(value)


# the registry model's field each architecture column states
_STATED_FIELDS = (("arch", "arch"), ("layers", "num_layers"), ("hidden", "hidden_size"), ("heads", "num_heads"),
                  ("kv_heads", "num_kv_heads"), ("ffn_hidden", "ffn_hidden_size"), ("vocab", "vocab_size"),
                  ("num_experts", "num_experts"), ("experts_per_token", "experts_per_token"),
                  ("moe_ffn_hidden", "moe_ffn_hidden_size"))


def _named_model(row: dict[str, str], seq: int) -> ModelSpec:
    """Optional column model: the registry model (costmodel.registry) a run trained, for layouts
    the architecture columns cannot state (heads wider than hidden / heads, per-head query and key
    norms, latent attention, shared experts). Every architecture column the row fills must agree
    with it, so the row reads the same to a tool that knows only the columns."""
    name = row["model"].strip()
    if name not in MODELS:
        raise UserError(f"row {row['id']!r}: model {name!r} is not a registry model (see `planner models`)")
    model = MODELS[name]
    for column, field in _STATED_FIELDS:
        stated = (row.get(column) or "").strip()
        value = getattr(model, field)
        if stated and stated != str(value):
            raise UserError(f"row {row['id']!r}: {column} = {stated} but model {name} has {value}")
    return replace(model, name=row["id"], max_position_embeddings=max(seq, model.max_position_embeddings),
                   source=f"published run {row['id']} ({name}: {model.source})")


def _experts(row: dict[str, str], ffn: int) -> dict[str, int]:
    """A mixture of experts (optional columns num_experts, experts_per_token, moe_ffn_hidden):
    every layer's MLP routed, expert width ffn_hidden unless stated."""
    experts = _int(row, "num_experts", 0, low=0)
    if not experts:
        return {}
    return {"num_experts": experts, "experts_per_token": _int(row, "experts_per_token", 2),
            "moe_ffn_hidden_size": _int(row, "moe_ffn_hidden", ffn)}


def _imbalance(row: dict[str, str]) -> float:
    """Optional column expert_imbalance: the busiest expert-parallel rank's share of routed rows
    over the mean (1 for runs with forced-balanced routing); empty: the planner's default."""
    return _number(row, "expert_imbalance", float, DEFAULT_EXPERT_IMBALANCE, 1.0, MAX_EXPERT_IMBALANCE)


def attention_kernel(row: dict[str, str]) -> AttentionKernel:
    """A row may say `attention` (flash/eager). Otherwise runs published before FlashAttention
    existed (arXiv ids before 2205, May 2022) used materialised-softmax attention."""
    stated = (row.get("attention") or "").strip()
    if stated:
        return AttentionKernel(stated)
    arxiv = _ARXIV_ID.search(row.get("source", ""))
    if arxiv and (int(arxiv[1]), int(arxiv[2])) < FLASH_ATTENTION_ARXIV_ID:
        return AttentionKernel.EAGER
    return AttentionKernel.FLASH


def _options(row: dict[str, str], model: ModelSpec, tp: int, pp: int, dp: int,
             global_batch: int) -> tuple[dict[str, list[Any]], set[str]]:
    """Candidate values for every fillable field: the stated one, or all sensible ones."""
    stated_sp = (row.get("sp") or "").strip().lower()
    rc = (row.get("recompute") or "").strip()
    per_replica = global_batch // dp
    opts = {
        "micro_batch": [_int(row, "micro_batch")] if row.get("micro_batch", "").strip()
        else [d for d in divisors(per_replica) if d <= MAX_MICRO_BATCH],
        "recompute": [Recompute(rc)] if rc else list(Recompute),
        "vpp": _vpp_options(row, model, pp),
        "sp": [stated_sp in ("yes", "true", "1")] if stated_sp else ([False, True] if tp > 1 else [False]),
        "zero_stage": [_int(row, "zero_stage", low=0, high=3)] if row.get("zero_stage", "").strip()
        else sorted(_framework_zero_stages(row, pp)),
    }
    fillable = {k for k in opts if not (row.get(k) or "").strip()}
    return opts, fillable | ({"vpp"} if _says_interleaved(row) else set())


ZERO_STAGES = frozenset({0, 1, 2, 3})
# The export target whose ZeRO rules a row's framework follows (planner.exports: ZERO_STAGES,
# ZERO_STAGES_WITH_PP); Megatron-DeepSpeed pipelines with DeepSpeed's PipelineEngine.
_RULES_OF = {"megatron-core": megatron, "deepspeed": deepspeed, "megatron-deepspeed": deepspeed,
             "torchtitan": torchtitan}
# Megatron-LM before Megatron-Core: its distributed optimizer (ZeRO-1) alone, no FSDP
_MEGATRON_LM_ZERO_STAGES = frozenset({0, 1})


def _framework_zero_stages(row: dict[str, str], pp: int) -> frozenset[int]:
    """What an unstated zero_stage may be filled with: the stages the row's framework runs under
    its pipeline (every stage for a framework the table does not know)."""
    name = (row.get("framework") or "").strip().lower()
    if name == "megatron-lm":
        return _MEGATRON_LM_ZERO_STAGES
    rules = _RULES_OF.get(name)
    alone = getattr(rules, "ZERO_STAGES", None) or ZERO_STAGES
    with_pp = getattr(rules, "ZERO_STAGES_WITH_PP", None) or alone
    return with_pp if pp > 1 else alone


# A vpp cell for a source that names the interleaved schedule without its number of virtual stages
INTERLEAVED_VPP = "interleaved"


def _says_interleaved(row: dict[str, str]) -> bool:
    return (row.get("vpp") or "").strip().lower() == INTERLEAVED_VPP


def _vpp_options(row: dict[str, str], model: ModelSpec, pp: int) -> list[int]:
    """The stated V; `interleaved` (V unstated): every V >= 2 that splits the layers into equal
    chunks, with or without the embedding and the loss counted (what the published runs' Megatron
    versions ran; an explicit layout came later); empty (the schedule unstated too): those and 1."""
    interleavings = virtual_stage_options(model.num_layers, pp)
    if _says_interleaved(row):
        if not interleavings:
            raise UserError(f"row {row['id']!r}: vpp = {INTERLEAVED_VPP} but {model.num_layers} layers "
                            f"over pp = {pp} leave no interleaving (pp >= 2 and pp x V chunks of equal layers)")
        return interleavings
    if (row.get("vpp") or "").strip():
        return [_int(row, "vpp")]
    return [1] + interleavings


# What the published frameworks' pipelines run: 1F1B, or interleaved 1F1B with virtual stages
# (none of them ran a zero-bubble schedule); our own runtime runs them all.
PUBLISHED_SCHEDULES = frozenset({Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED})


def _schedules(row: dict[str, str]) -> frozenset[Schedule]:
    """The schedules the row's pipeline may have run: interleaved 1F1B alone where it says so."""
    return frozenset({Schedule.INTERLEAVED}) if _says_interleaved(row) else PUBLISHED_SCHEDULES


SEARCH_FIELDS = {"micro_batch": "micro_batch_size", "recompute": "recompute", "vpp": "vpp",
                 "sp": "sequence_parallel", "zero_stage": "zero_stage"}


def best_plan_for_row(row: dict[str, str], model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
                      time_limit_s: float = 20.0) -> tuple[Plan, Estimate, dict[str, Any]]:
    """The planner's own search fills the unstated fields with every stated one fixed (and the
    schedules the framework offers); its best plans (FRAMEWORK_LAYOUTS) are then laid out as the
    framework runs them (equal layers per stage, every layer of the chosen recompute mode
    recomputed, Megatron's rank order) and the fastest that fits is kept.
    When no plan fits, the enumeration below finds the one that overflows least (OOM rows)."""
    tp, pp, cp, ep = _int(row, "tp"), _int(row, "pp"), _int(row, "cp", 1), _int(row, "ep", 1)
    dp = _int(row, "dp", cluster.world_size // (tp * pp * cp))
    if problem := world_problem(dp, tp, pp, cp, cluster.world_size):   # dp 0: tp*pp*cp above num_gpus
        raise UserError(f"row {row['id']!r}: {problem}")
    deadline = time.perf_counter() + time_limit_s
    opts, fillable = _options(row, model, tp, pp, dp, train.global_batch_size)
    stated = {SEARCH_FIELDS[k]: v[0] for k, v in opts.items() if k not in fillable}
    # a ZeRO stage left unstated is searched among those the framework runs: one search each
    # where that is not every stage (the search's own ZeRO choice knows no framework)
    zeros = [{}] if set(opts["zero_stage"]) == ZERO_STAGES or "zero_stage" not in fillable else \
        [{"zero_stage": z} for z in opts["zero_stage"]]
    found = []
    for zero in zeros:
        # the table has no offload column: none of its runs kept states or activations on the host
        fixed = {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "ep": ep, **stated, **zero,
                 "offload_optimizer": False, "offload_activations": False, "fp8_linears": train.float8}
        options = SearchOptions(top_k=FRAMEWORK_LAYOUTS, fixed=fixed, max_tp=max(tp, cluster.devices_per_node),
                                time_limit_s=time_limit_s / len(zeros), schedules=_schedules(row), error_band=0.0)
        found += search(model, train, cluster, options).plans
    found.sort(key=lambda f: f.estimate.step_time_s)
    if found:
        # plans differing only in their split or rank order lay out alike: each choice once
        laid_out = [_as_framework_runs(model, train, cluster, choice)
                    for choice in dict.fromkeys(_choice_of(f.plan) for f in found)]
        fitting = [pair for pair in laid_out if pair[1].fits]
        if fitting:
            plan, est = min(fitting, key=lambda pair: pair[1].step_time_s)
        else:  # the framework's layout overflows where the search's split fits
            plan, est = found[0].plan, found[0].estimate
    else:
        plan, est = _least_overflow(row, model, train, cluster, opts, (tp, pp, cp, dp, ep), deadline)
    filled = {"micro_batch": plan.micro_batch_size, "recompute": str(plan.recompute),
              "vpp": plan.vpp, "sp": plan.sequence_parallel, "zero_stage": plan.zero_stage}
    return plan, est, {k: v for k, v in filled.items() if k in fillable}


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
                  micro_batch_size=plan.micro_batch_size, vpp=plan.vpp, fp8_linears=plan.fp8_linears)


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
    for mb, rc, vpp, sp, zero in itertools.product(*opts.values()):
        if best is not None and time.perf_counter() > deadline:
            break
        choice = Choice(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, zero_stage=zero, recompute=rc,
                        sequence_parallel=sp, micro_batch_size=mb, vpp=vpp, fp8_linears=train.float8)
        try:
            plan = build_plan(model, train, cluster, choice)
        except ValueError:
            continue
        if check_plan(model, train, cluster, plan, memory=False):
            continue
        est = estimate(model, train, cluster, plan)
        if best is None or est.max_peak_memory_bytes < best[0]:
            best = (est.max_peak_memory_bytes, plan, est)
    if best is None:
        raise UserError(f"row {row['id']!r}: no valid plan for the stated fields")
    return best[1], best[2]


ROW_SEARCH_LIMIT_S = 20.0   # a row's search for its unstated fields


def validate_row(row: dict[str, str], time_limit_s: float = ROW_SEARCH_LIMIT_S) -> RowResult:
    model, train, cluster = row_specs(row)
    plan, est, filled = best_plan_for_row(row, model, train, cluster, time_limit_s=time_limit_s)
    metric, raw = row["metric_name"].strip(), row["metric_value"].strip()
    if metric == "status":
        predicted = "fits" if est.fits else "OOM"
        return RowResult(id=row["id"], metric=metric, published=raw, predicted=predicted,
                         error_pct=None, fits=est.fits, filled=filled, plan=plan, estimate=est)
    if metric == "iteration_time_s":
        predicted = est.step_time_s
    elif metric == "tokens_per_sec_per_gpu":
        predicted = est.tokens_per_s / cluster.world_size
    else:
        raise UserError(f"row {row['id']!r}: unknown metric_name {metric!r}")
    published = float(raw)
    return RowResult(id=row["id"], metric=metric, published=published, predicted=predicted,
                     error_pct=100.0 * (predicted - published) / published, fits=est.fits,
                     filled=filled, plan=plan, estimate=est)


def _step_time(result: RowResult, row: dict[str, str], which: str) -> float:
    return metric_step_time_s(row, float(getattr(result, which)))


def metric_step_time_s(row: dict[str, str], value: float) -> float:
    """A value of the row's metric (published or predicted) as a step time: an iteration time
    as it is, tokens/s per GPU as the global batch's tokens over the whole run's rate."""
    if row["metric_name"].strip() == "iteration_time_s":
        return value
    tokens = _int(row, "global_batch") * _int(row, "seq_len")
    return tokens / (value * _int(row, "num_gpus"))


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties), by scipy; None where it is
    undefined (fewer than two rows, or a column of one value)."""
    from scipy.stats import spearmanr
    if len(xs) < 2 or len(set(xs)) < 2 or len(set(ys)) < 2:
        return None
    return float(spearmanr(xs, ys).statistic)


def summarize(results: list[RowResult], rows: list[dict[str, str]]) -> dict[str, Any]:
    timed = [(r, row) for r, row in zip(results, rows) if r.error_pct is not None]
    status = [r for r in results if r.error_pct is None]
    errors = [abs(r.error_pct) for r, _ in timed]
    return {
        "n": len(timed),
        "mape_pct": sum(errors) / len(errors) if errors else None,   # None: no timed row (JSON null)
        "max_abs_error_pct": max(errors) if errors else None,
        "spearman": spearman([_step_time(r, row, "predicted") for r, row in timed],
                             [_step_time(r, row, "published") for r, row in timed]),
        "num_status_rows": len(status),
        "num_status_correct": sum(1 for r in status if (r.published == "OOM") == (not r.fits)),
        "profile_problems": profile_range_problems(rows),
        "generic_frameworks": generic_frameworks(rows),
    }


def generic_frameworks(rows: list[dict[str, str]]) -> dict[str, int]:
    """Rows per framework name the model does not know (empty: unstated), which are priced with
    the generic traits (costmodel.frameworks.GENERIC): said, so that nobody reads their errors as
    the framework's."""
    found: dict[str, int] = {}
    for row in rows:
        if not framework_known(name := (row.get("framework") or "").strip()):
            found[name] = found.get(name, 0) + 1
    return found


def profile_range_problems(rows: list[dict[str, str]]) -> list[str]:
    """The fitted efficiencies of the rows' device profiles that lie outside their published
    ranges or at a bound (costmodel.hardware.range_problems): where the fit hides a mechanism."""
    devices = {}
    for row in rows:
        device = resolve_device(row["gpu"].strip())
        devices.setdefault(device.name, device)
    return [p for name in sorted(devices) for p in range_problems(devices[name])]


def default_runs_path() -> Path:
    """The calibration table shipped with the profiles it calibrates."""
    return profile_dir() / "runs" / "published_runs.csv"


def validate(path: Path, time_limit_s: float = 600.0) -> tuple[list[RowResult], dict[str, Any]]:
    """Every row, within `time_limit_s` in all (each row's search gets what is left, at most
    ROW_SEARCH_LIMIT_S), or an UserError saying where it stopped."""
    numbered = read_numbered_runs(path)
    results = []
    deadline = time.perf_counter() + time_limit_s
    for line, row in numbered:
        left = deadline - time.perf_counter()
        if left <= 0:
            raise UserError(f"{path}: stopped at --time-limit {time_limit_s:g} s after {len(results)} of "
                             f"{len(numbered)} rows (rows with unstated fields are searched); raise it")
        try:
            results.append(validate_row(row, min(ROW_SEARCH_LIMIT_S, left)))
        except ValueError as exc:
            raise UserError(f"{path} line {line}: {exc}") from None
    return results, summarize(results, [row for _, row in numbered])
