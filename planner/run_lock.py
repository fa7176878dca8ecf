"""A run directory held by one run at a time (run_dir_lock), and the check that it is still the
one held when results are written (check_held): the run's side of planner.outputs' boundary."""
from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from costmodel.inputs import UserError
from planner.outputs import WriteFailed, make_dir

LOCK_NAME = ".lock"


@contextlib.contextmanager
def run_dir_lock(directory: Path, flag: str = "--out") -> Iterator[None]:
    """Hold `directory` for one run: a second run into it is refused while this one lasts. The
    lock is flock(2) on DIRECTORY/.lock holding the pid: the kernel drops it when its process
    ends, however it ends, so a stale lock file left by a killed run is simply taken. A directory
    made here and left empty (a run refused before it started) is removed with the lock."""
    created = not directory.exists()
    fd = _take_lock(directory, flag)
    key = Path(os.path.abspath(directory))
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:   # a full disk: said before the run, not as a bug
            raise WriteFailed(directory / LOCK_NAME, exc) from None
        _HELD[key] = fd
        yield
    finally:
        _HELD.pop(key, None)
        with contextlib.suppress(OSError):
            (directory / LOCK_NAME).unlink()   # while still held: a waiting run locks a removed file, tries again
            if created:
                directory.rmdir()   # only if empty: a run's files, or the next run's lock, keep it
        os.close(fd)


_HELD: dict[Path, int] = {}   # the directories this process holds, by absolute path: their lock's descriptor


def check_held(directory: Path) -> None:
    """WriteFailed unless `directory` is still the one this process locked: removed or moved while
    the run held it, a result written there now would land in a new directory, apart from its log."""
    fd = _HELD.get(Path(os.path.abspath(directory)))
    if fd is not None and not _same_file(fd, directory / LOCK_NAME):
        raise WriteFailed(directory, OSError(errno.ENOENT, "it was removed or moved while the run held it "
                                                          "(its lock file is gone); its results are not written"))


def _take_lock(directory: Path, flag: str) -> int:
    import fcntl
    path = directory / LOCK_NAME
    for attempt in range(100):   # each retry follows another run's ending; a hundred are not a race
        try:
            make_dir(directory)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError) and attempt < 99:   # removed by the run that just ended
                continue
            raise WriteFailed(directory, exc) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise UserError(f"{flag} {directory} is in use by another run (pid {holder}); wait for it to end "
                            "or choose another directory") from None
        if _same_file(fd, path):   # not a lock file its last holder removed before we locked it
            return fd
        os.close(fd)
    raise WriteFailed(directory, OSError(errno.EAGAIN, "its lock file keeps being replaced"))


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return os.path.samestat(os.fstat(fd), st)
