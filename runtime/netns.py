"""Two "nodes" on one machine, for the multi-node test and benchmark: Linux network namespaces
joined by a veth pair, each holding one address of a /24 that exists only inside them (removed
on exit). Needs root and iproute2; `Unavailable` says why not."""
from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


class Unavailable(RuntimeError):
    pass


@dataclass(frozen=True)
class Node:
    namespace: str
    interface: str   # the veth end inside the namespace (GLOO_SOCKET_IFNAME)
    address: str


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@contextmanager
def two_nodes(subnet: str | None = None) -> Iterator[list[Node]]:
    if shutil.which("ip") is None or os.geteuid() != 0:
        raise Unavailable("network namespaces need root and iproute2 (ip)")
    tag = f"pl{os.getpid() % 100000}"
    subnet = subnet or f"10.231.{os.getpid() % 250}"
    nodes = [Node(f"{tag}n{i}", f"{tag}v{i}", f"{subnet}.{i + 1}") for i in range(2)]
    try:
        for node in nodes:
            if (done := _ip("netns", "add", node.namespace)).returncode:
                raise Unavailable(f"cannot create a network namespace: {done.stderr.strip()}")
        steps = [("link", "add", nodes[0].interface, "type", "veth", "peer", "name", nodes[1].interface)]
        for n in nodes:
            steps += [("link", "set", n.interface, "netns", n.namespace),
                      ("-n", n.namespace, "addr", "add", f"{n.address}/24", "dev", n.interface),
                      ("-n", n.namespace, "link", "set", n.interface, "up"),
                      ("-n", n.namespace, "link", "set", "lo", "up")]
        for step in steps:
            if (done := _ip(*step)).returncode:
                raise Unavailable(f"cannot set up the veth pair: ip {' '.join(step)}: {done.stderr.strip()}")
        yield nodes
    finally:
        for node in nodes:
            _ip("netns", "del", node.namespace)


def start(node: Node, command: str, cwd, env: dict | None = None) -> subprocess.Popen:
    """`command` (a shell line) inside the node's namespace, gloo on its veth, in a session of
    its own (so that killing the node kills all of it)."""
    full_env = {**os.environ, **(env or {}), "GLOO_SOCKET_IFNAME": node.interface}
    return subprocess.Popen(["ip", "netns", "exec", node.namespace, "bash", "-c", f"exec {command}"], cwd=cwd,
                            env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
