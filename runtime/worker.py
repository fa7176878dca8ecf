"""What each rank runs under torchrun: `python -m runtime.worker --plan plan.json --out DIR ...`.

Rank 0 writes DIR/raw.json (losses, step times, memory); a rank that raises writes
DIR/errors/rank<R>.txt (the cause on the first line, then the traceback) so the launcher can name
it; a rank that loses its connection to another node names that node (runtime.nodes), on stderr
too. `--fault RANK:STEP:raise|exit` injects a failure (the failure tests, through `planner run`'s
hidden `--inject-fault`).
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from costmodel.inputs import json_text, write_text_atomic
from costmodel.plan import PlanFile
from runtime import watchdog
from runtime.host_memory import keep_freed_memory
from runtime.launch import PARTIAL, RESTARTED, WorkerArgs, die_with_parent
from runtime.nodes import gather_places, lost_node
from runtime.train import RunConfig, init_distributed, restart_count, run_rank


def _record(pf: PlanFile, raw: dict, args: WorkerArgs, wall_s: float) -> None:
    """What `planner run` writes after its local ranks end (runtime.measure.run_record), written by
    rank 0 of a launch it does not drive (WorkerArgs.record), once every rank is done: measured.json
    and the plan beside it, replacing an earlier launch's. The run is trained and its raw.json
    written: a failure here is a warning, never a failed (or restarted) run."""
    from runtime.measure import run_record
    try:
        record = run_record(pf, raw, wall_s=wall_s, compiled=args.compile)
        write_text_atomic(args.out / "measured.json", json_text(record.to_dict()))
        if args.plan.resolve() != (args.out / "plan.json").resolve():
            write_text_atomic(args.out / "plan.json", args.plan.read_text())
    except Exception as exc:   # noqa: BLE001 - the training succeeded; its record is said to be missing
        print(f"planner worker: warning: measured.json not written ({type(exc).__name__}: {exc}); the run's "
              f"figures are in {args.out / 'raw.json'}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    start = time.perf_counter()
    die_with_parent()
    args = WorkerArgs.parse(argv)
    out = args.out
    rank = int(os.environ.get("RANK", "0"))
    # a CPU rank keeps the memory it frees (runtime.host_memory); where it cannot, the run says so
    if not torch.cuda.is_available() and not keep_freed_memory() and rank == 0:
        print("planner run: freed host memory cannot be kept (the C library is not glibc, or refused the "
              "setting): large tensors may fault fresh pages every micro-batch (runtime.host_memory)", file=sys.stderr)
    places: list = []
    try:
        pf = PlanFile.load(args.plan)
        with watchdog.joining(out / "errors" / f"rank{rank}.txt", args.hang_timeout):   # a peer stopped at start-up
            init_distributed()
            places = gather_places()
        if restart_count() and rank == 0:   # the launcher says so once the run succeeds
            write_text_atomic(out / RESTARTED, f"{restart_count()}\n")
        cfg = RunConfig(steps=args.steps, warmup=args.warmup, seed=args.seed, lr=args.lr,
                        data=args.data, data_dtype=args.data_dtype, fault=args.fault_spec(),
                        partial=out / PARTIAL, checkpoint_dir=args.checkpoint_dir,
                        checkpoint_every=args.checkpoint_every, keep=args.keep, resume=args.resume,
                        resume_if_present=args.resume_if_present, checkpoint_async=args.checkpoint_async, hang_timeout=args.hang_timeout,
                        max_nonfinite_steps=args.max_nonfinite_steps, compile=args.compile)
        raw = run_rank(pf, cfg)
        if raw is not None:
            raw.pop("params", None)
            write_text_atomic(out / "raw.json", json.dumps(raw, indent=2))
        dist.barrier()   # no rank tears gloo down while a peer still talks to it
        dist.destroy_process_group()
        if raw is not None and args.record:   # after the group: no peer waits on it, no timeout
            _record(pf, raw, args, time.perf_counter() - start)
        return 0
    except BaseException as exc:   # noqa: BLE001 - recorded for the launcher, then re-raised
        errors = out / "errors"
        errors.mkdir(parents=True, exist_ok=True)
        cause = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
        if node := lost_node(str(exc), places, rank):   # across machines: say which one went
            cause = f"lost {node}: {cause}"
            print(f"planner worker: rank {rank} lost {node}", file=sys.stderr, flush=True)
        write_text_atomic(errors / f"rank{rank}.txt", watchdog.with_step(cause) + "\n\n" + traceback.format_exc())
        raise


if __name__ == "__main__":
    code = main()
    # Skip the interpreter's teardown once the job is done: a C++ thread of gloo or of the
    # pipelining runtime destroyed during static destruction aborts the process now and then
    # ("terminate called without an active exception", SIGABRT after the last step), which
    # torchrun would report as a failed run. Everything is written and the group destroyed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
