"""A command's standard streams when they fail. Standard output (and a log a command writes as it
goes, planner.outputs.new_stream) closed, full or broken: a WriteFailed naming it, which the
command line says in one line, exit 1. Standard error closed or full: nothing can say so, so its
writes are dropped and the command ends with exit 1 where it would have ended with 0."""
from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from planner.outputs import WriteFailed

STDOUT = "standard output"


class Guarded:
    """A text stream whose OSError writing or flushing it (a closed pipe, a full device, a closed
    descriptor) is a WriteFailed naming `where`, never a traceback."""

    def __init__(self, stream, where: str | Path = STDOUT):
        self.stream, self.where = stream, where

    def write(self, text: str) -> int:
        return self._call("write", text)

    def writelines(self, lines) -> None:
        self._call("writelines", lines)

    def flush(self) -> None:
        if self.stream is not None:   # closed from the start: nothing was written, nothing to flush
            self._call("flush")

    def _call(self, name: str, *args):
        if self.stream is None:   # the process was started with this stream closed
            raise WriteFailed(self.where, OSError(errno.EBADF, "it is closed"))
        try:
            return getattr(self.stream, name)(*args)
        except OSError as exc:
            raise WriteFailed(self.where, exc) from None

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def guarded_stdout() -> Iterator[None]:
    stream = sys.stdout
    sys.stdout = Guarded(stream)
    try:
        yield
    finally:
        sys.stdout = stream


class QuietStderr:
    """sys.stderr where it may be closed or full: a failed write is dropped and remembered
    (`failed`), and descriptor 2 pointed at /dev/null so that no later flush fails at exit. A
    closed one stays closed: print(file=None) would write to standard output instead."""

    def __init__(self, stream):
        self.stream, self.failed = stream, False

    def write(self, text: str) -> int:
        self._call("write", text)
        return len(text)

    def flush(self) -> None:
        self._call("flush")

    def _call(self, name: str, *args) -> None:
        if self.failed:
            return
        try:
            if self.stream is None:
                raise OSError(errno.EBADF, "closed")
            getattr(self.stream, name)(*args)
        except (OSError, ValueError):   # ValueError: a stream closed from Python
            self.failed = True
            _to_devnull(self.stream, 2)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def quiet_stderr() -> Iterator[QuietStderr]:
    stream = sys.stderr
    sys.stderr = guard = QuietStderr(stream)
    try:
        yield guard
    finally:
        sys.stderr = stream


def silence_stdout() -> None:
    """Point descriptor 1 at /dev/null when it is this process's standard output whose writes
    failed: what is left in its buffer is then flushed there at exit, not as a second error."""
    _to_devnull(sys.stdout, 1)


def _to_devnull(stream, fd: int) -> None:
    """Only where `stream` writes to descriptor `fd` itself (not a test's capture)."""
    try:
        if stream is None or stream.fileno() != fd:
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except (OSError, ValueError, AttributeError):   # a stream without a descriptor
        return
