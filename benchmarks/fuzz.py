"""The fuzzing harness (tests/fuzzing.py) for longer than CI runs it, with a random seed.

    python benchmarks/fuzz.py [--examples 2000] [--seed N]

Draws command lines, JSON mutations of a plan, a model config and a measured run, and CSV
mutations of a runs table; each example must end with exit 0, or exit 1/2 and one stderr line,
with no traceback, no input changed, within its time bound. Prints the exit codes per kind and
the time; the first failing example is shrunk by hypothesis and printed with its seed.
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given, seed, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import fuzzing  # noqa: E402


def kinds(ws: fuzzing.Workspace):
    def mutated(name: str, doc: object, command):
        return fuzzing.json_mutations(doc).map(
            lambda d: command(fuzzing.write_input(ws, name, json.dumps(d))))
    plan = json.loads(ws.plan.read_text())
    return {
        "command line": fuzzing.command_lines(ws),
        "plausible plan": fuzzing.plan_command_lines(ws),
        "plan file": mutated("plan.json", plan, lambda p: ["predict", "--plan", str(p)]),
        "model config": mutated("config.json", fuzzing.CONFIG,
                                lambda p: ["predict", "--model", str(p), "--cluster", f"1x2x{fuzzing.PROFILE}"]),
        "measured run": mutated("measured.json", json.loads(ws.measured.read_text()),
                                lambda p: ["report", str(ws.plan), "--measured", str(p), "--out",
                                           str(ws.outputs / "report"), "--overwrite"]),
        "runs table": fuzzing.csv_mutations(ws.runs.read_text()).map(
            lambda t: ["validate", str(fuzzing.write_input(ws, "runs.csv", t)), "--json"]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=2000,
                   help="examples per kind (default 2000; a tenth of it for measured runs, which render reports)")
    p.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random, printed)")
    args = p.parse_args()
    chosen = random.randrange(2**32) if args.seed is None else args.seed
    ws = fuzzing.make_workspace(Path(tempfile.mkdtemp(prefix="planner-fuzz-")))
    start = time.perf_counter()
    for kind, strategy in kinds(ws).items():
        codes: collections.Counter = collections.Counter()

        # a valid measured run renders a whole report (~2 s): a tenth as many of those
        count = args.examples // 10 if kind == "measured run" else args.examples

        @seed(chosen)
        @settings(max_examples=count, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(argv=strategy)
        def one(argv):
            codes[fuzzing.check(ws, argv)] += 1

        kind_start = time.perf_counter()
        one()
        print(f"{kind:13s} {sum(codes.values()):6,} examples  exit 0: {codes[0]:5,}  exit 2: {codes[2]:5,}  "
              f"exit 1: {codes[1]:3,}  {time.perf_counter() - kind_start:6.1f} s", flush=True)
    print(f"all held; seed {chosen}; {time.perf_counter() - start:.0f} s; command: python benchmarks/fuzz.py "
          + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
