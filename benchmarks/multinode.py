"""Multi-node on one machine: two network namespaces joined by a veth pair, each running the
torchrun command `planner run --print-launch --launcher hostfile` prints for it. Prints the step
time of a plan whose pipeline (or data parallelism) crosses the two "nodes" against the same plan
on one node, whether their losses agree, and how long the surviving node takes to end, naming the
lost one, after the other is killed. Needs root and iproute2.

    python benchmarks/multinode.py [--steps 20] [--plan-flags "--pp 2"] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from planner.cli import main as planner
from runtime import netns


def _plan(work: Path, flags: list[str]) -> Path:
    plan = work / "plan.json"
    code = planner(["predict", "--model", "debug-small", "--cluster", "2x2xxeon-amx", "--dtype", "fp32", *flags,
                    "--global-batch", "8", "--seq-len", "128", "--out", str(plan), "--json", "--overwrite"])
    if code:
        sys.exit(f"planner predict failed ({code})")
    return plan


def _commands(plan: Path, nodes, out: Path, steps: int) -> list[str]:
    hosts = out.parent / "hosts.txt"
    hosts.write_text("".join(f"{n.address} slots=2\n" for n in nodes))
    done = subprocess.run([sys.executable, "-m", "planner", "run", str(plan), "--print-launch", "--launcher",
                           "hostfile", "--hostfile", str(hosts), "--steps", str(steps), "--warmup", "2",
                           "--out", str(out)], capture_output=True, text=True, check=True)
    return [line for line in done.stdout.splitlines() if line.startswith("torchrun ")]


def _median_step_s(out: Path) -> tuple[float, list[float]]:
    raw = json.loads((out / "raw.json").read_text())
    times = sorted(raw["step_times_s"])
    return times[len(times) // 2], raw["losses"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--plan-flags", default="--pp 2", help="plan flags for planner predict (default: --pp 2)")
    ap.add_argument("--out", type=Path, help="keep the runs here (default: a temporary directory)")
    args = ap.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="planner-multinode-"))
    work.mkdir(parents=True, exist_ok=True)
    plan = _plan(work, args.plan_flags.split())
    try:
        with netns.two_nodes() as nodes:
            across = work / "across"
            commands = _commands(plan, nodes, across, args.steps)
            start = time.monotonic()
            procs = [netns.start(n, c, work) for n, c in zip(nodes, commands)]
            for p in procs:
                p.communicate(timeout=600)
            if any(p.returncode for p in procs):
                sys.exit("the two-node run failed")
            wall_across = time.monotonic() - start
            step_across, losses_across = _median_step_s(across)
            # the kill: a long run, node 1 killed after rank 0's first step
            killed_out = work / "killed"
            procs = [netns.start(n, c, work) for n, c in zip(nodes, _commands(plan, nodes, killed_out, 10_000))]
            while not (killed_out / "partial.json").exists():
                time.sleep(0.1)
            os.killpg(procs[1].pid, signal.SIGKILL)
            killed = time.monotonic()
            _, err = procs[0].communicate(timeout=120)
            detect_s = time.monotonic() - killed
            named = next((line for line in err.splitlines() if "lost node" in line), "(no node named)")
    except netns.Unavailable as why:
        sys.exit(f"multinode: {why}")
    alone = work / "alone"
    alone.mkdir(exist_ok=True)
    worker = commands[0].split(" -m ", 1)[1].replace(str(across), str(alone))
    start = time.monotonic()
    subprocess.run(f"{sys.executable} -m torch.distributed.run --standalone --nproc-per-node=4 -m {worker}",
                   shell=True, cwd=work, check=True, capture_output=True)
    wall_alone = time.monotonic() - start
    step_alone, losses_alone = _median_step_s(alone)
    same = max(abs(a - b) / abs(b) for a, b in zip(losses_across, losses_alone))
    print(f"plan: {json.loads(plan.read_text())['plan']}")
    print(f"{'':24} {'median step ms':>15} {'wall s':>8}")
    print(f"{'two nodes (veth)':24} {1e3 * step_across:15.1f} {wall_across:8.1f}")
    print(f"{'one node (loopback)':24} {1e3 * step_alone:15.1f} {wall_alone:8.1f}")
    print(f"losses: largest relative difference {same:.2e} over {len(losses_across)} steps")
    print(f"node 1 killed: node 0 ended after {detect_s:.1f} s: {named.strip()}")
    print(f"(python benchmarks/multinode.py --steps {args.steps} --plan-flags \"{args.plan_flags}\")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
