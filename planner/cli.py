"""The `planner` command line. User mistakes become one line on stderr and exit code 2."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from costmodel.check import check_memory, check_structure, float8_device_problem
from costmodel.hardware import DEFAULT_MEMORY_HEADROOM, ClusterSpec, known_profiles, parse_cluster
from costmodel.groups import views
from costmodel.machine import LocalProfileMissing
from costmodel.measured import MeasuredRun
from costmodel.estimate import estimate
from costmodel.fidelity import MODEL_ERROR_BAND
from costmodel.params import active_params, total_params
from costmodel.plan import DEFAULT_AXIS_ORDER, PlanFile, Recompute, Schedule
from costmodel.registry import MODELS, default_recipe, model_names, resolve_model
from costmodel.specs import DEFAULT_EXPERT_IMBALANCE, AttentionKernel, DType, ModelSpec, TrainSpec
from costmodel.units import GIB
from planner import outputs
from planner.args import (EXIT_USAGE, Parser, add_failure_args, at_least_one, add_overwrite_arg, failures_from_args, fraction,
                          given_flags, non_negative_int, positive_float, positive_int, refuse_ignored, refuse_repeated)
from planner.signals import Terminated, held_while_loading, terminate_as_exception
from planner.space import Choice, build_plan

FP8 = "fp8"   # --dtype fp8: bf16 beside float8 linears (TrainSpec.float8), not a DType of its own

# predict --plan takes all of these from the file
SPEC_AND_PLAN_FLAGS = {"model", "cluster", "seq_len", "global_batch", "dtype", "grad_dtype", "attention",
                       "memory_headroom", "dp", "tp", "pp", "cp", "zero", "recompute", "recompute_layers",
                       "sp", "mbs", "vpp", "schedule", "mesh_order", "offload_optimizer", "offload_activations"}

EPILOG_PREDICT = """examples:
  planner predict --model llama-70b --cluster 8x8xA100 --tp 8 --pp 4 --zero 1 --recompute selective --mbs 1
  planner predict --model llama3-8b --cluster 1x8xH100 --tp 2 --json
  planner predict --plan plan.json            (the specs recorded in the plan file)
"""


class UserError(Exception):
    """A mistake in what the user asked for: printed as one line, exit code 2."""


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="registry name (see `planner models`) or path to a HF config.json")
    p.add_argument("--cluster", help="NODESxGPUS_PER_NODExDEVICE, e.g. 8x8xA100 (see `planner devices`); a mixed "
                                     "cluster joins groups with '+', e.g. 4x8xA100+4x8xH100 (same devices per node: "
                                     "each pipeline stage runs on one group, layers split by each group's speed and "
                                     "memory; without a pipeline each data-parallel replica runs on one group, "
                                     "its micro-batch size the group's)")
    p.add_argument("--group-link", type=positive_float, metavar="GB_PER_S",
                   help="mixed clusters: the link between the groups in GB/s per device and direction (default: "
                        "the slowest group's own inter-node link); pipeline sends and the gradient collectives of "
                        "replicas on different groups cross it")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default: the model's published recipe)")
    p.add_argument("--global-batch", type=positive_int, help="sequences per optimizer step (default: published recipe)")
    p.add_argument("--dtype", choices=[d.value for d in DType] + [FP8], default="bf16",
                   help="compute precision; 16-bit implies fp32 master weights (default bf16). fp8: bf16 "
                        "training whose layers' linear projections may run in float8 (torchao's tensorwise "
                        "recipe; devices with float8 tensor cores: H100, H200, B200): search weighs float8 "
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


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("plan (omitted degrees default to 1; --dp defaults to world/(tp*pp*cp))")
    g.add_argument("--dp", type=positive_int)
    g.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree")
    g.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel degree")
    g.add_argument("--cp", type=positive_int, default=1, help="context-parallel degree")
    g.add_argument("--ep", type=positive_int, default=1,
                   help="expert-parallel degree (mixtures of experts): each layer's experts sharded over "
                        "ep consecutive data-parallel ranks; divides dp and the number of experts")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=1,
                   help="0 replicated (DDP), 1 optimizer sharded, 2 +gradients, 3 +weights (FSDP)")
    g.add_argument("--offload-optimizer", action="store_true",
                   help="keep the sharded optimizer states (fp32 master weights, moments, reduced gradients) in "
                        "host memory and step them on the host, ZeRO-Offload as FSDP2's CPUOffloadPolicy runs it; "
                        "needs --zero >= 1 and a device profile with a [host] (GPUs)")
    g.add_argument("--offload-activations", action="store_true",
                   help="copy what the layers save for backward (not their weights) to host memory and back, an "
                        "alternative to --recompute; needs a device profile with a [host] (GPUs)")
    g.add_argument("--recompute", choices=[r.value for r in Recompute], default="none")
    g.add_argument("--recompute-layers", type=non_negative_int,
                   help="layers recomputed per pipeline rank (default: all of them)")
    g.add_argument("--sp", action=argparse.BooleanOptionalAction, default=None,
                   help="sequence parallelism (default: on when tp > 1)")
    g.add_argument("--mbs", type=positive_int, default=1, help="micro-batch size in sequences")
    g.add_argument("--vpp", type=positive_int, default=1, help="virtual stages per pipeline rank")
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
                        "the global batch (their losses weighted by it); --mbs is then ignored")


def _specs(args: argparse.Namespace) -> tuple[ModelSpec, TrainSpec, ClusterSpec]:
    if not args.model or not args.cluster:
        raise UserError("--model and --cluster are required"
                        + (" (or --plan plan.json)" if args.command == "predict" else ""))
    link = None if args.group_link is None else args.group_link * 1e9
    model, cluster = resolve_model(args.model), parse_cluster(args.cluster, link)
    cluster = dataclasses.replace(cluster, memory_headroom=args.memory_headroom)
    seq, batch = default_recipe(model)
    float8 = args.dtype == FP8
    if float8 and (problem := next(filter(None, (float8_device_problem(v.device) for v in views(cluster))), None)):
        raise UserError(f"--dtype fp8: {problem}")
    train = TrainSpec(seq_len=seq if args.seq_len is None else args.seq_len,
                      global_batch_size=batch if args.global_batch is None else args.global_batch,
                      compute_dtype=DType.BF16 if float8 else DType(args.dtype), grad_dtype=DType(args.grad_dtype),
                      float8=float8,
                      attention_kernel=AttentionKernel(args.attention),
                      expert_load_imbalance=args.expert_imbalance)
    return model, train, cluster


def _choice(args: argparse.Namespace) -> Choice:
    return Choice(tp=args.tp, pp=args.pp, cp=args.cp, dp=args.dp, ep=args.ep, zero_stage=args.zero,
                  offload_optimizer=args.offload_optimizer, fp8_linears=args.dtype == FP8,
                  offload_activations=args.offload_activations,
                  recompute=Recompute(args.recompute), recompute_layers=args.recompute_layers,
                  sequence_parallel=args.sp, micro_batch_size=args.mbs, vpp=args.vpp,
                  schedule=Schedule(args.schedule) if args.schedule else None,
                  mesh_axis_order=tuple(a.strip() for a in args.mesh_order.split(",")),
                  group_order=_group_order(args.group_order),
                  micro_batch_sizes=_ints(args.group_mbs, "--group-mbs", "1,3"))


def _group_order(text: str | None) -> tuple[int, ...]:
    return _ints(text, "--group-order", "1,0")


def _ints(text: str | None, flag: str, example: str) -> tuple[int, ...]:
    if text is None:
        return ()
    try:
        values = tuple(int(g) for g in text.split(","))
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected whole numbers joined by commas, e.g. {example}") from None
    if flag == "--group-mbs" and min(values) < 1:
        raise UserError(f"{flag} {text!r}: every micro-batch size must be at least 1")
    return values


def _emit_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2)
    sys.stdout.write("\n")


def cmd_predict(args: argparse.Namespace) -> int:
    if not args.out:
        refuse_ignored(args.given, {"overwrite"}, "without --out nothing is written")
    out = outputs.out_file(args.out, "--out", args.overwrite, ".json")
    if args.plan:
        refuse_ignored(args.given, SPEC_AND_PLAN_FLAGS, "--plan takes the model, cluster, training and plan "
                       "from the file (leave out --plan to give them as flags)")
        pf = PlanFile.load(Path(args.plan))
        model, train, cluster, plan = pf.model, pf.train, pf.cluster, pf.plan
    else:
        model, train, cluster = _specs(args)
        plan = build_plan(model, train, cluster, _choice(args))
    problems = check_structure(model, train, cluster, plan)
    if problems:
        raise UserError("invalid plan: " + "; ".join(problems))
    est = estimate(model, train, cluster, plan)
    if out:
        PlanFile(plan=plan, model=model, train=train, cluster=cluster).save(out)
        print(f"wrote {out}", file=sys.stderr)
    if args.json:
        from costmodel.resilience import checkpoint_cost
        _emit_json({"plan": plan.to_dict(), "estimate": est.to_dict(), "error_band": MODEL_ERROR_BAND,
                    "checkpoint": checkpoint_cost(model, train, cluster.world_size, est.step_time_s,
                                                  est.tokens_per_s, failures_from_args(args)).to_dict()})
    else:
        from reports.tables import ledger_table, memory_table, summary_lines
        print(summary_lines(model, train, cluster, plan, est, failures_from_args(args)))
        print()
        print(ledger_table(est))
        print()
        print(memory_table(est))
    over = check_memory(model, train, cluster, plan)
    if over:
        raise UserError("plan does not fit: " + "; ".join(over))
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    from costmodel.resilience import checkpoint_cost
    from planner.commands.search import check_outputs, run_search, why_runner_up_lost
    check_outputs(args)
    model, train, cluster = _specs(args)
    result = run_search(args, model, train, cluster)
    stats = result.stats
    best = result.plans[0]
    runner_up_text = why_runner_up_lost(best, result.plans[1]) if len(result.plans) > 1 else ""
    if args.report:   # with --json too: stdout holds the JSON, the report goes to its directory
        _write_report(args.report, model, train, cluster, best.plan, best.estimate,
                      runners_up=[(f.plan, f.estimate) for f in result.plans[1:]],
                      candidates=[f.estimate for f in result.evaluated], runner_up_text=runner_up_text)
    exported = _export_best(args, model, train, cluster, best.plan)
    if args.json:
        _emit_json({"plans": [{"plan": f.plan.to_dict(), "estimate": f.estimate.to_dict()} for f in result.plans],
                    "search": {**stats.to_dict(), "equivalent_plans": result.equivalent,
                               "error_band": result.error_band, "offloaded_because": result.offloaded_because,
                               "fastest": None if result.fastest is None else
                               {"plan": result.fastest.plan.to_dict(), "estimate": result.fastest.estimate.to_dict()}},
                    # the first plan's checkpoint interval and throughput with failures (costmodel.resilience)
                    "checkpoint": checkpoint_cost(model, train, cluster.world_size, best.estimate.step_time_s,
                                                  best.estimate.tokens_per_s, failures_from_args(args)).to_dict(),
                    **({} if exported is None else {"export": exported})})
        return 0
    from reports.tables import search_table, summary_lines
    print(summary_lines(model, train, cluster, best.plan, best.estimate, failures_from_args(args)))
    print()
    print(search_table(result.plans, cluster))
    print()
    fastest = result.fastest or best
    if stats.optimal:
        proof = "proven optimal under the cost model (closed-form pipeline; the top plans re-priced by simulation)"
    elif not stats.enumerated:
        proof = ("NOT proven optimal (stopped at --time-limit while the space was still being listed: "
                 "no bound on the rest; raise --time-limit)")
    else:
        proof = (f"NOT proven optimal (stopped at --time-limit; no unexamined plan is faster than "
                 f"{stats.lower_bound_s:.3f} s in closed form, gap "
                 f"{100 * ((fastest.estimate.closed_form_step_time_s or fastest.estimate.step_time_s) / stats.lower_bound_s - 1):.1f}%)")
    label = "fastest plan"
    proven = result.proven_fastest
    if proven is not None and proven.plan != fastest.plan:
        print(f"fastest plan ({fastest.plan.short()}, {fastest.estimate.step_time_s:.3f} s): "
              f"{fastest.plan.schedule} has no closed form, so it was priced by simulation as a variant "
              f"of the best closed-form plans, outside the proof below")
        label, fastest = "fastest closed-form plan", proven
    print(f"{label} ({fastest.plan.short()}, {fastest.estimate.step_time_s:.3f} s) {proof}, "
          f"within the model's measured error of +-{100 * result.error_band:.1f}% "
          f"(leave-one-source-out on published runs): {stats.num_candidates:,} candidates, "
          f"{stats.num_solved:,} solved exactly, {stats.num_feasible:,} feasible, {stats.wall_s:.2f} s")
    if result.offloaded_because:
        print(f"the host holds what the devices cannot: {result.offloaded_because} (on-device plans are "
              "searched first; --fix offload=yes|no and --fix act_offload=yes|no decide from the start)")
    if result.equivalent > 1:
        print(f"{result.equivalent} plans within +-{100 * result.error_band:.1f}% of the fastest are equivalent "
              f"under that error: the first is the most robust (memory headroom, "
              f"fewer moving parts)")
    if runner_up_text:
        print(runner_up_text)
    if exported is not None:
        print()
        if exported["file"] is None:
            print(exported["text"], end="")
        print("\n".join(exported["summary"]))
    return 0


def _export_best(args: argparse.Namespace, model, train, cluster, plan) -> dict | None:
    """search --export TARGET: the best plan in that framework's configuration (written to
    --export-out when given); None without --export."""
    if not args.export:
        return None
    from planner.commands.export import summary_lines, to_json
    from planner.exports import export_plan
    from costmodel.inputs import write_text_atomic
    pf = PlanFile(plan=plan, model=model, train=train, cluster=cluster)
    result = export_plan(pf, args.export)
    if args.export_out is not None:
        write_text_atomic(args.export_out, result.text)
    return {**to_json(result, pf, args.export_out), "summary": summary_lines(result, pf, args.export_out)}


def _write_report(out: str, model, train, cluster, plan, est, **extra) -> None:
    from planner.report_plans import schedule_variants
    from reports.build import ReportInput, write_report
    print(f"writing the report to {out}/ ...", file=sys.stderr)
    files = write_report(ReportInput(model=model, train=train, cluster=cluster, plan=plan, estimate=est,
                                     variants=schedule_variants(model, train, cluster, plan), **extra), Path(out))
    print(f"wrote {len(files)} files to {out}/ (open {out}/index.html)", file=sys.stderr)


def cmd_report(args: argparse.Namespace) -> int:
    outputs.out_dir(args.out, "--out", args.overwrite, outputs.REPORT_FILES)
    pf = PlanFile.load(Path(args.plan))
    problems = check_structure(pf.model, pf.train, pf.cluster, pf.plan)
    if problems:
        raise UserError(f"{args.plan} is not a valid plan: " + "; ".join(problems))
    measured = None
    if args.measured:
        measured = MeasuredRun.load(Path(args.measured))
        if measured.plan != pf.plan.to_dict():
            raise UserError(f"{args.measured} was measured for another plan ({measured.plan})")
    est = estimate(pf.model, pf.train, pf.cluster, pf.plan)
    _write_report(args.out, pf.model, pf.train, pf.cluster, pf.plan, est, measured=measured)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from planner.validate import default_runs_path, validate
    results, summary = validate(Path(args.runs) if args.runs else default_runs_path(), args.time_limit)
    if args.json:
        _emit_json({"rows": [r.to_dict() for r in results], "summary": summary})
    else:
        from reports.tables import validate_table
        print(validate_table(results, summary))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    rows = []
    for name in model_names():
        m = MODELS[name]
        rows.append({"name": name, "params": total_params(m), "active_params": active_params(m),
                     "experts": f"{m.experts_per_token}/{m.num_experts}" if m.is_moe else "",
                     "layers": m.num_layers,
                     "hidden": m.hidden_size, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
                     "ffn": m.ffn_hidden_size, "vocab": m.vocab_size, "arch": str(m.arch),
                     "source": m.source})
    if args.json:
        _emit_json({"models": rows})
        return 0
    from reports.tables import table
    print(table(("model", "params", "active", "experts", "layers", "hidden", "heads/kv", "ffn", "vocab", "source"),
                [(r["name"], f"{r['params'] / 1e9:,.2f}B", f"{r['active_params'] / 1e9:,.2f}B", r["experts"],
                  r["layers"], r["hidden"], f"{r['heads']}/{r['kv_heads']}", r["ffn"], r["vocab"], r["source"])
                 for r in rows]))
    print("\nmixtures of experts (experts: per token / in all): expert parallelism --ep N carved from dp; under "
          "tensor parallelism (with SP) each TP rank keeps the whole mixture (expert TP 1)")
    print("\naliases: llama-70b -> llama2-70b, llama-7b, llama-13b, gpt3; or --model path/to/config.json")
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    profiles = known_profiles()
    rows = [{"name": p.name, "aliases": list(p.aliases), "peak_flops_per_s": p.peak_flops_per_s,
             "memory_bytes": p.memory_bytes, "memory_bandwidth_bytes_per_s": p.memory_bandwidth_bytes_per_s,
             "intra_node_bytes_per_s": p.intra_node.bandwidth_bytes_per_s,
             "inter_node_bytes_per_s": p.inter_node.bandwidth_bytes_per_s, "profile": p.path}
            for p in profiles.values()]
    if args.json:
        _emit_json({"devices": rows})
        return 0
    from reports.tables import table
    print(table(("device", "aliases", "bf16 TFLOP/s", "memory GiB", "HBM GB/s", "node GB/s", "net GB/s"),
                [(r["name"], ",".join(r["aliases"]), f"{r['peak_flops_per_s'].get('bf16', 0) / 1e12:,.1f}",
                  f"{r['memory_bytes'] / GIB:.0f}", f"{r['memory_bandwidth_bytes_per_s'] / 1e9:,.0f}",
                  f"{r['intra_node_bytes_per_s'] / 1e9:,.0f}", f"{r['inter_node_bytes_per_s'] / 1e9:,.1f}")
                 for r in rows]))
    print("\nbandwidths are per device, per direction; a path to a .toml profile works as a device")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="planner", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Plan, predict, run, measure and calibrate parallel training of large language models.",
        epilog="start with: planner search --model llama-70b --cluster 8x8xA100 --report reports/llama-70b")
    parser.add_argument("--version", action="version", version=f"planner {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    raw = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("predict", help="estimate one plan: step time ledger and memory per stage",
                       epilog=EPILOG_PREDICT, formatter_class=raw)
    _add_train_args(p)
    _add_plan_args(p)
    p.add_argument("--plan", help="read the plan and its specs from plan.json instead")
    p.add_argument("--out", help="write the plan with its specs to this plan.json")
    add_overwrite_arg(p)
    p.add_argument("--json", action="store_true",
                   help='print {"plan", "estimate", "error_band", "checkpoint"} as JSON on stdout')
    add_failure_args(p)
    p.set_defaults(parser=p, func=cmd_predict)

    p = sub.add_parser("search", help="the fastest plan that fits, exact under the cost model",
                       formatter_class=raw, epilog="""examples:
  planner search --model llama3-8b --cluster 1x8xH100
  planner search --model llama-70b --cluster 8x8xA100 --fix pp=4 --zero 1 --top 10 --out plan.json
  planner search --model llama-70b --cluster 8x8xA100 --objective memory --json
  planner search --model llama-70b --cluster 4x8xA100+4x8xH100 --report reports/mixed   (a mixed cluster)""")
    _add_train_args(p)
    from planner.commands.search import add_search_args
    add_search_args(p)
    add_failure_args(p)
    p.set_defaults(parser=p, func=cmd_search)

    p = sub.add_parser("validate", help="predicted vs published step time for measured runs (CSV)",
                       description="Empty plan cells are filled with the planner's best choice; "
                                   "status=OOM rows are right when the plan is predicted not to fit.")
    p.add_argument("runs", nargs="?", default=None,
                   help="table in the format of profiles/runs/published_runs.csv (default: that table)")
    p.add_argument("--json", action="store_true", help='print {"rows", "summary"} as JSON')
    p.add_argument("--time-limit", type=positive_float, default=600.0, metavar="S",
                   help="stop after S seconds in all with one line (default 600; a row with unstated "
                        "fields is searched for up to 20 s)")
    p.set_defaults(parser=p, func=cmd_validate)

    p = sub.add_parser("report", help="bubble and memory report of a plan (PNG/SVG, index.html/md)",
                       formatter_class=raw, epilog="""examples:
  planner report plan.json --out reports/my-plan
  planner report plan.json --measured runs/x/measured.json --out reports/my-plan   (predicted beside measured)""")
    p.add_argument("plan", help="plan.json (from search --out or predict --out)")
    p.add_argument("--measured", help="measured.json from `planner run` of this plan")
    p.add_argument("--out", required=True, help="directory for the report")
    add_overwrite_arg(p)
    p.set_defaults(parser=p, func=cmd_report)

    from planner.commands.profile import EPILOG as PROFILE_EPILOG, add_profile_args, cmd_profile
    p = sub.add_parser("profile", help="measure this machine (GEMM, memory, collectives) into a device profile",
                       epilog=PROFILE_EPILOG, formatter_class=raw)
    add_profile_args(p)
    p.set_defaults(parser=p, func=cmd_profile)

    from planner.commands.calibrate import EPILOG as CAL_EPILOG, add_calibrate_args, cmd_calibrate
    p = sub.add_parser("calibrate", help="fit a profile's efficiencies to measured runs (writes a new profile)",
                       epilog=CAL_EPILOG, formatter_class=raw)
    add_calibrate_args(p)
    p.set_defaults(parser=p, func=cmd_calibrate)

    from planner.commands.export import EPILOG as EXPORT_EPILOG, add_export_args, cmd_export
    p = sub.add_parser("export", help="a plan as torchtitan, Megatron-LM or DeepSpeed take it (nearest plan where "
                                      "they cannot say it)", epilog=EXPORT_EPILOG, formatter_class=raw)
    add_export_args(p)
    p.set_defaults(parser=p, func=cmd_export)

    from planner.commands.run import EPILOG as RUN_EPILOG, add_run_args, cmd_run
    p = sub.add_parser("run", help="execute a plan with torch.distributed, measure it, compare with the estimate",
                       epilog=RUN_EPILOG, formatter_class=raw)
    add_run_args(p)
    p.set_defaults(parser=p, func=cmd_run)

    for name, func, text in (("models", cmd_models, "list the known models"),
                             ("devices", cmd_devices, "list the known device profiles")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--json", action="store_true")
        p.set_defaults(parser=p, func=func)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("planner")
    except PackageNotFoundError:   # run from a source tree that was never installed
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    who = f"planner {argv[0]}" if argv and not argv[0].startswith("-") else "planner"
    try:
        with terminate_as_exception():
            with held_while_loading():
                parser = build_parser()
            try:
                args, extra = parser.parse_known_args(argv)
                if extra:   # said by the subcommand, whose --help lists what it takes
                    args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
            except SystemExit as exc:   # --help (0) or a usage error, already printed (2)
                return exc.code if isinstance(exc.code, int) else EXIT_USAGE
            return _dispatch(args, argv)
    except KeyboardInterrupt as exc:
        return _interrupted(who, exc, "interrupted", 130)
    except Terminated as exc:
        return _interrupted(who, exc, "terminated", 143)


def _interrupted(who: str, exc: BaseException, what: str, code: int) -> int:
    notes = "; ".join(getattr(exc, "__notes__", []))
    print(f"{who}: {what}" + (f"; {notes}" if notes else ""), file=sys.stderr)
    return code


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        args.given = given_flags(args.parser, argv[1:])
        refuse_repeated(args.parser, args.given)
        try:
            return args.func(args)
        except LocalProfileMissing as missing:
            # `local` is this machine: measured on first use, cached, then the command again
            print(f"planner {args.command}: {missing.reason}; measuring this machine once "
                  f"(about a minute, cached in {missing.path})", file=sys.stderr)
            from planner.commands.profile import measure_local
            measure_local()
            return args.func(args)
    except argparse.ArgumentError as exc:
        print(f"planner {args.command}: error: {exc} (see planner {args.command} --help)", file=sys.stderr)
        return EXIT_USAGE
    except (UserError, ValueError) as exc:
        print(f"planner {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # the reader (e.g. `| head`) closed early: not an error; silence the flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
