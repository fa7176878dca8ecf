"""What several subcommands share: the flags that describe a model, its training and a cluster,
and one plan; building the specs and the plan from them; JSON on stdout; writing a report."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from costmodel.hardware import DEFAULT_MEMORY_HEADROOM, ClusterSpec, float8_devices
from costmodel.hardware.profile_check import LINK_BYTES_PER_S_RANGE
from costmodel.inputs import MAX_GLOBAL_BATCH, MAX_LAYERS, MAX_SEQ_LEN, UserError
from costmodel.plan import DEFAULT_AXIS_ORDER, PlanFile, Recompute
from costmodel.registry import has_recipe
from costmodel.schedules import Schedule
from costmodel.specs import (
    DEFAULT_EXPERT_IMBALANCE,
    AttentionKernel,
    DType,
    ModelSpec,
    PositionKind,
    TrainSpec,
)
from planner import outputs
from planner.args import (
    DEGREE,
    at_least_one,
    float_in,
    fraction,
    int_in,
    refuse_ignored,
)
from planner.space import Choice
from planner.specs import FP8, build_specs


def add_train_args(p: argparse.ArgumentParser, cluster: bool = True) -> None:
    """The model, cluster and training flags. Without `cluster` (a sweep sizes its own clusters)
    --cluster and --group-link stay out of --help and are refused by the command in one line."""
    p.add_argument("--model", help="registry name (see `planner models`) or path to a HF config.json")
    shown = (lambda text: text) if cluster else (lambda text: argparse.SUPPRESS)
    p.add_argument("--cluster", help=shown("NODESxGPUS_PER_NODExDEVICE, e.g. 8x8xA100 (see `planner devices`); a mixed "
                                     "cluster joins groups with '+', e.g. 4x8xA100+4x8xH100 (same devices per node: "
                                     "each pipeline stage runs on one group, layers split by each group's speed and "
                                     "memory; without a pipeline each data-parallel replica runs on one group, "
                                     "its micro-batch size the group's)"))
    low, high = (b / 1e9 for b in LINK_BYTES_PER_S_RANGE)
    p.add_argument("--group-link", type=float_in(low, high, " GB/s"), metavar="GB_PER_S",
                   help=shown("mixed clusters: the link between the groups in GB/s per device and direction "
                              "(default: the slowest group's own inter-node link); pipeline sends and the gradient "
                              "collectives of replicas on different groups cross it"))
    p.add_argument("--seq-len", type=int_in(1, MAX_SEQ_LEN), help="tokens per sequence (default: the model's published recipe)")
    p.add_argument("--global-batch", type=int_in(1, MAX_GLOBAL_BATCH), help="sequences per optimizer step (default: published recipe)")
    p.add_argument("--dtype", choices=[d.value for d in DType] + [FP8], default="bf16",
                   help="compute precision; 16-bit implies fp32 master weights (default bf16). fp8: bf16 "
                        "training whose layers' linear projections may run in float8 (torchao's tensorwise "
                        f"recipe; devices with float8 tensor cores: {float8_devices()}): search weighs float8 "
                        "against bf16 linears per plan, predict prices them in float8")
    p.add_argument("--grad-dtype", choices=[d.value for d in DType], default="fp32",
                   help="gradient accumulation/reduction precision (default fp32, as Megatron-LM)")
    p.add_argument("--attention", choices=[a.value for a in AttentionKernel], default="flash",
                   help="attention kernel (default flash)")
    p.add_argument("--expert-imbalance", type=at_least_one, default=DEFAULT_EXPERT_IMBALANCE, metavar="F",
                   help="mixtures of experts under expert parallelism: routed tokens of the busiest EP rank "
                        f"over the mean, >= 1 (default {DEFAULT_EXPERT_IMBALANCE}: dropless Mixtral 8x22B on "
                        "Megatron-Core runs 4.5%% slower than with forced balance)")
    p.add_argument("--memory-headroom", type=fraction, default=DEFAULT_MEMORY_HEADROOM, metavar="F",
                   help="share of the device memory CUDA reports that plans leave free, beyond the context, "
                        f"NCCL and allocator fragmentation the profile counts (default {DEFAULT_MEMORY_HEADROOM})")


def add_framework_arg(p: argparse.ArgumentParser) -> None:
    from planner.targets import NAMES
    p.add_argument("--framework", choices=NAMES, default=None,
                   help="the framework that will run the plan: planner (the included runtime, `planner run`; "
                        "the default), megatron (Megatron-LM on Megatron-Core), torchtitan or deepspeed. Plans "
                        "are then only those it runs as they are (its schedules, layer splits, recomputation, "
                        "ZeRO stages, rank orders), priced as it runs them (costmodel/frameworks.py)")
    p.add_argument("--recompute-modules", type=_module_names, default=(), metavar="M,M,...",
                   help="--framework megatron: what its selective recomputation re-runs, Megatron-Core's "
                        "--recompute-modules (default core_attn, the attention core): core_attn, mla_up_proj (latent "
                        "attention's up-projections: DeepSeek-V3's recipes), mlp (a dense layer's MLP), moe_act "
                        "(the experts' activation), layernorm; plans recomputing selectively are priced and "
                        "exported with these, e.g. mla_up_proj,mlp")


    p.add_argument("--ep-overlap", action="store_true",
                   help="--framework megatron, a mixture of experts: overlap each expert all-to-all with another "
                        "micro-batch's compute, Megatron-Core's --overlap-moe-expert-parallel-comm (its Qwen3 and "
                        "DeepSeek-V3 recipes). Plans are then those it runs with it: expert parallelism, no full "
                        "recomputation, interleaved where pipelined; priced with the overlap (and without "
                        "Transformer Engine's TP overlap, which its recipes leave off beside it) and exported so")


def _module_names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(","))


def framework_of(args: argparse.Namespace) -> str:
    from planner.targets import PLANNER
    return getattr(args, "framework", None) or PLANNER


def add_plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan (omitted degrees default to 1; --dp defaults to world/(tp*pp*cp))")
    g.add_argument("--dp", type=DEGREE)
    g.add_argument("--tp", type=DEGREE, default=1, help="tensor-parallel degree")
    g.add_argument("--pp", type=DEGREE, default=1, help="pipeline-parallel degree")
    g.add_argument("--cp", type=DEGREE, default=1, help="context-parallel degree")
    g.add_argument("--ep", type=DEGREE, default=1,
                   help="expert-parallel degree (mixtures of experts; divides the number of experts): each "
                        "layer's experts sharded over the ep innermost of the tp x cp x dp ranks (MoE parallel "
                        "folding: the included runtime, --framework megatron and torchtitan), or under --framework "
                        "deepspeed over ep consecutive data-parallel ranks (divides dp)")
    g.add_argument("--etp", type=DEGREE, default=1,
                   help="expert tensor-parallel degree (mixtures of experts, --framework megatron): each routed "
                        "expert's projections split over the etp innermost ranks, the ep group the next ones; "
                        "divides the experts' width")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=None,
                   help="0 replicated (DDP), 1 optimizer sharded, 2 +gradients, 3 +weights (FSDP) (default 1; "
                        "--framework torchtitan: 3, FSDP2's full sharding, as it runs no stage 1)")
    g.add_argument("--dp-replicate", type=DEGREE, default=1, metavar="R",
                   help="hybrid sharding (HSDP): ZeRO shards over dp/R data-parallel ranks and keeps R replicas "
                        "of each shard, the gradient shards all-reduced over them (torchtitan's "
                        "data_parallel_replicate_degree, --framework torchtitan or this planner's runtime, "
                        "--zero >= 1; Megatron-Core's --num-distributed-optimizer-instances R, --framework "
                        "megatron, --zero 1; dense models; default 1: one shard group of all dp ranks)")
    g.add_argument("--offload-optimizer", action="store_true",
                   help="keep the sharded optimizer states (fp32 master weights, moments, reduced gradients) in "
                        "host memory and step them on the host, ZeRO-Offload as FSDP2's CPUOffloadPolicy runs it; "
                        "needs --zero >= 1 and a device profile with a [host] (GPUs)")
    g.add_argument("--offload-activations", action="store_true",
                   help="copy what the layers save for backward (not their weights) to host memory and back, an "
                        "alternative to --recompute; needs a device profile with a [host] (GPUs)")
    g.add_argument("--recompute", choices=[r.value for r in Recompute], default="none",
                   help="activations recomputed in backward: none; selective, what the framework's selective "
                        "mode re-runs (ours and Megatron's: the attention core, see --recompute-modules; "
                        "torchtitan's: its per-op policy, every second matmul, on every layer); full, whole "
                        "layers (--recompute-layers how many)")
    g.add_argument("--recompute-layers", metavar="N|N,N,...",
                   help="layers recomputed per pipeline rank: one count for every rank, or one per rank as the "
                        "search prints them (rc=full[3,2,3,1] is 3,2,3,1; rc=full:8/80, 8 of each rank's 80 "
                        "layers, is 8; default: all of them)")
    g.add_argument("--layers", metavar="N,N,...",
                   help="layers per virtual stage in pipeline order, pp x vpp counts adding up to the model's "
                        "layers, as the search prints them (layers/stage 21,20,20,19; default: as even as they go, "
                        "a mixture's dense first layers on the first stage)")
    g.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallelism (default: on when tp > 1 and the framework runs it; "
                        "--framework deepspeed: off)")
    g.add_argument("--mbs", type=int_in(1, MAX_GLOBAL_BATCH), default=1, help="micro-batch size in sequences")
    g.add_argument("--vpp", type=DEGREE, default=None,
                   help="virtual stages per pipeline rank (default: the one a V-shaped --schedule has, 2; else 1)")
    g.add_argument("--schedule", choices=[s.value for s in Schedule],
                   help="pipeline schedule (default: interleaved-1f1b if vpp > 1, else 1f1b). "
                        + "; ".join(f"{s}: {s.traits.description}" for s in Schedule))
    g.add_argument("--mesh-order", default=",".join(DEFAULT_AXIS_ORDER),
                   help="mesh axes outermost first (default pp,dp,cp,tp: TP inside a node)")
    g.add_argument("--group-order", default=None, metavar="G,G,...",
                   help="mixed clusters: the order in which the --cluster groups (numbered from 0 as written) take "
                        "the pipeline's stages, e.g. 1,0 puts the second group's devices on stage 0 (default: as "
                        "written)")
    g.add_argument("--group-mbs", default=None, metavar="B,B,...",
                   help="mixed clusters without a pipeline (--pp 1): the micro-batch size of each group's data-parallel "
                        "replicas, in --cluster order, e.g. 1,3: the faster group's replicas take the larger share of "
                        "the global batch (their losses weighted by it); not with --mbs")


def specs_from_args(args: argparse.Namespace, note: bool = True) -> tuple[ModelSpec, TrainSpec, ClusterSpec]:
    """The specs the flags give; `note`: say on stderr where the cluster's nodes are smaller than
    its devices' NVLink domain (print_node_note)."""
    if empty := [flag for flag, value in (("--model", args.model), ("--cluster", args.cluster)) if value == ""]:
        raise UserError(f"{empty[0]} is empty")
    if missing := [flag for flag, value in (("--model", args.model), ("--cluster", args.cluster)) if value is None]:
        raise UserError(f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} required"
                        + (" (or --plan plan.json)" if args.command == "predict" else ""))
    specs = build_specs(args.model, args.cluster, seq_len=args.seq_len, global_batch=args.global_batch,
                        dtype=args.dtype, grad_dtype=args.grad_dtype, attention=args.attention,
                        expert_imbalance=args.expert_imbalance, memory_headroom=args.memory_headroom,
                        group_link_bytes_per_s=None if args.group_link is None else args.group_link * 1e9,
                        framework=framework_of(args), recompute_modules=getattr(args, "recompute_modules", ()),
                        ep_overlap=getattr(args, "ep_overlap", False))
    if not specs[0].is_moe:
        refuse_ignored(getattr(args, "given", {}), {"expert_imbalance"},
                       f"it loads the experts of a mixture, and {specs[0].name} is dense")
    if note:
        print_node_note(args, specs[2])
    return specs


def print_training_note(args: argparse.Namespace, model: ModelSpec, train: TrainSpec) -> None:
    """On stderr, once there is an answer (an error stays one line): a sequence length or batch
    the user left to a fallback (the model has no published recipe here), and a sequence past
    the positions a RoPE model was trained for (a learned table refuses it: costmodel.check)."""
    unstated = [flag for flag, dest in (("--seq-len", "seq_len"), ("--global-batch", "global_batch"))
                if getattr(args, dest, None) is None]
    if unstated and not has_recipe(model):
        from planner.recipes import recipes_for
        others = "".join(f"; {r.name} runs seq {r.seq_len} x global batch {r.gbs} (--seq-len {r.seq_len} "
                         f"--global-batch {r.gbs})" for r in recipes_for(model))
        print(f"planner {args.command}: note: {model.name} has no pre-training recipe of its authors here, so "
              f"{' and '.join(unstated)} take Megatron's SC'21 setting: seq {train.seq_len} x global batch "
              f"{train.global_batch_size}{others}", file=sys.stderr)
    if model.position_kind is PositionKind.ROPE and train.seq_len > model.max_position_embeddings:
        print(f"planner {args.command}: note: seq {train.seq_len:,} is past the {model.max_position_embeddings:,} "
              f"positions {model.name} was trained for: priced as given (a long-context extension's cost)",
              file=sys.stderr)


def print_node_note(args: argparse.Namespace, cluster: ClusterSpec) -> bool:
    """ClusterSpec.node_note on stderr, where there is one; whether there was."""
    if text := cluster.node_note:
        print(f"planner {args.command}: note: {text}", file=sys.stderr)
    return bool(text)


def choice_from_args(args: argparse.Namespace, zero_default: int, sp_allowed: bool) -> Choice:
    """The plan the flags give; an unset --zero is `zero_default`, an unset --sp off where the
    framework has no sequence parallelism (`sp_allowed`), else on when tp > 1."""
    if args.group_mbs is not None:
        refuse_ignored(getattr(args, "given", {}), {"mbs"}, "--group-mbs sets each group's micro-batch size")
    if args.pp == 1:
        refuse_ignored(getattr(args, "given", {}), {"group_order"}, "it orders the groups taking the pipeline's "
                       "stages, and --pp is 1")
    zero = zero_default if args.zero is None else args.zero
    sp = args.sp if args.sp is not None or sp_allowed else False
    return Choice(tp=args.tp, pp=args.pp, cp=args.cp, dp=args.dp, ep=args.ep, etp=args.etp, zero_stage=zero,
                  offload_optimizer=args.offload_optimizer, fp8_linears=args.dtype == FP8,
                  offload_activations=args.offload_activations,
                  recompute=Recompute(args.recompute), recompute_layers=_recompute_layers(args.recompute_layers),
                  layers_per_stage=parse_ints(args.layers, "--layers", "20,20,20,20"),
                  sequence_parallel=sp, micro_batch_size=args.mbs, vpp=_vpp(args),
                  schedule=Schedule(args.schedule) if args.schedule else None,
                  mesh_axis_order=tuple(a.strip() for a in args.mesh_order.split(",")),
                  group_order=parse_group_order(args.group_order),
                  micro_batch_sizes=parse_ints(args.group_mbs, "--group-mbs", "1,3"),
                  dp_replicate=args.dp_replicate)


def _recompute_layers(text: str | None) -> int | tuple[int, ...] | None:
    """--recompute-layers: one count for every pipeline rank, or one per rank."""
    counts = parse_ints(text, "--recompute-layers", "2 or 2,19,21,21")
    if min(counts, default=0) < 0 or max(counts, default=0) > MAX_LAYERS:
        raise UserError(f"--recompute-layers {text!r}: each count must be in 0..{MAX_LAYERS:,}")
    return None if not counts else counts[0] if len(counts) == 1 and "," not in text else counts


def _vpp(args: argparse.Namespace) -> int:
    """--vpp, or the one count a schedule allows (zbv and dualpipev: 2) when it is not given."""
    if args.vpp is not None:
        return args.vpp
    traits = Schedule(args.schedule).traits if args.schedule else None
    return traits.min_vpp if traits is not None and traits.min_vpp == traits.max_vpp else 1


def parse_group_order(text: str | None) -> tuple[int, ...]:
    return parse_ints(text, "--group-order", "1,0")


def parse_ints(text: str | None, flag: str, example: str) -> tuple[int, ...]:
    if text is None:
        return ()
    try:
        values = tuple(int(g) for g in text.split(","))
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected whole numbers joined by commas, e.g. {example}") from None
    if flag == "--group-mbs" and min(values) < 1:
        raise UserError(f"{flag} {text!r}: every micro-batch size must be at least 1")
    if min(values) < 0:   # a count of layers or a group's number
        raise UserError(f"{flag} {text!r}: {min(values)} is negative")
    return values


def emit_json(doc: Any) -> None:
    """`doc` on standard output as strict JSON (planner.outputs.json_text: a run that never ends
    is null; a NaN is a bug)."""
    sys.stdout.write(outputs.json_text(doc))


def write_report_dir(out: str, overwrite: bool, model, train, cluster, plan, est, **extra) -> None:
    """The report rendered beside `out` and published into it whole (planner.outputs.staged_dir)."""
    from planner import outputs
    from planner.halves import map_in_halves
    from planner.report_plans import schedule_variants
    from reports.build import ReportInput, write_report
    print(f"writing the report to {out}/ ...", file=sys.stderr)
    with outputs.staged_dir(out, overwrite, outputs.REPORT_FILES, outputs.REPORT_FIGURES) as staging:
        files = write_report(ReportInput(model=model, train=train, cluster=cluster, plan=plan, estimate=est,
                                         variants=schedule_variants(model, train, cluster, plan), **extra), staging,
                             map_draws=map_in_halves)   # the figures drawn on two cores
    print(f"wrote {len(files)} files to {out}/ (open {out}/index.html)", file=sys.stderr)


def load_plan(path: Path, command: str) -> PlanFile:
    """A plan file the user hands a command, which warns (`command`'s name first) where the
    measured profile it was priced with has changed since: its figures are priced again with the
    profile as it is now."""
    from costmodel.hardware.clusters import FINGERPRINT_KEY, profile_fingerprint
    from costmodel.inputs import read_json_object
    data = read_json_object(path, "plan file")
    pf = PlanFile.from_dict(data, str(path))
    stored = data["cluster"].get(FINGERPRINT_KEY)
    if stored is not None and stored != profile_fingerprint(pf.cluster.device):
        print(f"planner {command}: warning: the profile {pf.cluster.device.path} has changed since {path} was "
              "made (measured again, or edited): its figures are priced with the profile as it is now",
              file=sys.stderr)
    return pf
