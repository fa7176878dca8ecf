"""Launching a plan's ranks with torchrun (`torch.distributed.run`), locally or as printed
per-node commands / an sbatch script for a multi-node cluster, and naming the rank that failed."""
from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from costmodel.plan import PlanFile

MONITOR_INTERVAL_S = 1     # torchrun polls its workers this often; one failure ends the rest
PORT = 29500
PARTIAL = "partial.json"   # rank 0's figures after every timed step: what an interrupted run keeps
RESTARTED = "restarted.txt"   # rank 0 of a restarted attempt writes the restart count here
STOP_GRACE_S = 3.0         # after Ctrl-C / SIGTERM, torchrun's time to stop its ranks before SIGKILL
# after torchrun sends a surviving rank SIGTERM (a peer failed), the rank's time to end before the
# planner sends SIGKILL: torchrun's own wait is 30 s, which a stopped or stuck rank always takes
RANK_STOP_GRACE_S = 5.0
_CLOSING = re.compile(r"Sending process (\d+) closing signal SIGTERM")
# Ctrl-C and SIGTERM: held where a handler must not run (forking ranks, stopping them, loading
# modules: planner.signals, which keeps its own copy so it loads on the standard library alone)
HELD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


@dataclass(frozen=True, kw_only=True)
class StepsConfig:
    """How a run trains: steps, warm-up, seed, learning rate, data (the worker's flags and the
    train loop's configuration share these)."""
    steps: int = 10
    warmup: int = 2
    seed: int = 0
    lr: float = 3e-4
    data: str | None = None
    data_dtype: str = "uint16"
    # runtime.checkpoint: where, how often (steps; 0: at the end only), how many to keep, and
    # whether to continue from the latest complete one
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep: int = 2
    resume: bool = False
    # resume where a checkpoint is present, else start from step 0 (a job a scheduler may start
    # again from scratch); without either, a directory of earlier checkpoints is refused
    resume_if_present: bool = False
    checkpoint_async: bool = False   # write in the background (runtime.checkpoint.Saver)
    hang_timeout: float = 0.0   # runtime.watchdog: seconds without progress before a rank gives up; 0: off
    max_nonfinite_steps: int = 1   # runtime.health: steps in a row with a non-finite loss or gradient norm that stop the run
    compile: bool = False   # runtime.compile: each layer's forward through torch.compile


@dataclass(frozen=True, kw_only=True)
class WorkerArgs(StepsConfig):
    """What each rank's `python -m runtime.worker` is told: written (`argv`) and read (`parse`)
    here only."""
    plan: Path
    out: Path
    # RANK:STEP:raise|exit|kill|hang|nan, injected by the failure tests (first attempt only); RANK:STEP:slow
    # slows that rank's layers on every attempt (a straggler, runtime.train._slow_down)
    fault: str | None = None
    max_restarts: int = 0      # torchrun restarts the ranks this often; they resume from the checkpoint
    # rank 0 also writes measured.json and plan.json beside raw.json: a launch `planner run` does
    # not drive, printed by --print-launch, whose run directory `planner report` and `calibrate` read
    record: bool = False

    def argv(self) -> list[str]:
        args = ["-m", "runtime.worker", "--plan", str(self.plan), "--out", str(self.out),
                "--steps", str(self.steps), "--warmup", str(self.warmup), "--seed", str(self.seed),
                "--lr", repr(self.lr)]
        if self.data:
            args += ["--data", self.data, "--data-dtype", self.data_dtype]
        if self.fault:
            args += ["--fault", self.fault]
        if self.hang_timeout:
            args += ["--hang-timeout", repr(self.hang_timeout)]
        if self.max_nonfinite_steps != 1:
            args += ["--max-nonfinite-steps", str(self.max_nonfinite_steps)]
        if self.compile:
            args.append("--compile")
        if self.record:
            args.append("--record")
        if self.checkpoint_dir:
            args += ["--checkpoint-dir", self.checkpoint_dir, "--checkpoint-every", str(self.checkpoint_every),
                     "--keep", str(self.keep)] + (["--resume"] if self.resume else []) \
                + (["--resume-if-present"] if self.resume_if_present else []) \
                + (["--checkpoint-async"] if self.checkpoint_async else [])
        return args

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> "WorkerArgs":
        p = argparse.ArgumentParser(prog="python -m runtime.worker")
        p.add_argument("--plan", required=True, type=Path)
        p.add_argument("--out", required=True, type=Path)
        for name, kind in (("--steps", int), ("--warmup", int), ("--seed", int), ("--lr", float),
                           ("--data", str), ("--data-dtype", str), ("--fault", str),
                           ("--checkpoint-dir", str), ("--checkpoint-every", int), ("--keep", int),
                           ("--hang-timeout", float), ("--max-nonfinite-steps", int)):
            p.add_argument(name, type=kind, default=getattr(cls, name[2:].replace("-", "_")))
        p.add_argument("--resume", action="store_true")
        p.add_argument("--resume-if-present", action="store_true")
        p.add_argument("--checkpoint-async", action="store_true")
        p.add_argument("--compile", action="store_true")
        p.add_argument("--record", action="store_true")
        return cls(**vars(p.parse_args(argv)))

    def fault_spec(self) -> tuple[int, int, str] | None:
        if not self.fault:
            return None
        rank, step, kind = self.fault.split(":")
        return int(rank), int(step), kind


def die_with_parent() -> None:
    """On Linux, ask the kernel to SIGKILL this process when its parent ends, however it ends:
    a torchrun (or planner) killed outright then leaves no rank behind."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:   # the parent was already gone before the request took effect
        os._exit(1)


# how a rank's error begins when its training diverged (runtime.train.Diverged)
DIVERGED = "training diverged"
# how a rank's error begins when storage refused a checkpoint (runtime.checkpoint.CheckpointWriteFailed)
CHECKPOINT_WRITE_FAILED = "checkpoint write failed"
# causes a failure's message names first, before a peer's that merely followed them
# (failure_message); every failed run ends planner run with exit 1
RUN_STOPPED = (DIVERGED, CHECKPOINT_WRITE_FAILED)


class RunFailed(RuntimeError):
    pass


def local_command(nproc: int, worker: WorkerArgs) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            f"--monitor-interval={MONITOR_INTERVAL_S}", f"--max-restarts={worker.max_restarts}", *worker.argv()]


# torchrun's c10d rendezvous gives the hosts their ranks in the order of their addresses as
# strings (--local-addr, else the host's FQDN: torch.distributed.elastic's DynamicRendezvousHandler
# sorts its participants), whatever --node-rank says
C10D_HOST_ORDER = "c10d numbers hosts in the order of their names (as strings), whatever the order they are listed in"


def domain_hosts(cluster) -> int:
    """The hosts of one node of the plan: 1, or where a node is an NVLink domain of several hosts
    (a GB200 NVL72 rack's trays: ClusterSpec.launch_hosts) their count, whose order the launch
    must keep together (C10D_HOST_ORDER)."""
    return cluster.devices_per_node // cluster.launch_hosts[1]


def node_commands(pf: PlanFile, worker: WorkerArgs, hosts: list[str] | None = None) -> list[str]:
    """One torchrun command per host (a node, or each host of a node that spans several:
    ClusterSpec.launch_hosts), under `env` with what run_local sets (launch_env; `env` keeps the
    line one command, as `exec` or ssh take it), c10d rendezvous on the first, which is told it hosts the store
    (torchrun's own guess compares the endpoint with the machine's hostname and misses an address
    on a secondary interface). With the `hosts`' names, each host also says which
    address is its own (--local-addr: else torchrun gives the ranks the machine's FQDN to meet
    at, which may be another interface); without, the first is $MASTER_ADDR."""
    c = pf.cluster
    master = hosts[0] if hosts else "$MASTER_ADDR"

    def meet(i: int) -> list[str]:
        # c10d numbers hosts by address (C10D_HOST_ORDER) and ignores --node-rank; a mixed
        # cluster's node ranks must follow its groups (costmodel.groups.node_groups), which only
        # the static rendezvous keeps
        if c.is_mixed:
            return [f"--node-rank={i}", f"--master-addr={master}", f"--master-port={PORT}"]
        return ["--rdzv-backend=c10d", f"--rdzv-endpoint={master}:{PORT}", "--rdzv-id=planner",
                f"--rdzv-conf=is_host={'true' if i == 0 else 'false'}"]
    count, per_host = c.launch_hosts
    return [" ".join(["env", _exports(pf), "torchrun", f"--nnodes={count}",
                      f"--nproc-per-node={per_host}", f"--max-restarts={worker.max_restarts}",
                      *meet(i), *([f"--local-addr={hosts[i]}"] if hosts else []),
                      *map(shlex.quote, worker.argv())])
            for i in range(count)]


# the caching allocator's expandable segments: the GPU profiles price fragmentation with them
ALLOC_CONF = "expandable_segments:True"


def job_name(pf: PlanFile) -> str:
    """The job's name for a scheduler: planner-<model> as a DNS-1035 label (Kubernetes' rule for a
    PyTorchJob: lowercase letters, digits and '-', a letter first, 63 at most), whatever the
    model's name (a config.json's may hold '/')."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"planner-{pf.model.name}".lower())
    return re.sub(r"-+", "-", name)[:63].strip("-")


def launch_env(pf: PlanFile) -> dict[str, str]:
    """What run_local sets for the ranks beside torchrun, as a launch on other machines must too:
    the caching allocator's expandable segments, whose fragmentation the GPU profiles price, and a
    CPU rank's threads, as its profile measured them (torchrun would set 1)."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": ALLOC_CONF}
    if pf.cluster.device.kind == "cpu":
        env["OMP_NUM_THREADS"] = str(pf.cluster.device.threads_per_rank or 1)
    return env


def _exports(pf: PlanFile) -> str:
    return " ".join(f"{k}={shlex.quote(v)}" for k, v in launch_env(pf).items())


def sbatch_script(pf: PlanFile, worker: WorkerArgs) -> str:
    c = pf.cluster
    count, per_host = c.launch_hosts
    run = " ".join(["torchrun", f"--nnodes={count}", f"--nproc-per-node={per_host}",
                    f"--max-restarts={worker.max_restarts}",
                    "--rdzv-backend=c10d", f'--rdzv-endpoint="$MASTER_ADDR:{PORT}"',
                    "--rdzv-id=$SLURM_JOB_ID", *map(shlex.quote, worker.argv())])
    return "\n".join([
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name(pf)}",
        f"#SBATCH --nodes={count}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={per_host}"] if c.device.kind != "cpu" else []),
        # a node of the plan is an NVLink domain of several hosts: Slurm keeps each one's hosts in a
        # segment of one rack (as NVIDIA's launchers do on GB200 NVL72)
        *([f"#SBATCH --segment={domain_hosts(c)}", f"# {C10D_HOST_ORDER}: each segment's hosts must sort together"]
          if domain_hosts(c) > 1 else []),
        "#SBATCH --exclusive",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"export MASTER_ADDR {_exports(pf)}",
        f"srun {run}",
        ""])


def clear_earlier_run(out: Path) -> None:
    """What an earlier run left in a reused --out (--overwrite): its results, so that a run that
    ends before measuring a step is not shown with them, and its ranks' errors, so that it does
    not blame them."""
    for stale in [out / "measured.json", out / "raw.json", out / PARTIAL, out / RESTARTED,
                  *out.glob("errors/rank*.txt")]:
        stale.unlink(missing_ok=True)


def run_local(nproc: int, worker: WorkerArgs, threads_per_rank: int, log: TextIO) -> float:
    """Run torchrun, tee its output to `log` (OUT/run.log, which the caller opened without
    replacing another run's: planner.outputs.new_stream) and stderr; returns the wall time."""
    worker.out.mkdir(parents=True, exist_ok=True)
    clear_earlier_run(worker.out)
    # expandable segments: the fragmentation the GPU profiles price (1.05-1.10 of allocated
    # bytes with them, 1.15-1.3 without); a user's own setting wins. Ignored on CPU.
    env = {"PYTORCH_CUDA_ALLOC_CONF": ALLOC_CONF,
           **os.environ, "OMP_NUM_THREADS": str(threads_per_rank),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    # Its own session: a terminal's Ctrl-C reaches the planner only, which stops torchrun
    # (and so its ranks) in order, rather than every process at once.
    proc = subprocess.Popen(local_command(nproc, worker), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        for line in proc.stdout:
            log.write(line)
            if line.startswith("[planner run]"):
                print(line, end="", file=sys.stderr, flush=True)
            elif closing := _CLOSING.search(line):
                _kill_later(int(closing.group(1)), proc.pid)
        code = proc.wait()
    except BaseException:
        stop(proc)
        raise
    log.flush()   # failure_message reads torchrun's summary from it
    if code != 0:
        raise RunFailed(failure_message(worker.out, nproc))
    if (worker.out / RESTARTED).exists():
        print(f"planner run: recovered: a rank failed and all ranks were restarted "
              f"{(worker.out / RESTARTED).read_text().strip()} time(s) from the latest checkpoint "
              f"(what failed: {worker.out / 'run.log'})", file=sys.stderr)
    return time.perf_counter() - start


def _kill_later(pid: int, parent: int) -> None:
    """SIGKILL rank `pid` after RANK_STOP_GRACE_S if it is still torchrun's child then: a rank
    that a SIGTERM cannot end (stopped, stuck) would otherwise hold the failure's report 30 s."""
    def kill() -> None:
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                os.kill(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):   # ended already, or no /proc here
            pass
    timer = threading.Timer(RANK_STOP_GRACE_S, kill)
    timer.daemon = True
    timer.start()


def stop(proc: subprocess.Popen) -> None:
    """End torchrun and its ranks: SIGTERM (torchrun forwards it to the ranks), then after
    STOP_GRACE_S a SIGKILL of its process group; ranks die with torchrun in any case (each asks
    the kernel for it, runtime.worker), so nothing is left behind."""
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)   # a second Ctrl-C must not cut this short
    try:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)


# What the surviving ranks report once a peer has gone: consequences, not causes.
EXITS = re.compile(r"rank\s*:\s*(\d+).*?\n\s*exitcode\s*:\s*(-?\d+)")
HUNG_WAITING = "RankHung: waiting for a peer"   # runtime.watchdog: a rank whose peer stopped progressing
JOIN_WAITING = "waiting for a peer to join"   # runtime.watchdog.joining: ... or never joined
PEER_LOST = re.compile(r"Connection (reset|closed)|Broken pipe|[Pp]eer|timed out|Timeout|SIGTERM|Signals\.")


def failure_message(out: Path, nproc: int) -> str:
    """Name the rank that caused the failure, at which step and why. The run's own stop (a
    diverged loss, a refused checkpoint write) comes first, as its ranks said it; then a Python
    error that is not a lost-peer consequence; then a rank that died without a Python error
    (signal, os._exit), found in torchrun's failure summary, even where torchrun saw a peer fail
    first, with the diagnosis of a peer's watchdog that waited for it; then the earliest error of
    any kind."""
    errors = sorted((out / "errors").glob("rank*.txt")) if (out / "errors").exists() else []
    causes = sorted((p.stat().st_mtime, int(p.stem.removeprefix("rank")), p.read_text().splitlines()[0])
                    for p in errors)
    log_path = out / "run.log"
    log = log_path.read_text() if log_path.exists() else ""
    for _, _, line in causes:
        _, cause = _step_and_cause(line)
        if any(cause.split(": ", 1)[-1].startswith(why) for why in RUN_STOPPED):   # names its step and rank
            return f"{cause.split(': ', 1)[-1]} (log: {log_path})"
    primary = [c for c in causes if not PEER_LOST.search(c[2])]
    if primary:
        return f"{_failed(primary[0][1], primary[0][2])} (log: {log_path})"
    first_line = {rank: line for _, rank, line in causes}
    # torchrun lists the ranks it terminated first and its first observed failure last.
    before, found, root = log.rpartition("Root Cause")
    exits = EXITS.findall(root if found else log) + EXITS.findall(before if found else "")
    for rank, code in exits:   # died without a Python error (not torchrun's SIGTERM to the survivors):
        if int(rank) not in first_line and int(code) != -15:   # the cause of the others' lost peers
            return f"{_died(int(rank), int(code), causes)} (log: {log_path})"
    for rank, code in exits:
        if int(rank) in first_line:
            return f"{_failed(int(rank), first_line[int(rank)])} (log: {log_path})"
        return f"{_died(int(rank), int(code), causes)} (log: {log_path})"
    if causes:
        return f"{_failed(causes[0][1], causes[0][2])} (log: {log_path})"
    return f"the job of {nproc} ranks failed; see {log_path}"


_STEP = re.compile(r"^((?:step|warm-up) \d+(?:/\d+)?): (.*)$")


def _step_and_cause(line: str) -> tuple[str | None, str]:
    """A rank's first error line, `step 3/8: Type: message` (runtime.worker, runtime.watchdog):
    the step as the progress lines name it, and the cause."""
    m = _STEP.match(line)
    return (m.group(1), m.group(2)) if m else (None, line)


def _failed(rank: int, line: str) -> str:
    step, cause = _step_and_cause(line)
    return f"rank {rank} failed{f' at {step}' if step else ''}: {cause}"


def _died(rank: int, code: int, causes: list) -> str:
    """A rank that ended without a Python error; where a peer's watchdog waited for it (a rank
    stopped or stuck where its own watchdog cannot run), that diagnosis leads."""
    how = f"signal {-code}" if code < 0 else f"exit code {code}"
    waited = [(r, *_step_and_cause(line)) for _, r, line in causes if HUNG_WAITING in line]
    if not waited:
        return f"rank {rank} died ({how}) without a Python error"
    peer, step, cause = waited[0]
    if step is None and JOIN_WAITING in cause:
        return (f"rank {rank} did not join the process group (stopped or stuck at start-up: rank {peer} "
                f"{cause.removeprefix('RankHung: ')}, --hang-timeout); it was then ended ({how})")
    at = f" at {step}" if step else ""
    return (f"rank {rank} made no progress{at} (hung or stopped: rank {peer} {cause.removeprefix('RankHung: ')}, "
            f"--hang-timeout); it was then ended ({how})")
