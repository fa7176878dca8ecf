"""`planner run`'s flags: what each one does, its range, and which flags a mode does not use."""
from __future__ import annotations

import argparse

from planner.args import (
    DEGREE,
    MAX_RESTARTS,
    MAX_STEPS,
    add_failure_args,
    float_in,
    int_in,
    seed_int,
)

# AdamW moves each weight by about lr a step: above 10 every weight leaves its scale at once, below
# 1e-12 no update survives rounding in fp32, and near 1e308 the first step is inf.
LR_RANGE = (1e-12, 10.0)
# The watchdog checks once a second, and its start-up wait is a thread's timed wait, which takes
# at most threading.TIMEOUT_MAX (1e308 was an OverflowError in that thread, the watchdog gone).
HANG_TIMEOUT_RANGE_S = (1.0, 1e6)

EPILOG = """examples:
  planner search --model debug-tiny --cluster 1x2xlocal --out plan.json && planner run plan.json
  planner run plan.json --steps 20 --warmup 3 --out runs/tiny
  planner run plan.json --dry-run          (plans too big for this machine: states per rank on meta)
  planner run plan.json --print-launch     (torchrun per host and an sbatch script)
  planner run plan.json --print-launch --launcher hostfile --hostfile hosts.txt
  planner run plan.json --print-launch --launcher k8s --image registry/planner:0.1   (a Kubeflow PyTorchJob)

ranks start with torchrun; CPU runs use gloo and the threads per rank the profile was measured
with (oversubscribing cores is fine for correctness, not for speed); GPU runs use NCCL, one GPU
per rank."""


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", help="plan.json from `planner search --out` or `planner predict --out`")
    p.add_argument("--nproc", type=DEGREE,
                   help="local processes (default: the plan's world size); needed to oversubscribe CPU cores")
    p.add_argument("--steps", type=int_in(1, MAX_STEPS), default=10, help="timed training steps (default 10)")
    p.add_argument("--warmup", type=int_in(0, MAX_STEPS), default=2,
                   help="untimed steps first (default 2; on a CPU the last one measures memory, unless --compile)")
    p.add_argument("--seed", type=seed_int, default=0, help="initialisation and synthetic data seed")
    p.add_argument("--lr", type=float_in(*LR_RANGE), default=3e-4, help="learning rate (default 3e-4)")
    p.add_argument("--data", help="token file: a .npy array (told by its header, whatever its name), or raw token "
                                  "ids of --data-dtype (e.g. .bin) (default: synthetic tokens)")
    p.add_argument("--data-dtype", choices=["uint16", "uint32"], default="uint16")
    p.add_argument("--out", help="directory for measured.json and run.log (default runs/<model>-<time>)")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="save sharded checkpoints here (torch.distributed.checkpoint: model, optimizer, "
                        "RNG; each rank its part), after the last step and every --checkpoint-every steps")
    p.add_argument("--checkpoint-every", type=int_in(1, MAX_STEPS), metavar="N",
                   help="also save after every N-th step (default: Young/Daly's interval for the plan's "
                        "predicted step and the failure rate, Llama 3's unless --device-mtbf-hours, as "
                        "`planner search` prints it)")
    p.add_argument("--checkpoint-async", action="store_true",
                   help="write checkpoints in the background (torch.distributed.checkpoint.async_save): the step "
                        "waits only for a copy of the rank's state in host memory (which it then needs twice), "
                        "and a checkpoint is committed when the next save or the run's end finds it written; "
                        "`planner search` prices synchronous saves")
    p.add_argument("--keep", type=int_in(1, MAX_STEPS), default=2, metavar="K",
                   help="complete checkpoints kept, newest first (default 2); older ones are pruned only once a new "
                        "one is committed with its manifest (every file's size and SHA-256)")
    p.add_argument("--hang-timeout", type=float_in(*HANG_TIMEOUT_RANGE_S, " s"), default=300.0, metavar="S",
                   help="a rank that makes no progress (no layer forward) for S seconds ends the job, named "
                        "with where it stopped (default 300, 1 to 1,000,000; checkpoint writes do not count)")
    p.add_argument("--max-nonfinite-steps", type=int_in(1, MAX_STEPS), default=1, metavar="N",
                   help="stop the run (exit 1, naming the step and the rank; no checkpoint of that state) after N "
                        "steps in a row whose loss or gradient norm is not finite; the update of each such step "
                        "is skipped (default 1: at the first)")
    p.add_argument("--max-restarts", type=int_in(0, MAX_RESTARTS), default=0, metavar="R",
                   help="when a rank fails, restart all ranks up to R times (torchrun); each restart resumes "
                        "from the latest complete checkpoint (needs --checkpoint-dir)")
    add_failure_args(p)   # for the default --checkpoint-every
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir whose files match its "
                        "manifest (a damaged one is named and skipped), under this plan or another of the same "
                        "model; --warmup + --steps is then the step the run reaches. A directory without such a "
                        "checkpoint is an error")
    p.add_argument("--resume-if-present", action="store_true",
                   help="as --resume where --checkpoint-dir holds a complete checkpoint, else start from step 0")
    p.add_argument("--compile", action="store_true",
                   help="compile each transformer layer with torch.compile (inductor; torchtitan's regional compile), "
                        "the embedding, head, FSDP2 and pipeline around them eager; predicted with the layers' "
                        "memory-bound work fused; a dense layer compiles as one graph or the run fails. A plan it "
                        "cannot serve (activation offloading, a zero-bubble schedule, recomputation under TP) is "
                        "refused")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run's results in --out and, without --resume, the checkpoints in "
                        "--checkpoint-dir (said, naming them; refused otherwise)")
    p.add_argument("--dry-run", action="store_true",
                   help="build each stage's first rank on the meta device under a fake process group "
                        "and compare its states with the estimate; runs nothing")
    p.add_argument("--print-launch", action="store_true",
                   help="print how to launch the plan on its cluster instead of running it (--launcher); "
                        "paths in the commands must be on storage every node sees. Its rank 0 writes --out's "
                        "measured.json and plan.json, which `planner report` and `calibrate` read")
    p.add_argument("--launcher", choices=["slurm", "hostfile", "k8s"],
                   help="with --print-launch: slurm (default: a torchrun command per host and an sbatch "
                        "script), hostfile (torchrun per host of --hostfile), k8s (a Kubeflow PyTorchJob YAML "
                        "for --image)")
    p.add_argument("--hostfile", metavar="F",
                   help="with --launcher hostfile: one host per line (host or 'host slots=N'), first = "
                        "rendezvous")
    p.add_argument("--image", help="with --launcher k8s: a container image with this planner installed")
    p.add_argument("--json", action="store_true", help="print measured.json (or the dry-run rows) on stdout")
    p.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)   # RANK:STEP:raise|exit, failure tests


# what a mode does not use, refused by name rather than silently dropped
FAILURE_FLAGS = {"device_mtbf_hours", "storage_mb_s_per_device"}
CHECKPOINT_FLAGS = {"checkpoint_every", "keep", "resume", "resume_if_present", "max_restarts", "checkpoint_async", *FAILURE_FLAGS}
LAUNCH_FLAGS = {"hostfile", "image", "launcher"}
DRY_RUN_IGNORES = {"nproc", "steps", "warmup", "seed", "lr", "data", "data_dtype", "out", "overwrite", "inject_fault",
                   "compile", "checkpoint_dir", "hang_timeout", "max_nonfinite_steps", *CHECKPOINT_FLAGS, *LAUNCH_FLAGS}
PRINT_LAUNCH_IGNORES = {"nproc", "json", "overwrite", "inject_fault"}
