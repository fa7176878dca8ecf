"""Memory checks: peak memory predicted against measured by `planner run` (dp, pipeline), and
what glibc's freed-memory policy costs a CPU training step (host).

    python benchmarks/memory.py dp [--out DIR]
    python benchmarks/memory.py pipeline [--out DIR]
    python benchmarks/memory.py host PLAN.json [--passes 8]

dp: two-rank data-parallel plans of the closed loops' unseen models (benchmarks/closed_loop.py:
the hidden Llama and the held-out GPT) in bf16 on 2 gloo ranks (dp2, a datasheet CPU profile:
memory does not depend on its speeds), sequence 128, one micro-batch of 1 or 4 a rank,
ZeRO-0/1/2. Their layers are far below an FSDP unit's bucket (costmodel.fsdp_units.fsdp_unit_layers),
so each rank's model is one unit, whose once-a-step reduction copies all its gradients at once
(costmodel.memory.buffer_bytes says why that copy is not priced apart). About two minutes.

pipeline: every pipeline schedule in the configuration of
tests/runtime/test_run_cli.py::test_pipeline_schedules_hold_the_memory_the_model_says
(debug-small, fp32, sequence 512, 16 sequences in micro-batches of 2, pp2 x dp1, ZeRO-0, on 2
gloo ranks), per stage. About a minute.

dp and pipeline run one warm-up step (CPU memory is tracked there) and one timed step per plan,
and print the predicted and measured MiB and their ratio.

host: a plan's model, forward, loss and backward at its micro-batch size on one thread, its loss
kernels timed one by one, pass by pass, in two fresh processes: glibc as it comes, then with the
freed memory kept (runtime.host_memory). Prints, per process, each pass's loss kernels
(log-softmax, its backward, the NLL's forward and backward) in ms and the pass's kernels in all;
a pass that maps fresh pages for the logits shows as a loss several times the others'.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 2**20
COMPARED = f"{'predicted MiB':>15}{'measured MiB':>14}{'pred/meas':>11}"

DP_ZEROS, DP_MICRO_BATCHES, DP_SEQ_LEN = ("0", "1", "2"), (1, 4), 128

PIPELINE_SCHEDULES = (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2))
PIPELINE_PLAN = ["--model", "debug-small", "--cluster", "1x2xxeon-amx", "--dtype", "fp32", "--seq-len", "512",
                 "--global-batch", "16", "--mbs", "2", "--pp", "2", "--dp", "1", "--zero", "0"]

LOSS_OPS = ("_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward")
FAULTS = "minor page faults"
HOST_MODES = (("as-is", "glibc as it comes"), ("keep", "freed memory kept"))


def _planner(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"memory: planner {' '.join(args)} failed ({done.returncode}):\n{done.stderr.strip()[-2000:]}")


def peaks(out: Path, tag: str, predict_flags: list[str]) -> list[tuple[float, float]]:
    """(predicted, measured) peak bytes per stage of the plan `planner predict` writes for
    `predict_flags`, after one warm-up and one timed step of `planner run` (OUT/<tag>)."""
    plan, run = out / f"{tag}.json", out / tag
    _planner("predict", *predict_flags, "--json", "--out", str(plan), "--overwrite")
    _planner("run", str(plan), "--steps", "1", "--warmup", "1", "--out", str(run), "--overwrite")
    m = json.loads((run / "measured.json").read_text())
    return list(zip(m["predicted_memory_compared_bytes"], m["peak_memory_bytes"]))


def compared(predicted_bytes: float, measured_bytes: float) -> str:
    """The COMPARED columns of one row."""
    return (f"{predicted_bytes / MIB:>15,.1f}{measured_bytes / MIB:>14,.1f}"
            f"{predicted_bytes / measured_bytes - 1:>+11.1%}")


def dp(out: Path) -> None:
    from closed_loop import MODELS  # this directory's own (on the path when run as a script)
    print(f"{'model':<14}{'zero':>5}{'mbs':>5}{COMPARED}")
    for name, config in MODELS.items():
        model = out / f"{name}.json"
        model.write_text(json.dumps(config))
        for zero in DP_ZEROS:
            for mbs in DP_MICRO_BATCHES:
                flags = ["--model", str(model), "--cluster", "1x2xxeon-amx", "--dtype", "bf16", "--dp", "2",
                         "--zero", zero, "--mbs", str(mbs), "--seq-len", str(DP_SEQ_LEN),
                         "--global-batch", str(2 * mbs)]
                (pred, meas), *_ = peaks(out, f"{name}-z{zero}-mbs{mbs}", flags)
                print(f"{name:<14}{zero:>5}{mbs:>5}{compared(pred, meas)}", flush=True)


def pipeline(out: Path) -> None:
    print(f"{'schedule':<18}{'stage':>6}{COMPARED}")
    for schedule, vpp in PIPELINE_SCHEDULES:
        flags = [*PIPELINE_PLAN, "--vpp", str(vpp), "--schedule", schedule]
        for stage, (pred, meas) in enumerate(peaks(out, schedule, flags)):
            print(f"{schedule:<18}{stage:>6}{compared(pred, meas)}", flush=True)


def _op_timer():
    """A torch dispatch mode that sums each op's seconds by name (`.seconds`)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ByName(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seconds: dict[str, float] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            name = func._schema.name.split("::")[-1]
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            return out

    return ByName()


def host_passes(plan: Path, count: int, keep: bool) -> list[dict[str, float]]:
    """In this process: `count` timed passes (after one warm-up) of the plan's model, each op's
    seconds by name and the pages first touched in the pass."""
    import torch

    from costmodel.plan import PlanFile
    from runtime.host_memory import keep_freed_memory
    from runtime.job import cross_entropy
    from runtime.model import Transformer
    from runtime.parallel import TORCH_DTYPES

    if keep and not keep_freed_memory():
        sys.exit("memory host: this C library is not glibc; nothing to compare")
    torch.set_num_threads(1)
    pf = PlanFile.load(plan)
    net = Transformer(pf.model)
    net.init_weights(0)
    net.to(TORCH_DTYPES[pf.train.compute_dtype])   # the plan's compute dtype (no fp32 master copy here)
    shape = (pf.plan.micro_batch_size, pf.train.seq_len)
    tokens = torch.randint(0, pf.model.vocab_size, shape)
    labels = torch.randint(0, pf.model.vocab_size, shape)
    out = []
    for i in range(count + 1):
        net.zero_grad(set_to_none=True)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        with _op_timer() as timer:
            cross_entropy(net(tokens), labels).backward()
        if i:
            out.append({**timer.seconds, FAULTS: resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})
    return out


def host_report(label: str, timed: list[dict[str, float]]) -> str:
    """One process's line: the loss kernels and all kernels per pass in ms, and the pages first
    touched a pass."""
    loss = [1e3 * sum(p.get(op, 0.0) for op in LOSS_OPS) for p in timed]
    total = [1e3 * sum(v for k, v in p.items() if k != FAULTS) for p in timed]
    faults = [int(p[FAULTS]) for p in timed]
    return (f"{label}: loss kernels per pass " + ", ".join(f"{x:.1f}" for x in loss)
            + f" ms (median {statistics.median(loss):.1f}); all kernels " + ", ".join(f"{x:.0f}" for x in total)
            + f" ms (median {statistics.median(total):.0f}); pages first touched {statistics.median(faults):,.0f}"
            f" a pass (median)")


def host(plan: Path, passes: int) -> None:
    """Each policy in a fresh process (this script's hidden --child): keep_freed_memory holds for
    the rest of a process, and glibc as it comes raises its threshold as the process frees blocks."""
    if not plan.is_file():
        sys.exit(f"memory host: {plan}: no such file")
    for mode, label in HOST_MODES:
        proc = subprocess.run([sys.executable, __file__, "host", str(plan), "--passes", str(passes), "--child", mode],
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"memory host: the {label} process failed:\n{proc.stderr.strip()}")
        print(host_report(label, json.loads(proc.stdout.strip().splitlines()[-1])), flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    checks = p.add_subparsers(dest="check", required=True, metavar="{dp,pipeline,host}")
    for name, what in (("dp", "data-parallel plans per ZeRO stage and micro-batch size"),
                       ("pipeline", "every pipeline schedule, per stage")):
        sub = checks.add_parser(name, help=f"peak memory, predicted against measured: {what}")
        sub.add_argument("--out", type=Path, help="directory for the plans and runs (default: a temporary one)")
    sub = checks.add_parser("host", help="what glibc's freed-memory policy costs a CPU step")
    sub.add_argument("plan", type=Path, help="a plan.json (its model, sequence and micro-batch size)")
    sub.add_argument("--passes", type=int, default=8, help="timed passes per process (default 8)")
    sub.add_argument("--child", choices=[m for m, _ in HOST_MODES], help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.check == "host" and args.passes < 1:
        p.error("--passes must be at least 1")
    if args.check == "host" and args.child:
        print(json.dumps(host_passes(args.plan, args.passes, args.child == "keep")))
        return 0
    start = time.perf_counter()
    if args.check == "host":
        host(args.plan, args.passes)
    else:
        out = args.out or Path(tempfile.mkdtemp(prefix=f"{args.check}-memory-"))
        out.mkdir(parents=True, exist_ok=True)
        (dp if args.check == "dp" else pipeline)(out)
    print(f"\n{time.perf_counter() - start:.0f} s; command: python benchmarks/memory.py "
          + " ".join(sys.argv[1:] if argv is None else argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
