"""The calibration table's rows (profiles/runs/README.md): reading and checking the CSV, one
boundary that names the file, the line and the field; and a row read as the specs it describes
(model, training, cluster with the inter-node network it states), priced with the traits of the
framework that ran it and judged against the device's hard memory limit.
"""
from __future__ import annotations

import csv
import io
import re
import sys
from dataclasses import replace
from pathlib import Path

from costmodel.hardware import ClusterSpec, parse_cluster, profile_dir, run_by
from costmodel.inputs import UserError, read_text
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
from planner.measure.cells import choice_cell, flag_cell, int_cell, number_cell, published_before
from planner.measure.instances import Instance, instance_in_notes
from planner.measure.row_traits import FLASH_1, row_traits
from planner.specs import FP8

REQUIRED = ("id", "arch", "layers", "hidden", "heads", "vocab", "seq_len", "gpu", "num_gpus",
            "gpus_per_node", "tp", "pp", "global_batch", "metric_name", "metric_value")
# every other column a row may fill (the rest of the plan is searched where empty); source, notes,
# framework, confidence and memory_kind are the row's provenance, read by people
OPTIONAL = ("source", "framework", "confidence", "notes", "model", "ffn_hidden", "kv_heads", "num_experts",
            "experts_per_token", "moe_ffn_hidden", "expert_imbalance", "dropout", "dp", "dp_replicate", "vpp",
            "sp", "cp", "ep", "zero_stage", "recompute", "micro_batch", "precision", "grad_dtype", "attention",
            "fp8_param_gather", "compiled", "async_tp", "dp_overlap", "grad_accumulation_fusion", "vendor_attention",
            "node_network_gbps", "memory_gb", "memory_kind",
            "dispatcher", "layers_per_stage", "ep_overlap", "recompute_modules", "offload_optimizer",
            "offload_activations", "zero3_prefetch_bucket", "zero3_max_live", "rms_norm", "cuda_graph")
# What a published step can measure: a microsecond to 11 days a step, a thousandth of a token to
# a billion tokens a second per GPU. Beyond them an error in percent overflows (a step of 1e308 s
# read as -inf %) or means nothing (1e-300 s: +3.7e301 %).
METRIC_RANGES = {"iteration_time_s": (1e-6, 1e6), "tokens_per_sec_per_gpu": (1e-3, 1e9)}
# FlashAttention (arXiv 2205.14135) reached the training frameworks only at the end of 2022
# (Megatron-LM's integration, NVIDIA/Megatron-LM#267; BigScience's Megatron-DeepSpeed port #357,
# never merged; DeepSpeed's request #2552, still open then): a run an arXiv paper describes before
# 2023 trained without it. Papers from 2023 on describe runs with a fused kernel (LLaMA's xformers
# kernel, 2302.13971; Pythia's FlashAttention, 2304.01373) or state eager (the PyTorch FSDP paper's
# GPT-175B, 2304.11277: the runs table's `attention` column)
FLASH_IN_FRAMEWORKS_ARXIV_ID = (2301, 0)
# Selective recomputation and sequence parallelism came with Korthikanti et al. (arXiv 2205.05198)
# and Megatron-LM's release of them; a run a paper describes before it had neither mode
SELECTIVE_AND_SP_ARXIV_ID = (2205, 5198)


def read_runs(path: Path) -> list[dict[str, str]]:
    return [row for _, row in read_numbered_runs(path)]


def read_numbered_runs(path: Path) -> list[tuple[int, dict[str, str]]]:
    """(line in the file, row) for every run, by the line it starts on, checked; errors name the
    file and the line (the lines, where a quoted cell runs over several: an unclosed quote)."""
    text = read_text(path, "runs table")
    numbered, ends = [], {}
    try:
        # a row a spreadsheet cut short of its trailing empty cells reads them as empty
        reader = csv.DictReader(io.StringIO(text, newline=""), restval="")
        # the lines as csv reads them (a quoted cell may hold any other line break), the header's last
        end, lines = 1, io.StringIO(text, newline="").readlines()
        for row in reader:   # blank lines and quoted newlines counted
            start, end = _first_line(lines, end), reader.line_num
            numbered.append((start, row))
            ends[start] = end
        header = reader.fieldnames or []
    except csv.Error as exc:
        raise UserError(f"runs table {path} is not a readable CSV file ({exc})") from None
    missing = [c for c in REQUIRED if c not in header]
    if missing:
        raise UserError(f"{path}: missing columns {', '.join(missing)}")
    twice = sorted({c for c in header if c.strip() and header.count(c) > 1})
    if twice:   # csv keeps the last cell of a name: the first would go unread
        raise UserError(f"{path}: column{'s' if len(twice) > 1 else ''} {', '.join(map(repr, twice))} "
                        f"appear{'' if len(twice) > 1 else 's'} more than once in the header")
    for line, row in numbered:
        if any(c.strip() for c in row.get(None) or ()):   # DictReader's key for cells past the header's
            raise UserError(f"{_lines(path, line, ends[line])}: {len(header) + len(row[None])} cells, the header "
                            f"names {len(header)}")
    if not numbered:
        raise UserError(f"{path}: no runs (only a header)")
    _check_end(path, text, len(header), numbered[-1][0], ends[numbered[-1][0]])
    seen: set[str] = set()
    for line, row in numbered:
        _check_row(path, line, row, ends[line])
        if row["id"] in seen:
            raise UserError(f"{path} line {line}: duplicate id {row['id']!r}")
        seen.add(row["id"])
    unknown = [c for c in header if c.strip() and c not in REQUIRED + OPTIONAL]
    if unknown:   # a misspelt column leaves its values unread (the plan searched instead): said, not
        # refused, since a table may carry columns of its own (a source's extra figures)
        print(f"note: {path}: column{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} not read "
              f"(the columns read: {', '.join(REQUIRED + OPTIONAL)})", file=sys.stderr)
    return numbered


def _check_end(path: Path, text: str, num_columns: int, last_line: int, last_end: int) -> None:
    """A table cut short (a copy or a download stopped early) reads as a shorter last row, its
    last cell cut: refused where the file says so, ending inside a quoted cell or without a line
    break after a row of fewer cells than the header's (a short row that ends its line is a
    spreadsheet's, read with empty cells)."""
    try:
        list(csv.reader(io.StringIO(text, newline=""), strict=True))
    except csv.Error as exc:
        if "unexpected end of data" in str(exc):
            if last_end > last_line:   # the row's lines say where the quote opened
                raise UserError(f"{_lines(path, last_line, last_end)}: the file ends inside it (truncated?)") from None
            raise UserError(f"{path} line {last_line}: the file ends inside a quoted cell (truncated? an unclosed "
                            "quote?)") from None
    if text.endswith(("\n", "\r")):
        return
    *_, last = csv.reader(io.StringIO(text, newline=""))
    if len(last) < num_columns and any(cell.strip() for cell in last):   # a line of spaces: _check_row's
        raise UserError(f"{path} line {last_line}: the last row holds {len(last)} of the header's {num_columns} "
                        "cells and the file ends without a line break (truncated? if the row is whole, end "
                        "the file with a line break)")


def _first_line(lines: list[str], after: int) -> int:
    """The line a row starts on: the first after line `after` (the previous row's last) with
    anything on it, a space included (DictReader skips only empty lines)."""
    line = after + 1
    while line <= len(lines) and not lines[line - 1].rstrip("\r\n"):
        line += 1
    return line


def _lines(path: Path, start: int, end: int) -> str:
    """Where a row is: its line, or its lines and why a row would span several."""
    if end <= start:
        return f"{path} line {start}"
    return f"{path} lines {start}-{end} (one row: a quoted cell runs over {end - start + 1} lines; an unclosed quote?)"


def _check_row(path: Path, line: int, row: dict[str, str], end: int) -> None:
    """Every required cell present, and a metric that can be compared."""
    where = f"{_lines(path, line, end)} (row {row.get('id')!r})"
    empty = [c for c in REQUIRED if not (row.get(c) or "").strip()]
    if empty:
        raise UserError(f"{where}: empty {', '.join(empty)} (required of every row, an OOM row too: the "
                        "model, cluster, tp, pp, global batch and metric; the other plan cells may be left "
                        "empty and are filled)")
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
    try:   # provenance, but a number where given
        number_cell(row, "memory_gb", float, None, 1e-3, 1e5)
    except UserError as exc:
        raise UserError(f"{path} line {line}: {exc}") from None


def row_specs(row: dict[str, str]) -> tuple[ModelSpec, TrainSpec, ClusterSpec]:
    seq = int_cell(row, "seq_len")
    try:
        model = _row_model(row, seq)
    except ValueError as exc:   # the spec's own checks, said in the table's column names
        text = str(exc).replace(f"model {row['id']!r}", f"row {row['id']!r}")
        for column, field in _STATED_FIELDS:
            text = re.sub(rf"\b{field}\b", column, text)
        raise UserError(text) from None
    precision = choice_cell(row, "precision", (*(d.value for d in DType), FP8), "bf16")
    # fp8: bf16 training whose linears ran in float8 (Transformer Engine, torchao), as --dtype fp8
    float8 = precision == FP8
    train = TrainSpec(seq_len=seq, global_batch_size=int_cell(row, "global_batch"),
                      compute_dtype=DType.BF16 if float8 else DType(precision), float8=float8,
                      grad_dtype=_grad_dtype(row, precision),
                      attention_kernel=attention_kernel(row), expert_load_imbalance=_imbalance(row))
    num_gpus, per_node = int_cell(row, "num_gpus"), int_cell(row, "gpus_per_node")
    if num_gpus % per_node:
        raise UserError(f"row {row['id']!r}: {num_gpus} GPUs is not a whole number of {per_node}-GPU nodes")
    row = {**row, "gpu": row["gpu"].strip()}   # stripped as every other cell is
    if row["gpu"].lower() == "local":   # a published run ran on a named device, not on this machine
        raise UserError(f"row {row['id']!r}: gpu 'local' is this machine; a published run names its device")
    try:
        cluster = parse_cluster(f"{num_gpus // per_node}x{per_node}x{row['gpu']}")
    except UserError as exc:
        raise UserError(f"row {row['id']!r}: gpu: {exc}") from None
    if cluster.device.peak_flops_per_s.get(str(train.compute_dtype), 0) <= 0:
        has = " or ".join(d for d, peak in cluster.device.peak_flops_per_s.items() if peak > 0)
        raise UserError(f"row {row['id']!r}: precision {precision}: {cluster.device.name} has no "
                        f"{train.compute_dtype} in its profile ({has})")
    # priced with the traits of the framework that ran it (unknown names: generic traits) and
    # judged against the hard limit (what CUDA reports, less the context and NCCL reserve): the
    # question is whether the run as published fits, not whether we would plan that close to
    # the edge; the headroom and fragmentation margins are for the plans we emit
    cluster = run_by(_with_fabric(cluster, row), row_traits(row, cluster, model))
    device = cluster.device
    hard = replace(device, efficiency=replace(device.efficiency, allocator_fragmentation=0.0))
    return model, train, replace(cluster, device=hard, memory_headroom=0.0)


def _row_model(row: dict[str, str], seq: int) -> ModelSpec:
    """The model a row states: a registry name (column model) or its architecture columns."""
    if (row.get("model") or "").strip():
        return _named_model(row, seq)
    hidden, heads = int_cell(row, "hidden"), int_cell(row, "heads")
    common = dict(layers=int_cell(row, "layers"), hidden=hidden, heads=heads, vocab=int_cell(row, "vocab"),
                  ffn=int_cell(row, "ffn_hidden", 4 * hidden), source=f"published run {row['id']}")
    if row["arch"] == Arch.GPT:
        if stated := [c for c in _EXPERT_COLUMNS if (row.get(c) or "").strip()]:
            raise UserError(f"row {row['id']!r}: {', '.join(stated)} describe a mixture of experts, which only "
                            "llama rows have (arch = gpt is a dense GPT)")
        # grouped-query attention where kv_heads says so (Nemotron-4's LayerNorm GPT)
        model = replace(gpt_spec(row["id"], max_pos=seq, **common), num_kv_heads=int_cell(row, "kv_heads", heads))
        dropout = flag_cell(row, "dropout", framework_name(row) not in WITHOUT_DROPOUT_FRAMEWORKS)
        return model if dropout else replace(model, dropout=False)
    if row["arch"] == Arch.LLAMA:
        return llama_spec(row["id"], kv_heads=int_cell(row, "kv_heads", heads), max_pos=seq, **common,
                          **_experts(row, common["ffn"]))
    raise UserError(f"row {row['id']!r}: arch {row['arch']!r} is neither gpt nor llama")


# Frameworks whose GPT configurations train without dropout, so a GPT row of theirs without a
# dropout column is priced without it (elsewhere Megatron's default 0.1): llm-foundry's MPT
# configurations, which composer-fsdp runs, set attn_pdrop, resid_pdrop and emb_pdrop to 0
WITHOUT_DROPOUT_FRAMEWORKS = frozenset({"composer-fsdp"})


def framework_name(row: dict[str, str]) -> str:
    """The row's framework column as the tables compare it (stripped, lower case; empty: unstated)."""
    return (row.get("framework") or "").strip().lower()


# a node's network as sources state it, in Gbit/s; a bound that keeps every later division finite
MAX_NODE_NETWORK_GBPS = 1e6


def node_network_gbps(row: dict[str, str]) -> float | None:
    """The node's network to other nodes where the source states one other than the device
    profile's, Gbit/s per direction shared by its GPUs: the optional column node_network_gbps
    (e.g. IBM's FSDP runs over 400 and 800 Gbit/s per node against a DGX's 8 NICs of 200 for an
    A100 or 400 for an H100), else that of the cloud instance the row's notes name
    (instance_from_notes); None: the profile's."""
    gbps = number_cell(row, "node_network_gbps", float, None, 1.0, MAX_NODE_NETWORK_GBPS)
    if gbps is None and (instance := instance_from_notes(row)):
        return instance.node_network_gbps
    return gbps


def instance_from_notes(row: dict[str, str]) -> Instance | None:
    """The cloud instance whose network a row is priced over: one its notes name
    (planner.measure.instances), where no node_network_gbps cell states the network."""
    if (row.get("node_network_gbps") or "").strip():
        return None
    return instance_in_notes(row.get("notes") or "")


def _with_fabric(cluster: ClusterSpec, row: dict[str, str]) -> ClusterSpec:
    """The cluster over the row's network between nodes (node_network_gbps)."""
    if (gbps := node_network_gbps(row)) is None:
        return cluster
    dev = cluster.device
    per_device = gbps * 1e9 / 8 / cluster.devices_per_node
    inter = replace(dev.inter_node, name=f"{gbps:g} Gbit/s a node", bandwidth_bytes_per_s=per_device)
    return replace(cluster, device=replace(dev, inter_node=inter))


def _grad_dtype(row: dict[str, str], precision: str) -> DType:
    """The dtype gradients accumulate and reduce in (optional column grad_dtype) unless the run's
    configuration says otherwise (Megatron-Core's grad_reduce_in_fp32=False, as NeMo's performance
    recipes and MLPerf set it, keeps a bf16 gradient buffer): fp32 where Megatron-LM forces it
    (bf16 training turns accumulate_allreduce_grads_in_fp32 on), the parameters' fp16 in an fp16
    run (that flag stays off; DeepSpeed's fp16 optimizer and FSDP's mixed precision reduce in the
    parameters' dtype)."""
    default = DType.FP16.value if precision == DType.FP16.value else DType.FP32.value
    return DType(choice_cell(row, "grad_dtype", ("fp32", "bf16", "fp16"), default))


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


_EXPERT_COLUMNS = ("num_experts", "experts_per_token", "moe_ffn_hidden")


def _experts(row: dict[str, str], ffn: int) -> dict[str, int]:
    """A mixture of experts (optional columns num_experts, experts_per_token, moe_ffn_hidden):
    every layer's MLP routed, expert width ffn_hidden unless stated."""
    experts = int_cell(row, "num_experts", 0, low=0)
    if not experts:
        if stated := [c for c in _EXPERT_COLUMNS[1:] if (row.get(c) or "").strip()]:
            raise UserError(f"row {row['id']!r}: {', '.join(stated)} without num_experts (a dense model has none)")
        return {}
    return {"num_experts": experts, "experts_per_token": int_cell(row, "experts_per_token", 2),
            "moe_ffn_hidden_size": int_cell(row, "moe_ffn_hidden", ffn)}


def _imbalance(row: dict[str, str]) -> float:
    """Optional column expert_imbalance: the busiest expert-parallel rank's share of routed rows
    over the mean (1 for runs with forced-balanced routing); empty: the planner's default."""
    return number_cell(row, "expert_imbalance", float, DEFAULT_EXPERT_IMBALANCE, 1.0, MAX_EXPERT_IMBALANCE)


def attention_kernel(row: dict[str, str]) -> AttentionKernel:
    """A row may say `attention` (flash/flash1/eager). Otherwise runs an arXiv paper published before
    the training frameworks had FlashAttention (ids before 2301: FLASH_IN_FRAMEWORKS_ARXIV_ID) used
    materialised-softmax attention."""
    stated = choice_cell(row, "attention", (*(k.value for k in AttentionKernel), FLASH_1), "")
    if stated:
        return AttentionKernel.FLASH if stated == FLASH_1 else AttentionKernel(stated)
    return AttentionKernel.EAGER if published_before(row, FLASH_IN_FRAMEWORKS_ARXIV_ID) else AttentionKernel.FLASH


def metric_step_time_s(row: dict[str, str], value: float) -> float:
    """A value of the row's metric (published or predicted) as a step time: an iteration time
    as it is, tokens/s per GPU as the global batch's tokens over the whole run's rate."""
    if row["metric_name"].strip() == "iteration_time_s":
        return value
    tokens = int_cell(row, "global_batch") * int_cell(row, "seq_len")
    return tokens / (value * int_cell(row, "num_gpus"))


def default_runs_path() -> Path:
    """The calibration table shipped with the profiles it calibrates."""
    return profile_dir() / "runs" / "published_runs.csv"
