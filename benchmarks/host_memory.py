"""What glibc's freed-memory policy costs a CPU training step (runtime.host_memory): a plan's model,
forward, loss and backward at its micro-batch size on one thread, its loss kernels timed one by
one, pass by pass, in two fresh processes: glibc as it comes, then with the freed memory kept.

    python benchmarks/host_memory.py PLAN.json [--passes 8]

Prints, per process, each pass's loss kernels (log-softmax, its backward, the NLL's forward and
backward) in ms and the pass's kernels in all; a pass that maps fresh pages for the logits shows
as a loss several times the others'.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

LOSS_OPS = ("_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward")
FAULTS = "minor page faults"


def passes(plan: Path, count: int, keep: bool) -> list[dict[str, float]]:
    """In this process: `count` timed passes (after one warm-up) of the plan's model, each op's
    seconds by name."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from costmodel.plan import PlanFile
    from runtime.host_memory import keep_freed_memory
    from runtime.job import cross_entropy
    from runtime.model import Transformer
    from runtime.parallel import TORCH_DTYPES

    if keep and not keep_freed_memory():
        sys.exit("host_memory: this C library is not glibc; nothing to compare")
    torch.set_num_threads(1)

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
        with ByName() as timer:
            cross_entropy(net(tokens), labels).backward()
        if i:   # the pages first touched in the pass, beside its ops' seconds
            out.append({**timer.seconds, FAULTS: resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})
    return out


def report(label: str, timed: list[dict[str, float]]) -> str:
    loss = [1e3 * sum(p.get(op, 0.0) for op in LOSS_OPS) for p in timed]
    total = [1e3 * sum(v for k, v in p.items() if k != FAULTS) for p in timed]
    faults = [int(p[FAULTS]) for p in timed]
    return (f"{label}: loss kernels per pass " + ", ".join(f"{x:.1f}" for x in loss)
            + f" ms (median {statistics.median(loss):.1f}); all kernels " + ", ".join(f"{x:.0f}" for x in total)
            + f" ms (median {statistics.median(total):.0f}); pages first touched {statistics.median(faults):,.0f}"
            f" a pass (median)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", type=Path, help="a plan.json (its model, sequence and micro-batch size)")
    parser.add_argument("--passes", type=int, default=8, help="timed passes per process (default 8)")
    parser.add_argument("--child", choices=("as-is", "keep"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.passes < 1:
        parser.error("--passes must be at least 1")
    if args.child:
        print(json.dumps(passes(args.plan, args.passes, args.child == "keep")))
        return
    if not args.plan.is_file():
        sys.exit(f"host_memory: {args.plan}: no such file")
    for mode, label in (("as-is", "glibc as it comes"), ("keep", "freed memory kept")):
        proc = subprocess.run([sys.executable, __file__, str(args.plan), "--passes", str(args.passes), "--child", mode],
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"host_memory: the {label} process failed:\n{proc.stderr.strip()}")
        print(report(label, json.loads(proc.stdout.strip().splitlines()[-1])))


if __name__ == "__main__":
    main()
