"""Every path a command will write is checked before its work starts (so no work is lost to a bad
`--out`), and a used one is refused unless --overwrite: nothing is replaced silently."""
from __future__ import annotations

import os
from pathlib import Path

from costmodel.inputs import UserError

REPORT_FILES = ("index.html", "index.md")
RUN_FILES = ("measured.json", "run.log")


def writable_dir_problem(directory: Path) -> str | None:
    """Why files cannot be created in `directory` (or in the first existing parent it would be
    created under), or None. Tried, not guessed: os.access says yes on an immutable directory
    and on some read-only mounts."""
    probe_dir = directory
    while not probe_dir.exists():
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
