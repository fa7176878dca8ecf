"""runtime.fork's rendezvous: rank 0's store serves on a socket the parent bound before forking,
so no other process can take the port in between (a port found free and closed again can be
taken by another test's gloo before rank 0's init_process_group binds it: EADDRINUSE)."""
from __future__ import annotations

import errno
import os
import socket

import torch
import torch.distributed as dist

import runtime.fork


def _sum_of_ranks() -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def test_the_port_cannot_be_taken_between_choosing_it_and_serving_on_it(monkeypatch):
    start = runtime.fork.mp.start_processes
    refused: list[int] = []
    thief = socket.socket()   # another process binding the port between its choice and its use

    def steal_then_start(fn, args, **kwargs):
        try:
            thief.bind(("127.0.0.1", args[1]))   # _worker's args: (world, port, ...)
            thief.listen()   # held while the ranks start: rank 0 would then fail
        except OSError as exc:
            refused.append(exc.errno)
        return start(fn, args, **kwargs)

    monkeypatch.setattr(runtime.fork.mp, "start_processes", steal_then_start)
    try:
        open_fds = len(os.listdir("/proc/self/fd"))
        assert runtime.fork.run_forked(2, _sum_of_ranks) == [3.0, 3.0]
        assert len(os.listdir("/proc/self/fd")) == open_fds   # the parent's copy of the socket closed
    finally:
        thief.close()
    assert refused == [errno.EADDRINUSE]
