"""Run a function on N local ranks by forking the current process (tests, quick local runs).

Forking a parent that has already imported torch and its distributed packages starts 8 ranks in
~0.2 s, against ~10 s for fresh interpreters (shared/reference/torch-on-cpu-notes.md). The parent
never initialises a process group. A rank that raises ends all of them (torch.multiprocessing
terminates the others) and the error names the rank.
"""
from __future__ import annotations

import os
import pickle
import signal
import socket
import tempfile
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

# Imported here, once, so forked ranks do not each pay for them.
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401
import torch.multiprocessing as mp

from runtime.host_memory import keep_freed_memory
from runtime.launch import HELD_SIGNALS as HELD
from runtime.launch import die_with_parent


class RankFailed(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listener() -> socket.socket:
    """A socket bound and listening before the ranks are forked; rank 0's store serves on it.
    A port found free and closed again could be taken before rank 0 bound it: by another test's
    gloo pair or store connection, whose ports come from the same ephemeral range (EADDRINUSE in
    rank 0's init_process_group)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def _store(rank: int, world: int, port: int, listen_fd: int | None, timeout: timedelta) -> dist.Store:
    if rank == 0 and listen_fd is not None:   # forked: serve on the parent's listening socket
        return dist.TCPStore("127.0.0.1", port, world, True, timeout, master_listen_fd=listen_fd)
    if listen_fd is not None:
        os.close(listen_fd)   # the other ranks' copies of it
    return dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout)


def _worker(rank: int, world: int, port: int, result_dir: str, fn: Callable, args: tuple,
            device_type: str = "cpu", listen_fd: int | None = None) -> None:
    # The parent handles Ctrl-C and ends the ranks (run_forked); a rank dies with the parent.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD)   # held by the parent while it forked
    die_with_parent()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    if device_type == "cpu":   # as runtime.worker: a CPU rank keeps the memory it frees
        keep_freed_memory()
    timeout = timedelta(seconds=120 if device_type == "cuda" else 60)
    store = _store(rank, world, port, listen_fd, timeout)
    if device_type == "cuda":   # as runtime.train.init_distributed: NCCL for CUDA tensors
        torch.cuda.set_device(rank)
        dist.init_process_group("cpu:gloo,cuda:nccl", store=store, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        out = fn(*args)
        Path(result_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(out))
    finally:
        dist.destroy_process_group()


def run_forked(world: int, fn: Callable, *args: Any, device_type: str = "cpu") -> list[Any]:
    """`fn(*args)` on `world` forked ranks; returns each rank's result, rank order. CUDA ranks
    are spawned instead (CUDA cannot be used in a forked child), so `fn` and `args` must pickle."""
    with tempfile.TemporaryDirectory() as tmp:
        # Ctrl-C / SIGTERM held while the ranks are forked: a handler that raises inside fork's
        # at-fork hooks has its exception printed and dropped, and the command goes on as if
        # nothing had been pressed (tests/runtime/test_interrupt.py, `planner profile`'s probes).
        # Delivered right after, inside the `try` that ends the ranks.
        main = threading.current_thread() is threading.main_thread()
        before = signal.pthread_sigmask(signal.SIG_BLOCK, HELD) if main else None
        listener = None
        try:
            # spawned (CUDA) ranks cannot inherit the socket: they take a port found free, racily
            listener = None if device_type == "cuda" else _listener()
            port = _free_port() if listener is None else listener.getsockname()[1]
            listen_fd = None if listener is None else listener.fileno()
            context = mp.start_processes(_worker, args=(world, port, tmp, fn, args, device_type, listen_fd),
                                         nprocs=world, join=False,
                                         start_method="spawn" if device_type == "cuda" else "fork")
        except BaseException:
            if main:
                signal.pthread_sigmask(signal.SIG_SETMASK, before)
            raise
        finally:
            if listener is not None:   # rank 0 holds its own copy now
                listener.close()
        try:
            if main:
                signal.pthread_sigmask(signal.SIG_SETMASK, before)
            while not context.join():
                pass
        except mp.ProcessRaisedException as exc:
            raise RankFailed(f"rank {exc.error_index} raised:\n{exc}") from None
        except mp.ProcessExitedException as exc:
            raise RankFailed(f"rank {exc.error_index} exited with code {exc.exit_code}") from None
        except BaseException:   # Ctrl-C or SIGTERM in the parent: no rank outlives it
            for proc in context.processes:
                if proc.is_alive():
                    proc.kill()
                proc.join()
            raise
        return [pickle.loads(Path(tmp, f"rank{r}.pkl").read_bytes()) for r in range(world)]
