"""The branch and bound runs over two halves of the space at once, one in a forked process.

Each half (every other TP, CP, EP and expert-TP degree and micro-batch size, in listing order,
with every pipeline depth of it: planner.candidates.placement_groups' `share`, so that each
process prices the kernels of its own shapes) is its own exact branch and bound with its own
cutoff, from its own plans (planner.cutoff): a cutoff no tighter than the whole search's would be, so
each half examines every plan of its share that one search over the whole space would, and the
best plans of the two together are the best of the space. The halves are the same on every
machine: where there is no fork (or no second core), or where PLANNER_SEARCH_PROCESSES=1 asks for
one process (the test suite's workers, which keep every core busy already), they run one after
the other, with the same answer. The repricing's simulations and a report's figures
(reports.document.Document.draw_figures) are shared between the two processes the same way.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from typing import Callable, TypeVar

from costmodel.inputs import UserError

T = TypeVar("T")
U = TypeVar("U")
HALVES = 2


def in_halves(run_half: Callable[[int], T]) -> list[T]:
    """[run_half(0), run_half(1)]: the second in a forked child while this process runs the
    first, where the platform forks (Linux) and has a second core; one after the other
    otherwise. A failure in the child is raised here with its traceback, as the bug it is;
    Ctrl-C, SIGTERM or any error here ends the child at once."""
    if not _forks():
        return [run_half(i) for i in range(HALVES)]
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: never returns
        os.close(read_fd)
        _child(run_half, write_fd)
    os.close(write_fd)
    done = False
    try:
        mine = run_half(0)
        theirs = _receive(read_fd)
        done = True
    finally:
        os.close(read_fd)
        if not done:
            _end(pid)
        os.waitpid(pid, 0)
    return [mine, theirs]


def map_in_halves(fn: Callable[[T], U], items: list[T]) -> list[U]:
    """[fn(x) for x in items], every other item priced in the forked child (in_halves): the same
    list in the same order, on one core or two."""
    if len(items) < 2:
        return [fn(x) for x in items]
    halves = in_halves(lambda i: [fn(x) for x in items[i::HALVES]])
    return [halves[i % HALVES][i // HALVES] for i in range(len(items))]


def _forks() -> bool:
    processes = os.environ.get("PLANNER_SEARCH_PROCESSES", "2").strip()
    if processes not in ("1", "2"):
        raise UserError(f"PLANNER_SEARCH_PROCESSES={processes!r}: the search runs in 1 or 2 processes")
    return sys.platform == "linux" and (os.cpu_count() or 1) >= 2 and processes == "2"


def _child(run_half: Callable[[int], object], write_fd: int) -> None:
    """Run the second half and send its result (or the traceback) down the pipe. Signals are
    the parent's to handle: it ends this process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        payload = pickle.dumps(("ok", run_half(1)), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException:   # noqa: BLE001 -- reported to the parent, which raises it
        payload = pickle.dumps(("error", traceback.format_exc()))
    try:
        left = memoryview(payload)
        while left:
            left = left[os.write(write_fd, left):]
    finally:
        os._exit(0)   # no atexit handlers, no flushing of the parent's buffers


def _receive(read_fd: int) -> object:
    chunks = []
    while chunk := os.read(read_fd, 1 << 20):
        chunks.append(chunk)
    if not chunks:
        raise RuntimeError("the search's second half ended without a result (its process was killed)")
    status, value = pickle.loads(b"".join(chunks))
    if status == "error":
        raise RuntimeError(f"the search's second half failed:\n{value}")
    return value


def _end(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
