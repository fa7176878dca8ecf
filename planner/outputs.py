"""Every path a command will write is checked before its work starts (so no work is lost to a bad
`--out`), and a used one is refused unless --overwrite: nothing is replaced silently. Every
output is then written whole or not at all and published without replacing a file that appeared
meanwhile (write_file, staged_dir, new_stream); every JSON document is strict (json_text). A run
directory is held by one run at a time: planner.run_lock."""
from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from costmodel.inputs import NotFinite, UserError, json_text  # noqa: F401 - the commands' JSON, written once

REPORT_FILES = ("index.html", "index.md")
# every figure a report may hold (reports.style.save writes NAME.png and NAME.svg): an earlier
# report's figures that a new one over it does not draw are removed, so the directory is one report
REPORT_FIGURES = tuple(f"{stem}.{ext}" for stem in ("ledger", "bubble_schedules", "bubble_warmup", "memory_stages",
                                                    "memory_over_time", "ranking_scatter", "measured", "scaling")
                       for ext in ("png", "svg"))
RUN_FILES = ("measured.json", "run.log", "raw.json")   # raw.json: rank 0's figures, replaced by each run


def writable_dir_problem(directory: Path) -> str | None:
    """Why files cannot be created in `directory` (or in the first existing parent it would be
    created under), or None. Tried, not guessed: os.access says yes on an immutable directory
    and on some read-only mounts."""
    probe_dir = directory
    while not probe_dir.exists():
        if probe_dir.is_symlink():   # a link to nothing, or to itself: mkdir would find a file there
            return f"{probe_dir} is a symbolic link that leads nowhere (a loop, or a missing target)"
        if probe_dir.parent == probe_dir:
            return f"{directory} cannot be created"
        probe_dir = probe_dir.parent
    if not probe_dir.is_dir():
        return f"{probe_dir} is not a directory"
    probe = probe_dir / f".planner-write-test-{os.getpid()}"
    try:
        probe.touch(exist_ok=False)
        probe.unlink()
    except OSError as exc:
        return f"cannot write in {probe_dir} ({exc.strerror or type(exc).__name__})"
    return None


def out_file(path: str | Path | None, flag: str, overwrite: bool, suffix: str | None = None) -> Path | None:
    """`path` as a file this command may write, or an UserError saying why not."""
    if path is None:
        return None
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{flag} {path} is a directory; give a file name")
    if suffix and path.suffix != suffix:
        raise UserError(f"{flag} {path}: expected a {suffix} file")
    if path.exists() or path.is_symlink():
        if not overwrite:
            raise UserError(f"{flag} {path} exists; pass --overwrite to replace it")
        if not os.access(path, os.W_OK):
            raise UserError(f"{flag} {path} exists and is not writable")
    if problem := writable_dir_problem(path.parent):
        raise UserError(f"{flag} {path}: {problem}")
    return path


def out_dir(path: str | Path | None, flag: str, overwrite: bool, products: tuple[str, ...]) -> Path | None:
    """`path` as a directory this command may fill: one that holds none of the files the command
    writes (`products`; other files, e.g. the plan a run was asked to run, may be there), or any
    with --overwrite."""
    if path is None:
        return None
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file; give a directory")
    used = [name for name in products if (path / name).exists()] if path.is_dir() else []
    if used and not overwrite:
        raise UserError(f"{flag} {path} holds an earlier result ({', '.join(used)}); pass --overwrite to "
                         "replace it, or choose another directory")
    if problem := writable_dir_problem(path):
        raise UserError(f"{flag} {path}: {problem}")
    return path


def make_dir(directory: Path) -> None:
    """`directory` and its parents; a file where one of them should be (put there after the
    command checked its path) is named, not said as mkdir's "File exists" or "Not a directory"."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise NotADirectoryError(errno.ENOTDIR, f"{_first_file(directory)} is not a directory") from None


def _first_file(directory: Path) -> Path:
    return next((p for p in (directory, *directory.parents) if p.exists() and not p.is_dir()), directory)


class WriteFailed(Exception):
    """An output could not be written (disk full, an I/O error, a read-only file system, its
    directory removed meanwhile, standard output closed or full): neither the user's mistake nor a
    bug, so the command line says it in one line of its own and exits 1."""

    def __init__(self, where: str | Path, exc: OSError):
        self.where, self.errno = str(where), exc.errno
        super().__init__(f"cannot write {where}: {exc.strerror or exc}")


class Clobbered(UserError):
    """The output appeared after the command checked its path: another command wrote it."""


def write_file(path: str | Path, data: str | bytes, overwrite: bool) -> None:
    """`data` to `path` whole or not at all: written to a temporary name beside it, then published
    without replacing a file that appeared there meanwhile (with --overwrite, replaced atomically)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        make_dir(path.parent)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)   # the umask's mode, as open() gives
    except OSError as exc:
        raise WriteFailed(path, exc) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())   # a full disk says so here, not after the file is published
        publish(tmp, path, overwrite)
        _remember(path)
    except OSError as exc:
        raise WriteFailed(path, exc) from None
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def new_stream(path: str | Path, overwrite: bool) -> Iterator:
    """`path` opened for a log a command writes as it goes (run.log): published empty at once, not
    over a file that appeared meanwhile (with --overwrite, replacing it in one step), then written
    in place; a failed write of it is a WriteFailed naming it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        make_dir(path.parent)
        stream = open(tmp, "x", encoding="utf-8")   # noqa: SIM115 - closed below, after its block
    except OSError as exc:
        raise WriteFailed(path, exc) from None
    try:
        publish(tmp, path, overwrite)
    except BaseException as exc:
        stream.close()
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise WriteFailed(path, exc) from None
        raise
    tmp.unlink(missing_ok=True)   # a hard link's first name: the file is `path` now
    from planner.streams import Guarded  # here, not above: planner.streams imports this module
    try:
        yield Guarded(stream, path)
    except BaseException:
        with contextlib.suppress(OSError):
            stream.close()
        raise
    try:
        stream.close()
    except OSError as exc:
        raise WriteFailed(path, exc) from None


def publish(tmp: Path, final: Path, overwrite: bool) -> None:
    """Give the whole file `tmp` the name `final`: replacing it (overwrite), or only where nothing
    is there, in one step a second writer cannot come between (Clobbered if one did)."""
    if overwrite:
        os.replace(tmp, final)
        return
    try:
        try:
            os.link(tmp, final)
        except FileExistsError:
            raise
        except OSError as exc:   # a file system without hard links
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                raise
            _rename_no_replace(tmp, final, exc)
    except FileExistsError:
        raise Clobbered(f"{final} appeared while this command ran (written by another?); nothing replaced: "
                        "pass --overwrite to replace it, or choose another name") from None


def _rename_no_replace(tmp: Path, final: Path, cause: OSError) -> None:
    """renameat2(RENAME_NOREPLACE) (Linux): atomic and refusing an existing target, like link."""
    libc = ctypes.CDLL(None, use_errno=True)
    if not hasattr(libc, "renameat2"):
        raise cause
    at_fdcwd, rename_noreplace = -100, 1
    if libc.renameat2(at_fdcwd, os.fsencode(tmp), at_fdcwd, os.fsencode(final), rename_noreplace) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(final))


@contextlib.contextmanager
def staged_dir(final: str | Path, overwrite: bool, claims: tuple[str, ...] = (),
               retired: tuple[str, ...] = ()) -> Iterator[Path]:
    """A temporary sibling of `final` to write a directory's files into; when the block ends well
    they are published into `final` (the `claims` first and not over anything, so of two commands
    filling one directory one is refused; the rest replace what is there only with `overwrite`).
    `retired`: names an earlier product of this kind may have left there; where one replaces an
    earlier product (a claim was there), those of them it does not write are removed.
    A failed write leaves no file, whole or truncated, under a final name."""
    final = Path(final)
    try:
        make_dir(final.parent)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    except OSError as exc:
        raise WriteFailed(final, exc) from None
    try:
        try:
            yield tmp
            earlier = any((final / name).exists() for name in claims)
            names = {p.name for p in tmp.iterdir()}
            _publish_dir(tmp, final, overwrite, claims)
            if earlier:
                _remove_stale(names, final, retired)
        except OSError as exc:
            raise WriteFailed(final, exc) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish_dir(tmp: Path, final: Path, overwrite: bool, claims: tuple[str, ...]) -> None:
    make_dir(final)
    names = sorted(p.name for p in tmp.iterdir())
    taken = [n for n in names if n not in claims and (final / n).exists() and not _ours(final / n)] \
        if not overwrite else []
    if taken:   # a report's figures beside the user's own files of those names
        raise UserError(f"{final} holds {', '.join(taken)}, which this report would replace; the report is not "
                        "written: pass --overwrite to replace them, or choose another directory")
    claimed: list[str] = []
    try:
        for name in (n for n in claims if n in names):
            publish(tmp / name, final / name, overwrite)
            claimed.append(name)
    except Clobbered:
        for name in claimed:   # ours, published a moment ago: the other command's directory stays whole
            (final / name).unlink(missing_ok=True)
        raise
    for name in names:
        if name not in claimed:
            os.replace(tmp / name, final / name)
    for name in names:
        _remember(final / name)


def _remove_stale(written: set[str], final: Path, retired: tuple[str, ...]) -> None:
    """The `retired` names in `final` that the product just published there did not write: an
    earlier product's files, which would sit beside it as if they were its own."""
    for name in retired:
        if name not in written:
            (final / name).unlink(missing_ok=True)


# path -> modification time of what this process published there: a command's own earlier file
# (sweep --plot DIR/scaling.png --report DIR) is not a user's file its report would replace
_WRITTEN: dict[Path, int] = {}


def _remember(path: Path) -> None:
    with contextlib.suppress(OSError):
        _WRITTEN[path.resolve()] = path.stat().st_mtime_ns


def _ours(path: Path) -> bool:
    try:
        return _WRITTEN.get(path.resolve()) == path.stat().st_mtime_ns
    except OSError:
        return False
