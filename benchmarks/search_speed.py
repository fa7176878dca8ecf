"""Search speed, as the search statistics report it (`search.wall_s` of `planner search --json`),
plus the whole command's wall time, optionally side by side with another revision.

    python benchmarks/search_speed.py [--repeat 3] [--against REV] [--limit-s 600]

Targets (2 CPU cores, each search proven optimal under the cost model): llama-70b on 8x8xA100
<= 1.0 s; mixtral-8x7b on 8x8xH100 <= 1.5 s; llama3-405b on 2048x8xH100 <= 2 s; llama-70b on
8x8xA100 for each framework (--framework megatron, torchtitan, deepspeed) <= 2 s; deepseek-v3 on
256x8xH100 and on 2048x8xH100 (its published sequence and batch, the registry's recipe), and on
256x8xH100 and 128x8xH100 under --framework megatron (its space: CP with MTP, expert TP; at 1,024
GPUs deep pipelines under the block method's shared recompute count) <= 3 s.

Each case runs as its own `planner search --json` process under a time limit, `--repeat` times;
the table shows the least and the median search time (other work on the machine only slows a
run down, so the least is the closest to the search's own cost; the load average is printed).
`--against REV` runs the same cases from a temporary `git worktree` of REV (removed afterwards)
and shows its column beside this tree's, and whether both chose the same first plan.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = [   # (model, cluster, further arguments of planner search, target search seconds)
    ("llama-70b", "8x8xA100", (), 1.0),
    ("mixtral-8x7b", "8x8xH100", (), 1.5),
    ("llama3-405b", "2048x8xH100", (), 2.0),
    *(("llama-70b", "8x8xA100", ("--framework", name), 2.0) for name in ("megatron", "torchtitan", "deepspeed")),
    ("deepseek-v3", "256x8xH100", (), 3.0),
    ("deepseek-v3", "2048x8xH100", (), 3.0),
    ("deepseek-v3", "256x8xH100", ("--framework", "megatron"), 3.0),
    ("deepseek-v3", "128x8xH100", ("--framework", "megatron"), 3.0),
]


def run(model: str, cluster: str, limit_s: float, extra: tuple[str, ...] = (), tree: Path = ROOT) -> dict:
    """One `planner search --json` from `tree` (its own packages first on the path)."""
    cmd = [sys.executable, "-m", "planner", "search", "--model", model, "--cluster", cluster, *extra, "--json",
           "--time-limit", str(limit_s)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    start = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=limit_s + 60, cwd=tree, env=env)
    except subprocess.TimeoutExpired:
        return {"finished": False, "error": f"not within {limit_s:.0f} s"}
    if out.returncode != 0:
        return {"finished": False, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}
    doc = json.loads(out.stdout)
    return {"finished": True, "command_s": time.perf_counter() - start, **doc["search"],
            "first": json.dumps(doc["plans"][0]["plan"], sort_keys=True)}


def measure(tree: Path, case: tuple, repeat: int, limit_s: float) -> dict:
    model, cluster, extra, _ = case
    runs = [run(model, cluster, limit_s, extra, tree) for _ in range(repeat)]
    done = [r for r in runs if r["finished"]]
    if not done:
        return {"finished": False, "error": runs[-1]["error"]}
    walls = [r["wall_s"] for r in done]
    return {"finished": True, "min_s": min(walls), "median_s": statistics.median(walls),
            "command_s": min(r["command_s"] for r in done), "optimal": all(r["optimal"] for r in done),
            "candidates": done[0]["num_candidates"], "solved": done[0]["num_solved"], "first": done[0]["first"]}


def column(m: dict) -> str:
    if not m["finished"]:
        return f"{'failed: ' + m['error'][:30]:>32}"
    return f"{m['min_s']:8.2f} {m['median_s']:8.2f} {m['command_s']:9.2f} {str(m['optimal']):>5}"


def worktree(rev: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix="search-speed-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT, check=True,
                   capture_output=True, text=True)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per case (default 3)")
    parser.add_argument("--against", metavar="REV", help="also run the cases at this git revision")
    parser.add_argument("--limit-s", type=float, default=600, help="time limit per run (default 600)")
    args = parser.parse_args()
    other = worktree(args.against) if args.against else None
    try:
        print(f"load average before: {os.getloadavg()[0]:.2f} (2-core targets assume an idle machine)")
        head = f"{'min s':>8} {'median s':>8} {'command s':>9} {'opt':>5}"
        print(f"{'case':52} {'target s':>8}  {head}" + (f"  | {args.against}: {head}  same first" if other else ""))
        for case in CASES:
            ours = measure(ROOT, case, args.repeat, args.limit_s)
            line = f"{' '.join((case[0], case[1], *case[2])):52} {case[3]:8.1f}  {column(ours)}"
            if other is not None:
                theirs = measure(other, case, args.repeat, args.limit_s)
                same = ours["finished"] and theirs["finished"] and ours["first"] == theirs["first"]
                line += f"  | {' ' * len(args.against)}  {column(theirs)}  {str(same):>10}"
            print(line, flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    finally:
        if other is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(other)], cwd=ROOT, capture_output=True)
            other.parent.rmdir()
    print("command: " + " ".join(["python benchmarks/search_speed.py", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
