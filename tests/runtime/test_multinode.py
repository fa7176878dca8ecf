"""Two "nodes" on one machine: network namespaces joined by a veth pair, each running the torchrun
command `planner run --print-launch --launcher hostfile` prints for it (c10d rendezvous on the
first node's veth address, gloo over the veth link: GLOO_SOCKET_IFNAME). A plan whose pipeline
crosses the nodes trains to the same losses as on one node; when one node is killed mid-run, the
other ends within 30 s and names the node it lost. Skipped where namespaces cannot be made (not
root, no iproute2, no CAP_NET_ADMIN). The addresses live only inside the namespaces this test
makes and removes."""
from __future__ import annotations

import json
import os
import shlex
import signal
import time
from pathlib import Path

import pytest

from costmodel.plan import PlanFile
from planner.cli import main
from runtime import netns
from runtime.fork import run_forked
from runtime.launch import WorkerArgs
from runtime.train import RunConfig, run_rank


@pytest.fixture
def two_nodes():
    try:
        with netns.two_nodes() as nodes:
            yield nodes
    except netns.Unavailable as why:
        pytest.skip(str(why))


def _commands(tmp_path: Path, nodes, capsys, steps: int) -> tuple[Path, list[str]]:
    plan = tmp_path / "plan.json"
    assert main(["predict", "--model", "debug-tiny", "--cluster", "2x2xxeon-amx", "--dtype", "fp32", "--pp", "2",
                 "--global-batch", "8", "--out", str(plan), "--json"]) == 0
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("".join(f"{n.address} slots=2\n" for n in nodes))
    out = tmp_path / "run"
    assert main(["run", str(plan), "--print-launch", "--launcher", "hostfile", "--hostfile", str(hosts),
                 "--steps", str(steps), "--warmup", "0", "--out", str(out)]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("env ") and " torchrun " in line]
    assert len(commands) == 2 and f"--rdzv-endpoint={nodes[0].address}:" in commands[0]
    return out, commands


def test_a_pipeline_across_two_nodes_trains_as_on_one(tmp_path, capsys, two_nodes):
    out, commands = _commands(tmp_path, two_nodes, capsys, steps=3)
    procs = [netns.start(node, command, tmp_path) for node, command in zip(two_nodes, commands)]
    results = [p.communicate(timeout=180) for p in procs]
    assert all(p.returncode == 0 for p in procs), [r[1][-2000:] for r in results]
    across = json.loads((out / "raw.json").read_text())["losses"]
    # the same plan and worker arguments on one node: four local ranks (forked from this process,
    # loopback only) running the worker's training loop as runtime.worker configures it; the
    # launch itself, torchrun and runtime.worker on one node, is test_run_cli's
    args = WorkerArgs.parse(shlex.split(commands[0].split(" -m runtime.worker ", 1)[1]))
    cfg = RunConfig(steps=args.steps, warmup=args.warmup, seed=args.seed, lr=args.lr, data=args.data,
                    data_dtype=args.data_dtype, quiet=True)
    one = run_forked(4, run_rank, PlanFile.load(args.plan), cfg)[0]["losses"]
    assert across == pytest.approx(one, rel=1e-6)
    assert len(across) == 3


def test_killing_a_node_ends_the_other_and_names_it(tmp_path, capsys, two_nodes):
    out, commands = _commands(tmp_path, two_nodes, capsys, steps=10_000)
    procs = [netns.start(node, command, tmp_path) for node, command in zip(two_nodes, commands)]
    try:
        deadline = time.monotonic() + 120
        while not (out / "partial.json").exists():   # rank 0 writes it after every step
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the run did not start"
            time.sleep(0.2)
        os.killpg(procs[1].pid, signal.SIGKILL)   # node 1 goes, all of it
        killed = time.monotonic()
        _, err = procs[0].communicate(timeout=60)
        assert time.monotonic() - killed < 30 and procs[0].returncode != 0
        assert f"lost node 1 ({two_nodes[1].address}, ranks 2, 3)" in err, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
