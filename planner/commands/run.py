"""`planner run plan.json`: execute a plan with the runtime, measure it, compare with the estimate.

torch and the runtime are imported inside the command (lazily), so the other commands stay light.
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import re
import sys
import time
from pathlib import Path

from costmodel.check import check_memory, check_structure
from costmodel.check_levers import fp8_problems
from costmodel.frameworks import RUNTIME
from costmodel.inputs import UserError
from costmodel.plan import PlanFile
from costmodel.units import GIB
from planner import outputs, run_lock
from planner.args import (
    Stopped,
    failures_from_args,
    refuse_ignored,
)
from planner.commands.common import emit_json, load_plan
from planner.commands.run_args import (
    CHECKPOINT_FLAGS,
    DRY_RUN_IGNORES,
    FAILURE_FLAGS,
    PRINT_LAUNCH_IGNORES,
)
from planner.commands.run_dirs import RunRefused, copy_plan, held_dirs
from runtime.launch import PARTIAL
from runtime.measure import priced_as_run

# a rank's refusal of the checkpoints --resume hands it (runtime.checkpoint.CheckpointRefused,
# whose checksums only the ranks compare), as runtime.launch's failure message words it: a fault
# of the input, said as one line with exit 2
CHECKPOINT_REFUSED = re.compile(r"rank \d+ failed(?: at [^:]*)?: CheckpointRefused: (.*)", re.DOTALL)
# a container image reference as the distribution spec's grammar reads one: a registry (a host
# with a dot or a port, or localhost) before lower-case path components, a tag of at most 128
# word characters, dots and dashes, a digest of any algorithm
_DOMAIN = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)"
_PATH = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_REFERENCE = re.compile(rf"(?:(?:localhost|{_DOMAIN}(?:\.{_DOMAIN})+|{_DOMAIN}(?:\.{_DOMAIN})*:[0-9]+)/)?"
                             rf"{_PATH}(?:/{_PATH})*(?::[A-Za-z0-9_][A-Za-z0-9_.-]{{0,127}})?"
                             r"(?:@[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[A-Za-z0-9=_-]{32,})?")


def _load(path: str) -> PlanFile:
    pf = load_plan(Path(path), "run")
    problems = check_structure(pf.model, pf.train, pf.cluster, pf.plan)
    if problems:
        raise RunRefused(f"{path} is not a valid plan: " + "; ".join(problems))
    plan = pf.plan
    # planned for a framework that runs float8 where the runtime does not (experts, TP: costmodel.frameworks)
    runtime = dataclasses.replace(pf.cluster, framework=RUNTIME)
    if plan.fp8_linears and (ours := fp8_problems(pf.model, pf.train, runtime, plan.tp)):
        raise RunRefused(f"{path} was planned for {pf.cluster.framework.name}, whose float8 this runtime does not "
                         f"run: {'; '.join(ours)}")
    return pf


def _resolved(path: str | Path, flag: str) -> Path:
    """The absolute path the ranks are given; a symbolic link loop on the way is the user's path,
    said in one line. Asked of the system (ELOOP), before pathlib meets it: pathlib raises
    RuntimeError for a loop up to Python 3.12 and returns the path as it stands from 3.13."""
    try:
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(f"{flag} {path}: a symbolic link on the way loops") from None
    return Path(path).resolve()


def _worker_args(args: argparse.Namespace, pf: PlanFile, out: Path):
    from runtime.launch import WorkerArgs
    return WorkerArgs(plan=_resolved(args.plan, "plan"), out=_resolved(out, "--out"), steps=args.steps,
                      warmup=args.warmup, seed=args.seed, lr=args.lr,
                      data=str(_resolved(args.data, "--data")) if args.data else None,
                      data_dtype=args.data_dtype, fault=args.inject_fault,
                      checkpoint_dir=str(_resolved(args.checkpoint_dir, "--checkpoint-dir")) if args.checkpoint_dir else None,
                      checkpoint_every=_checkpoint_every(args, pf), keep=args.keep, resume=args.resume,
                      resume_if_present=args.resume_if_present, checkpoint_async=args.checkpoint_async, max_restarts=args.max_restarts, hang_timeout=args.hang_timeout,
                      max_nonfinite_steps=args.max_nonfinite_steps, compile=args.compile)


def _checkpoint_every(args: argparse.Namespace, pf: PlanFile) -> int:
    """--checkpoint-every, or Young/Daly's interval for the plan's predicted step
    (costmodel.resilience); 0 without --checkpoint-dir."""
    if not args.checkpoint_dir:
        return 0
    if args.checkpoint_every:
        return args.checkpoint_every
    from costmodel.estimate import estimate
    from costmodel.resilience import checkpoint_cost
    est = estimate(pf.model, pf.train, pf.cluster, pf.plan)
    return checkpoint_cost(pf.model, pf.train, pf.cluster.world_size, est.step_time_s, est.tokens_per_s,
                           failures_from_args(args)).interval_steps


COMPILE_WITHOUT_WARMUP = ("--compile with --warmup 0: the first step compiles every layer (seconds to minutes), "
                          "which a timed step would measure; use --warmup 1 or more")


def _node_names(pf: PlanFile) -> list[str]:
    """What each host a launcher starts must be: on a mixed cluster, a node of its group's device."""
    if not pf.cluster.is_mixed:
        return [""] * pf.cluster.launch_hosts[0]
    from costmodel.groups import node_groups
    return [f" ({pf.cluster.groups[g].device.name} node)" for g in node_groups(pf.plan, pf.cluster)]


def _refuse_earlier_checkpoints(args: argparse.Namespace) -> None:
    """A printed launch into a --checkpoint-dir this machine sees holding checkpoints: refused
    without --resume or --resume-if-present, as a local run is (its ranks would refuse it too)."""
    from runtime import checkpoint
    if args.checkpoint_dir and not (args.resume or args.resume_if_present):
        if earlier := checkpoint.any_attempt(Path(args.checkpoint_dir)):
            if checkpoint.interrupted_only(Path(args.checkpoint_dir)):
                raise RunRefused(f"--checkpoint-dir {args.checkpoint_dir} holds only interrupted checkpoint writes "
                                 f"({', '.join(earlier[-3:])}), which no run resumes from; pass --resume-if-present "
                                 "to start from step 0, or clear it")
            raise RunRefused(f"--checkpoint-dir {args.checkpoint_dir} holds checkpoints ({', '.join(earlier[-3:])}); "
                             "pass --resume or --resume-if-present to continue from them, or clear it")


def _print_launch(args: argparse.Namespace, pf: PlanFile, worker) -> None:
    if pf.cluster.is_mixed and args.launcher in ("k8s", "slurm"):
        raise RunRefused(f"--launcher {args.launcher}: a mixed cluster's nodes must take the node ranks of their "
                         "groups, which the scheduler does not assign; use the per-node commands (no --launcher) "
                         "or --launcher hostfile with the hosts in that order")
    names = _node_names(pf)
    if args.launcher == "hostfile":
        from runtime.launch_scripts import hostfile_commands, read_hostfile
        hosts = read_hostfile(Path(args.hostfile), pf)
        print(f"# {pf.plan.short()} on {len(hosts)} host(s) of {args.hostfile}: run line i on host i")
        for host, name, cmd in zip(hosts, names, hostfile_commands(pf, worker, hosts)):
            print(f"# {host}{name}\n{cmd}")
        return
    if args.launcher == "k8s":
        from runtime.launch_scripts import pytorchjob_yaml
        if not args.image.strip():
            raise RunRefused("--image is empty: the PyTorchJob's containers need an image with the planner installed")
        if not IMAGE_REFERENCE.fullmatch(args.image):
            raise RunRefused(f"--image {args.image!r} is not a container image reference "
                             "([registry/]name[:tag][@sha256:digest], lower-case name, no spaces)")
        if args.checkpoint_dir and not (args.resume or args.resume_if_present):
            # restartPolicy OnFailure starts a failed pod's torchrun afresh: its ranks would find this
            # run's own checkpoints and refuse them without a resume flag
            raise RunRefused("--launcher k8s with --checkpoint-dir: a pod Kubernetes restarts finds this run's "
                             "checkpoints; pass --resume-if-present (or --resume)")
        from runtime.launch import C10D_HOST_ORDER, domain_hosts
        print(f"# {pf.plan.short()}: kubectl apply -f this (Kubeflow training operator)")
        if domain_hosts(pf.cluster) > 1:
            print(f"# a node of the plan is an NVLink domain of {domain_hosts(pf.cluster)} pods' hosts, and "
                  f"{C10D_HOST_ORDER}: schedule each domain's pods, named in that order, on one rack")
        print(pytorchjob_yaml(pf, worker, args.image), end="")
        return
    from runtime.launch import C10D_HOST_ORDER, domain_hosts, node_commands, sbatch_script
    print(f"# {pf.plan.short()} on {pf.cluster.launch_hosts[0]} host(s): run on host i (MASTER_ADDR = host 0)")
    if not pf.cluster.is_mixed and domain_hosts(pf.cluster) > 1:
        print(f"# a node of the plan is an NVLink domain of {domain_hosts(pf.cluster)} hosts, and "
              f"{C10D_HOST_ORDER}: each domain's hosts must sort together")
    for i, cmd in enumerate(node_commands(pf, worker)):
        print(f"# host {i}{names[i]}\n{cmd}")
    if not pf.cluster.is_mixed:   # a mixed cluster's node ranks follow its groups, which slurm does not know
        print("\n# or submit with sbatch:\n" + sbatch_script(pf, worker))


def _check_machine(args: argparse.Namespace, pf: PlanFile) -> tuple[int, int]:
    """(processes, threads per rank), or refuse with the reason and what to do instead."""
    import torch
    if pf.cluster.is_mixed:
        raise RunRefused(f"the plan is for the mixed cluster {pf.cluster.name}, whose groups are nodes of different "
                         "devices: launch it there with --print-launch (node ranks follow the groups), or check its "
                         "memory here with --dry-run")
    world = pf.plan.world_size
    cuda = torch.cuda.is_available()
    wants_gpu = pf.cluster.device.kind != "cpu"
    if wants_gpu and not cuda:
        raise RunRefused(f"the plan is for {pf.cluster.device.name} but this machine has no GPU; use "
                         "--dry-run to check its memory, or plan for this machine with --cluster 1xNxlocal")
    if not wants_gpu and cuda:
        raise RunRefused("the plan is for cpu ranks but this machine has a GPU; plan for its GPU")
    if pf.plan.fp8_linears:
        from runtime.float8 import float8_run_problem
        if problem := float8_run_problem():
            raise RunRefused(problem)
    from costmodel import machine
    measured_on = pf.cluster.device.machine_key
    if measured_on and measured_on != machine.machine_key():
        raise RunRefused(f"the plan's profile {pf.cluster.device.path} was measured on {pf.cluster.device.machine}, "
                         f"not this machine ({machine.describe()}): its prediction would not be this "
                         "machine's; plan with --cluster 1xNxlocal")
    nproc = args.nproc or world
    if nproc != world:
        raise RunRefused(f"--nproc {nproc}: this plan needs exactly {world} ranks (dp*tp*pp*cp); "
                         "for several nodes use --print-launch")
    available = torch.cuda.device_count() if cuda else (os.cpu_count() or 1)
    if world > available and (cuda or args.nproc is None):
        what = f"{available} GPUs" if cuda else f"{available} CPU cores"
        hint = "; use --print-launch for a multi-node cluster" if cuda else \
            f"; pass --nproc {world} to oversubscribe the cores (correct, but slow), or --dry-run"
        raise RunRefused(f"the plan needs {world} ranks but this machine has {what}{hint}")
    # A CPU profile describes a rank with the threads it was measured with; run ranks alike.
    threads = pf.cluster.device.threads_per_rank or max(1, (os.cpu_count() or 1) // nproc)
    return nproc, threads


def _say_start(args: argparse.Namespace, pf: PlanFile, out: Path, worker, nproc: int, resume_step: int) -> None:
    # the ranks check the checksums, and take an older checkpoint where these fail
    resumed = f", resuming after step {resume_step} (if its checksums verify)" if resume_step else ""
    if args.checkpoint_dir:
        resumed += f", checkpoints every {worker.checkpoint_every} steps and at the end in {args.checkpoint_dir}"
    print(f"planner run: {pf.plan.short()} on {nproc} local rank(s), {args.warmup} warm-up + "
          f"{args.steps} steps{resumed}; log in {out / 'run.log'}", file=sys.stderr)
    if args.compile and resume_step >= args.warmup:
        print("planner run: warning: a resumed run takes no warm-up step, so its first timed step compiles the "
              "layers (calibrate refuses such a run)", file=sys.stderr)
    elif args.warmup == 0 and not resume_step:
        print("planner run: warning: --warmup 0: the first timed step carries the start-up costs (lazy "
              "initialisation, the allocator's first growth), so the step reads slow, and a CPU's memory is "
              "measured over a warm-up step; use --warmup 1 or more for a run to compare or calibrate on",
              file=sys.stderr)


def _warn_of_another_machine(pf: PlanFile, nproc: int, threads: int) -> None:
    """A run that will not measure the machine its profile describes: said before it starts."""
    dev = pf.cluster.device
    if dev.kind == "cpu" and not dev.machine_key:   # a shipped profile of some other processor
        print(f"planner run: warning: the plan's profile {dev.name} describes another machine ({dev.path}), not "
              "this one: the comparison says how far this machine is from it; plan with --cluster 1xNxlocal for "
              "this machine's prediction", file=sys.stderr)
    if _shares_cores(pf, nproc, threads):
        print(f"planner run: warning: {nproc} ranks x {threads} thread(s) on {os.cpu_count()} cores: they share "
              "cores, which no profile prices (the run is marked oversubscribed; calibrate refuses it)",
              file=sys.stderr)


def _shares_cores(pf: PlanFile, nproc: int, threads: int) -> bool:
    """CPU ranks whose threads outnumber this machine's cores."""
    return pf.cluster.device.kind == "cpu" and nproc * threads > (os.cpu_count() or 1)


RUN_DIR_STEM_CHARS = 64


def run_dir_stem(model_name: str) -> str:
    """The default run directory's stem from the plan's model name (a config path's or a
    hand-edited plan's may hold separators, '..' or hundreds of characters): runs of anything
    but letters, digits, '.', '_' and '-' become '-', at most RUN_DIR_STEM_CHARS, 'model' if
    nothing is left; the directory stays inside runs/."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", model_name).strip(".-")[:RUN_DIR_STEM_CHARS].strip(".-")
    return stem or "model"


def cmd_run(args: argparse.Namespace) -> int:
    if args.dry_run and args.print_launch:
        raise RunRefused("--dry-run and --print-launch are two modes; choose one")
    if args.dry_run:
        refuse_ignored(args.given, DRY_RUN_IGNORES, "--dry-run builds the states on the meta device and trains nothing")
    if args.print_launch:
        refuse_ignored(args.given, PRINT_LAUNCH_IGNORES, "--print-launch prints commands and runs nothing")
    if not args.print_launch:
        refuse_ignored(args.given, {"launcher"}, "it says how --print-launch prints")
    for flag, mode in (("hostfile", "hostfile"), ("image", "k8s")):
        if args.launcher != mode:
            refuse_ignored(args.given, {flag}, f"it is for --launcher {mode}")
        elif getattr(args, flag) is None:
            raise RunRefused(f"--launcher {mode} needs --{flag}")
    if not args.data:
        refuse_ignored(args.given, {"data_dtype"}, "it is the dtype of a raw --data file")
    elif args.data.endswith(".npy"):
        refuse_ignored(args.given, {"data_dtype"}, "a .npy file records its own dtype")
    if args.checkpoint_dir is not None and not args.checkpoint_dir.strip():
        raise RunRefused("--checkpoint-dir is empty; give a directory")
    if not args.checkpoint_dir:
        refuse_ignored(args.given, CHECKPOINT_FLAGS, "checkpointing and resuming need --checkpoint-dir")
    if args.resume and args.resume_if_present:
        raise RunRefused("--resume and --resume-if-present: choose one (the second starts afresh without a checkpoint)")
    if args.checkpoint_every:
        refuse_ignored(args.given, FAILURE_FLAGS, "--checkpoint-every sets the interval they would choose")
    pf = _load(args.plan)
    if args.compile:
        from runtime.compile import compile_problem
        if problem := compile_problem(pf.plan):
            raise RunRefused(problem)
        if args.warmup == 0 and not (args.resume or args.resume_if_present or args.dry_run):
            raise RunRefused(COMPILE_WITHOUT_WARMUP)
    if args.dry_run:
        return _dry_run(args, pf)
    out = Path(args.out or f"runs/{run_dir_stem(pf.model.name)}-{time.strftime('%Y%m%d-%H%M%S')}")
    if args.print_launch:
        _refuse_earlier_checkpoints(args)
        # no `planner run` waits for these ranks: rank 0 writes measured.json itself
        _print_launch(args, pf, dataclasses.replace(_worker_args(args, pf, out), record=True))
        return 0
    with held_dirs(args, pf, out) as resume_step:   # one run at a time in each directory: a second is refused
        return _run_locked(args, pf, out, _worker_args(args, pf, out), resume_step)


def _run_locked(args: argparse.Namespace, pf: PlanFile, out: Path, worker, resume_step: int) -> int:
    """The run, measured into `out`, which this process holds."""
    if args.compile and args.warmup == 0 and resume_step == 0:   # --resume-if-present found nothing
        raise RunRefused(COMPILE_WITHOUT_WARMUP)
    nproc, threads = _check_machine(args, pf)
    loaded, pf = pf, priced_as_run(pf, args.compile)
    if args.data:   # refuse a bad token file here, not once per rank
        from runtime.data import TokenSource
        every = (args.warmup + args.steps) * pf.train.global_batch_size * pf.train.seq_len + 1
        TokenSource(pf.model.vocab_size, pf.train.seq_len, args.seed, Path(args.data), args.data_dtype,
                    checked_tokens=every)
    _warn_of_another_machine(pf, nproc, threads)   # once nothing more is refused
    for problem in check_memory(pf.model, pf.train, pf.cluster, pf.plan):
        print(f"planner run: warning: predicted not to fit: {problem}", file=sys.stderr)
    from runtime.launch import RunFailed, run_local
    from runtime.measure import run_record
    _say_start(args, pf, out, worker, nproc, resume_step)
    start = time.perf_counter()
    try:
        with outputs.new_stream(out / "run.log", args.overwrite) as log:
            wall_s = run_local(nproc, worker, threads, log)
    except RunFailed as exc:   # a rank failed, died or hung: the run broke, not the user's command (exit 1)
        if found := CHECKPOINT_REFUSED.fullmatch(str(exc)):   # but checkpoints the ranks refused are the input's
            cause = found.group(1).rpartition(" (log: ")[0] or found.group(1)
            raise RunRefused(f"--checkpoint-dir: {cause} (log: {out / 'run.log'})") from None
        stopped = Stopped(str(exc))
        _keep_partial(pf, args, out, time.perf_counter() - start, stopped)
        raise stopped from None
    except BaseException as exc:
        if not isinstance(exc, Exception):   # Ctrl-C or SIGTERM: keep what was measured so far
            _keep_partial(pf, args, out, time.perf_counter() - start, exc)
        raise
    run_lock.check_held(out)
    raw = json.loads((out / "raw.json").read_text())
    copy_plan(args, out)
    record = run_record(loaded, raw, wall_s=wall_s, compiled=args.compile,
                        oversubscribed=_shares_cores(pf, nproc, threads))
    outputs.write_file(out / "measured.json", outputs.json_text(record.to_dict()), args.overwrite)
    (out / PARTIAL).unlink(missing_ok=True)
    record = _with_machine_moment(record, pf, threads, out)
    if args.json:
        emit_json(record.to_dict())
    else:
        _print_comparison(record, out)
    return 0


def _with_machine_moment(record, pf: PlanFile, threads: int, out: Path):
    """The run's record with the profile's probe layer timed again (planner.measure.machine_speed),
    saved again; after the steps, so it cannot slow them, and after the record is saved, so a
    profile whose timing is malformed, or a Ctrl-C here, costs the run nothing (a warning)."""
    from planner.measure.machine_speed import probe_layer_s
    try:
        probe = probe_layer_s(pf, threads)
    except ValueError as exc:
        print(f"planner run: warning: the machine's moment is not measured: {exc}", file=sys.stderr)
        return record
    if probe is None:
        return record
    record = dataclasses.replace(record, probe_layer_now_s=probe[0], probe_layer_profiled_s=probe[1])
    outputs.write_file(out / "measured.json", outputs.json_text(record.to_dict()), True)   # this run's record, completed
    return record


def _keep_partial(pf: PlanFile, args: argparse.Namespace, out: Path, wall_s: float, exc: BaseException) -> None:
    """The timed steps rank 0 recorded before the signal, as measured.json marked incomplete."""
    from runtime.measure import measured_record
    try:
        run_lock.check_held(out)
    except outputs.WriteFailed as gone:
        exc.add_note(str(gone))
        return
    for left in out.glob(f".{PARTIAL}.tmp-*"):   # rank 0 stopped between writing and renaming it
        left.unlink(missing_ok=True)
    try:
        raw = json.loads((out / PARTIAL).read_text())
    except (OSError, ValueError):
        raw = None
    if not raw or not raw.get("step_times_s"):
        exc.add_note(f"no step was measured (log: {out / 'run.log'})")
        return
    steps = len(raw["step_times_s"])   # a run diverged in its warm-up keeps those steps' times
    record = measured_record(pf, raw, steps=steps, warmup=len(raw["losses"]) - steps, wall_s=wall_s, complete=False,
                             compiled=args.compile)
    copy_plan(args, out)
    outputs.write_file(out / "measured.json", outputs.json_text(record.to_dict()), args.overwrite)
    (out / PARTIAL).unlink(missing_ok=True)
    exc.add_note(f"kept the {steps} of {args.steps} steps measured so far in {out / 'measured.json'} "
                 f"(marked {'diverged' if raw.get('diverged') else 'incomplete'})")


def _print_comparison(record, out: Path) -> None:
    from reports.tables import table
    from runtime.measure import comparison_rows
    print(table(("", "predicted", "measured", "measured vs predicted"), comparison_rows(record)))
    if record.probe_layer_now_s:
        from planner.measure.machine_speed import describe
        print("\n" + describe(record.probe_layer_now_s, record.probe_layer_profiled_s))
    print(f"\nmemory measured as: {record.memory_source}")
    print(f"wrote {out / 'measured.json'}")


def _dry_run(args: argparse.Namespace, pf: PlanFile) -> int:
    from runtime.dryrun import dry_run
    rows = dry_run(pf)
    if args.json:
        emit_json({"rows": rows})
        return 0
    from reports.tables import table
    body = []
    for r in rows:
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes", "host_bytes"):
            if key not in r:   # host: offloaded states only
                continue
            v = r[key]
            body.append((r["stage"], r["rank"], key.removesuffix("_bytes"),
                         f"{v['runtime'] / GIB:,.3f}", f"{v['predicted'] / GIB:,.3f}",
                         f"{(v['runtime'] - v['predicted']) / GIB:+,.3f} GiB" if v["error_pct"] is None
                         else f"{v['error_pct']:+.2f}%"))
    print(f"dry run of {pf.plan.short()} ({pf.model.name}, world {pf.plan.world_size}): the first rank "
          "of each pipeline stage built on the meta device under a fake process group")
    print(table(("stage", "rank", "state", "runtime GiB", "predicted GiB", "runtime vs predicted"), body))
    return 0
