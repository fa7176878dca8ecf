"""Megatron-LM: `pretrain_gpt.py` command-line arguments (Megatron-Core underneath).

What Megatron-LM cannot say of our plans, and the nearest it runs (each a line of the export):
- GPipe is 1F1B there; zero-bubble schedules and DualPipeV are not in Megatron-LM: ZB-H1 runs as
  1F1B, ZBV and DualPipeV (two virtual stages in a V) as interleaved 1F1B over the same chunks.
- ZeRO-2/3 are Megatron-FSDP (`--use-megatron-fsdp`), which does not run under pipeline
  parallelism: with a pipeline they become ZeRO-1 (the distributed optimizer).
- Layers: any split, with or without virtual stages. Equal (virtual) stages, equal once the
  embedding and the loss count as a layer each (`--account-for-embedding-in-pipeline-split
  --account-for-loss-in-pipeline-split`) and (one chunk per rank) first and last stages of their
  own size (`--decoder-first/last-pipeline-num-layers`) keep their familiar flags; every other
  split is Megatron-Core's explicit layout (`--pipeline-model-parallel-layout`: each virtual
  stage's layers, the embedding in the first, the loss in the last).
- Recomputation is per (virtual) stage and the same on every rank (`--recompute-num-layers` with
  the block method): per-rank counts become the largest of them on every rank.
- Rank order: tp-cp-ep-dp-pp (the default) or tp-cp-ep-pp-dp (`--use-tp-pp-dp-mapping`, which
  Megatron-LM refuses beside context or expert parallelism); other mesh orders become the default.
- Offloaded states: Megatron-Core offloads the distributed optimizer's states and step
  (`--optimizer-cpu-offload`, all of them: `--optimizer-offload-fraction 1.0`); Megatron-FSDP
  has no such option, so offloading ZeRO-2/3 become offloading ZeRO-1.
- Gradients are kept in fp32 or in the parameters' 16-bit dtype (`--grad-reduce-in-bf16`); a plan
  with other gradients is refused.
"""
from __future__ import annotations

import shlex
from functools import lru_cache

from costmodel.frameworks import FrameworkTraits, float8_params, framework_traits, tp_comm_overlaps, tp_in_one_node
from costmodel.plan import Plan, PlanFile, Recompute, embedding_loss_split
from costmodel.schedules import Schedule
from costmodel.selective_modules import DEFAULT_SELECTIVE_MODULES
from costmodel.specs import AttentionKernel, DType, ModelSpec, TrainSpec
from planner.exports.common import (
    Adjusted,
    CannotExport,
    activations_on_device,
    layout,
    on_hosts,
    one_shard_group,
    recompute_is_uniform,
    target_traits,
    to_rank_order,
    to_schedule,
    to_uniform_recompute,
)
from planner.exports.megatron_model import model_arguments

NAME = "megatron"
FRAMEWORK = "megatron-core"   # costmodel.frameworks: how the exported plan is priced
SUFFIX = ".sh"
# the ZeRO stages it runs with a pipeline: Megatron-FSDP (ZeRO-2/3) does not run with one
ZERO_STAGES_WITH_PP = frozenset({0, 1})
# our mesh orders (outermost first, axes of degree 1 left out) Megatron's rank orders give
DEFAULT_ORDER = ("pp", "dp", "cp", "tp")   # Megatron's default tp-cp-ep-dp-pp
TP_PP_DP_ORDER = ("dp", "pp", "cp", "tp")   # --use-tp-pp-dp-mapping


def nearest(pf: PlanFile) -> Adjusted:
    if pf.model.parallel_residual:
        raise CannotExport("megatron cannot run this plan: Megatron-LM has no attention and MLP in parallel "
                           "on the layer input (the model's parallel residual)")
    _refuse_gradient_dtype(pf.train)
    if pf.train.attention_kernel is AttentionKernel.EAGER and pf.plan.cp > 1:
        raise CannotExport("megatron cannot run this plan: its context parallelism runs in Transformer Engine's "
                           "fused attention only, not eager (unfused) attention")
    adj = Adjusted(pf.plan)
    if pf.plan.zero_stage != 1:   # ZeRO-1: --num-distributed-optimizer-instances
        one_shard_group(adj, "Megatron-LM", "Megatron-FSDP")
    layers = pf.model.num_layers
    plan = adj.plan
    if plan.schedule is Schedule.GPIPE:
        to_schedule(adj, layers, Schedule.ONE_F_ONE_B, 1, "schedule gpipe: Megatron-LM runs 1f1b (same bubble, "
                    "fewer micro-batches in flight)")
    elif plan.schedule is Schedule.ZB_H1:
        to_schedule(adj, layers, Schedule.ONE_F_ONE_B, 1, "schedule zb-h1: not in Megatron-LM; 1f1b instead")
    elif plan.schedule in (Schedule.ZBV, Schedule.DUALPIPEV):
        to_schedule(adj, layers, Schedule.INTERLEAVED, plan.vpp, f"schedule {plan.schedule}: not in Megatron-LM; "
                    "interleaved-1f1b with two chunks per rank, which it places on ranks r and r + p (the V on r "
                    "and 2p - 1 - r: the last layers and the head move from the first rank to the last)")
    plan = adj.plan
    if plan.zero_stage not in ZERO_STAGES_WITH_PP and plan.pp > 1:
        adj.change(f"zero {plan.zero_stage} under pipeline parallelism: Megatron-FSDP does not run with a "
                   "pipeline; ZeRO-1 (the distributed optimizer)", zero_stage=1)
    elif plan.zero_stage >= 2 and plan.offload_optimizer:
        adj.change(f"zero {plan.zero_stage} with offloaded states: Megatron-FSDP cannot offload; the "
                   "distributed optimizer's states and step on the host (ZeRO-1)", zero_stage=1)
    plan = adj.plan
    if plan.recompute is Recompute.SELECTIVE and not recompute_is_uniform(plan):
        to_uniform_recompute(adj, Recompute.SELECTIVE, "selective recomputation on some layers: Megatron-LM "
                                                       "recomputes core attention in every layer; all layers")
    elif plan.recompute is Recompute.FULL and _full_recompute_layers(plan) is None:
        # the fewest per stage that recompute at least what the plan does on every rank
        n = next(n for n in range(max(plan.layers_per_stage) + 1)
                 if all(b >= c for b, c in zip(_block_counts(plan, n), plan.recompute_num_layers)))
        adj.change(f"full recomputation of {list(plan.recompute_num_layers)} layers per rank: Megatron-LM "
                   f"recomputes the same number in every (virtual) stage; the first {n} of each",
                   recompute_num_layers=_block_counts(plan, n))
    if plan.cp > 1 or plan.ep > 1:   # validate_args: "can't be used with tp-pp-dp mapping"
        to_rank_order(adj, (DEFAULT_ORDER,), "Megatron-LM orders ranks tp-cp-ep-dp-pp beside context or expert "
                                             "parallelism (its tp-pp-dp mapping refuses them); that order")
    else:
        to_rank_order(adj, (DEFAULT_ORDER, TP_PP_DP_ORDER),
                      "Megatron-LM orders ranks tp-cp-ep-dp-pp (or tp-cp-ep-pp-dp); the default")
    activations_on_device(adj, NAME)
    return adj


def _refuse_gradient_dtype(t: TrainSpec) -> None:
    """Megatron-LM keeps gradients in the parameters' 16-bit dtype or in fp32
    (--accumulate-allreduce-grads-in-fp32, which bf16 turns on unless --grad-reduce-in-bf16)."""
    if t.grad_dtype not in (DType.FP32, t.compute_dtype):
        raise CannotExport(f"megatron cannot run this plan: it keeps gradients in fp32 or in the parameters' "
                           f"{t.compute_dtype}, not in {t.grad_dtype}")


def _precision_arguments(t: TrainSpec) -> list[tuple[str, str | None]]:
    """The compute dtype, and the gradients' where it is not Megatron's default for it."""
    if t.compute_dtype is DType.BF16:
        return [("--bf16", None)] + ([("--grad-reduce-in-bf16", None)] if t.grad_dtype is DType.BF16 else [])
    if t.compute_dtype is DType.FP16:
        return [("--fp16", None)] + ([("--accumulate-allreduce-grads-in-fp32", None)]
                                     if t.grad_dtype is DType.FP32 else [])
    return []


def _counts_embedding_and_loss(plan: Plan) -> bool:
    """Whether the split is Megatron-Core's with the embedding and the loss counted as layers
    (--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split)."""
    split = plan.layers_per_stage
    return len(set(split)) > 1 and split == embedding_loss_split(sum(split), len(split))


def _first_and_last_apart(plan: Plan) -> bool:
    """One chunk per rank, the stages between the first and the last equal, every stage holding
    a layer (--decoder-first/last-pipeline-num-layers; a stage holding the embedding, or the MTP
    modules and the loss, alone is the explicit layout's)."""
    return (plan.vpp == 1 and plan.pp > 1 and len(set(plan.layers_per_stage[1:-1])) <= 1
            and min(plan.layers_per_stage) > 0)


def pipeline_layout(plan: Plan, mtp_depth: int = 0) -> str:
    """Megatron-Core's --pipeline-model-parallel-layout of the plan's split: its virtual stages in
    Megatron's order (virtual stage v of rank r is entry v*pp + r, as Plan.layers_per_stage), `t`
    a decoder layer, `E` the embedding in the first, the multi-token-prediction modules `m` and
    the loss `L` after the decoder layers of the last (where the cost model prices them)."""
    stages = [f"t*{n}" if n > 1 else "t" * n for n in plan.layers_per_stage]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "m" * mtp_depth + "L"
    return "|".join(stages)


def _block_counts(plan: Plan, n: int) -> tuple[int, ...]:
    """Layers each rank recomputes when every (virtual) stage recomputes its first n."""
    return _blocks(plan.layers_per_stage, plan.pp, plan.vpp, n)


def _blocks(layers_per_stage: tuple[int, ...], pp: int, vpp: int, n: int) -> tuple[int, ...]:
    return tuple(sum(min(n, layers_per_stage[v * pp + r]) for v in range(vpp)) for r in range(pp))


def _full_recompute_layers(plan: Plan) -> int | None:
    """Megatron's --recompute-num-layers (block method: the first N layers of every virtual
    stage) that recomputes what the plan does on every rank, or None."""
    return _block_layers(plan.layers_per_stage, plan.pp, plan.vpp, plan.recompute_num_layers)


@lru_cache(maxsize=4096)   # asked of every full-recompute plan the search checks: few distinct splits
def _block_layers(layers_per_stage: tuple[int, ...], pp: int, vpp: int, counts: tuple[int, ...]) -> int | None:
    return next((n for n in range(max(layers_per_stage) + 1) if _blocks(layers_per_stage, pp, vpp, n) == counts),
                None)


def arguments(pf: PlanFile, plan: Plan) -> list[tuple[str, str | None]]:
    """(flag, value or None for a switch), in Megatron-LM's spelling."""
    m, t = pf.model, pf.train
    return [*model_arguments(pf, plan, framework_traits(FRAMEWORK)),
            ("--tensor-model-parallel-size", str(plan.tp)), ("--pipeline-model-parallel-size", str(plan.pp)),
            *_layout_arguments(m, plan), *_parallel_arguments(pf, plan), *_data_parallel_arguments(pf, plan),
            *_recompute_arguments(pf, plan),
            ("--micro-batch-size", str(plan.micro_batch_size)), ("--global-batch-size", str(t.global_batch_size)),
            *_precision_arguments(t), *_kernel_arguments(pf, plan),
            ("--tokenizer-type", "NullTokenizer"), ("--vocab-size", str(m.vocab_size)),
            ("--make-vocab-size-divisible-by", str(vocab_divisor(m.vocab_size, plan.tp))), ("--mock-data", None),
            *RUN_LENGTH]


def _layout_arguments(m: ModelSpec, plan: Plan) -> list[tuple[str, str | None]]:
    """The layer split: Megatron's even one (with the embedding and the loss counted, or not),
    the first and last stages apart, or an explicit layout."""
    if _counts_embedding_and_loss(plan):
        args = [("--account-for-embedding-in-pipeline-split", None), ("--account-for-loss-in-pipeline-split", None)]
        return args + ([("--num-virtual-stages-per-pipeline-rank", str(plan.vpp))] if plan.vpp > 1 else [])
    if plan.pp > 1 and len(set(plan.layers_per_stage)) == 1:
        return [("--num-layers-per-virtual-pipeline-stage", str(plan.layers_per_stage[0]))] if plan.vpp > 1 else []
    if _first_and_last_apart(plan):
        return [("--decoder-first-pipeline-num-layers", str(plan.layers_per_stage[0])),
                ("--decoder-last-pipeline-num-layers", str(plan.layers_per_stage[-1]))]
    if plan.pp > 1:
        return [("--pipeline-model-parallel-layout", pipeline_layout(plan, m.mtp_depth))]
    return []


def _parallel_arguments(pf: PlanFile, plan: Plan) -> list[tuple[str, str | None]]:
    """CP, SP, Transformer Engine's TP overlap where it was priced, and the rank order."""
    args: list[tuple[str, str | None]] = []
    if plan.cp > 1:
        args += [("--context-parallel-size", str(plan.cp))]
    if plan.sequence_parallel and plan.tp > 1:
        args += [("--sequence-parallel", None)]
    if tp_comm_overlaps(_traits(pf), pf.cluster.device.tp_comm_gemm_overlap, plan.tp,
                        plan.sequence_parallel, tp_within_node=tp_in_one_node(plan.tp, pf.cluster.devices_per_node)):
        args += [("--tp-comm-overlap", None)]
    if layout(plan, plan.mesh_axis_order) == layout(plan, TP_PP_DP_ORDER) != layout(plan, DEFAULT_ORDER):
        args += [("--use-tp-pp-dp-mapping", None)]
    return args


def _data_parallel_arguments(pf: PlanFile, plan: Plan) -> list[tuple[str, str | None]]:
    """ZeRO: the distributed optimizer (ZeRO-1, its instances, its host offload) or Megatron-FSDP
    (ZeRO-2/3), each with its overlaps; the expert all-to-all overlap where the plan file sets it."""
    if plan.zero_stage == 1:
        args = [("--use-distributed-optimizer", None), ("--overlap-grad-reduce", None),
                ("--overlap-param-gather", None)]
        if plan.dp_replicate > 1:   # instances of (dp x cp) / R consecutive data-parallel ranks
            args += [("--num-distributed-optimizer-instances", str(plan.dp_replicate))]
        if plan.offload_optimizer:   # Megatron's argument checks want the precision-aware optimizer with it
            args += [("--optimizer-cpu-offload", None), ("--optimizer-offload-fraction", "1.0"),
                     ("--use-precision-aware-optimizer", None)]
    elif plan.zero_stage >= 2:
        strategy = "optim_grads" if plan.zero_stage == 2 else "optim_grads_params"
        # Megatron-FSDP saves and loads only its own checkpoint format (validate_args asserts it)
        args = [("--use-megatron-fsdp", None), ("--data-parallel-sharding-strategy", strategy),
                ("--overlap-grad-reduce", None), ("--overlap-param-gather", None), ("--ckpt-format", "fsdp_dtensor")]
    else:
        args = [("--overlap-grad-reduce", None)]
    if _traits(pf).ep_a2a_overlap:   # Megatron-Core's expert all-to-all overlap, as priced
        args += [("--overlap-moe-expert-parallel-comm", None)]
    return args


def _recompute_arguments(pf: PlanFile, plan: Plan) -> list[tuple[str, str | None]]:
    if plan.recompute is Recompute.SELECTIVE:
        args: list[tuple[str, str | None]] = [("--recompute-granularity", "selective")]
        if (modules := pf.cluster.framework.selective_modules) != DEFAULT_SELECTIVE_MODULES:
            args += [("--recompute-modules", " ".join(modules))]
        return args
    if plan.recompute is Recompute.FULL:
        return [("--recompute-granularity", "full"), ("--recompute-method", "block"),
                ("--recompute-num-layers", str(_full_recompute_layers(plan)))]
    return []


def _kernel_arguments(pf: PlanFile, plan: Plan) -> list[tuple[str, str | None]]:
    """Unfused attention and float8 linears, as priced."""
    args: list[tuple[str, str | None]] = []
    if pf.train.attention_kernel is AttentionKernel.EAGER:   # scores materialised, as priced
        args += [("--attention-backend", "unfused")]
    if plan.fp8_linears:   # Transformer Engine: e4m3 forward, e5m2 gradients, a current scale per tensor
        args += [("--fp8-format", "hybrid"), ("--fp8-recipe", "tensorwise")]
        if float8_params(plan, _traits(pf)):   # weights kept and gathered in float8, as NVIDIA's
            args += [("--fp8-param-gather", None)]     # float8 recipes run
    return args


def vocab_divisor(vocab_size: int, tp: int) -> int:
    """Megatron pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP (128 x TP
    by default: 129,024 rows for Llama 3's 128,256 at TP 8); the largest divisor up to 128 that
    leaves it unpadded, so the run's embedding and head are the ones priced (1 where TP does not
    divide it: padded to a multiple of TP, each rank's share rounded up as the model prices it)."""
    return next((d for d in range(128, 0, -1) if vocab_size % (d * tp) == 0), 1)


# A throughput run's length and learning rate: pretrain_gpt.py stops on a missing --train-iters
# (update_train_iters divides --train-samples, None) and --lr (the scheduler compares it with
# --min-lr); no evaluation on the mock data, step times logged every ten iterations
RUN_LENGTH = [("--train-iters", "100"), ("--eval-iters", "0"), ("--lr", "0.0003"), ("--lr-decay-style", "constant"),
              ("--log-interval", "10"), ("--log-throughput", None)]


def _traits(pf: PlanFile) -> FrameworkTraits:
    """The traits the exported plan is priced with (common.target_traits)."""
    return target_traits(pf, FRAMEWORK)


def _connections(pf: PlanFile, plan: Plan) -> str | None:
    """CUDA_DEVICE_MAX_CONNECTIONS the run needs: 32 for the expert all-to-all overlap's streams
    (Megatron-LM's argument checks warn below it; the Megatron-MoE model zoo and Megatron-Bridge
    set 32), 1 where _one_connection says, else the driver's default."""
    if _traits(pf).ep_a2a_overlap:
        return "32"
    return "1" if _one_connection(plan) else None


def _one_connection(plan: Plan) -> bool:
    """Whether the run needs CUDA_DEVICE_MAX_CONNECTIONS=1: validate_args asserts it under tensor
    or context parallelism unless Megatron-FSDP (our ZeRO-2/3) runs, which wants more queues
    (megatron/training/arguments.py; the kernels of a TP collective and of its GEMM then keep
    their launch order)."""
    return (plan.tp > 1 or plan.cp > 1) and plan.zero_stage < 2


# flags of several values (argparse nargs), written space-separated in arguments()
_LIST_FLAGS = frozenset({"--recompute-modules"})


def _connections_lines(connections: str | None) -> list[str]:
    if connections is None:
        return []
    why = ("Megatron-LM's argument checks require it with TP or CP (before Blackwell) and without Megatron-FSDP"
           if connections == "1" else "the expert all-to-all overlap runs its communication on streams of its own")
    return [f"# {why}", f"export CUDA_DEVICE_MAX_CONNECTIONS={connections}"]


def render(pf: PlanFile, plan: Plan) -> tuple[str, str]:
    c = pf.cluster
    hosts, per_host = c.launch_hosts
    lines = ["#!/usr/bin/env bash",
             f"# Megatron-LM run of {plan.short()} for {pf.model.name} on {c.num_nodes}x{c.devices_per_node} "
             f"{c.device.name} (planner export). Run on {on_hosts(hosts, per_host)} from a Megatron-LM checkout, with",
             "# NODE_RANK and MASTER_ADDR set; replace --mock-data and the NullTokenizer with your data, and the",
             "# 100 iterations at a constant learning rate (a throughput run) with your schedule.",
             "set -euo pipefail",
             *_connections_lines(_connections(pf, plan)),
             f"torchrun --nnodes {hosts} --nproc-per-node {per_host} --node-rank \"${{NODE_RANK:-0}}\" "
             "--master-addr \"${MASTER_ADDR:-localhost}\" --master-port 29500 \\",
             "    pretrain_gpt.py \\"]
    args = arguments(pf, plan)
    for i, (flag, value) in enumerate(args):
        end = " \\" if i < len(args) - 1 else ""
        words = [] if value is None else value.split(" ") if flag in _LIST_FLAGS else [value]
        lines.append(f"    {' '.join([flag, *map(shlex.quote, words)])}{end}")
    return "\n".join(lines) + "\n", f"bash FILE on {on_hosts(hosts, per_host)} with NODE_RANK and MASTER_ADDR set, from a Megatron-LM checkout"
