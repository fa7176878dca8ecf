"""A checkpoint's manifest: every file it holds, with its size and SHA-256, so that a resume
notices a shard or RNG file that was truncated, overwritten or flipped on storage before loading it.

The ranks write their parts, then read them back and hash them (each rank a share of the files:
`share`), and rank 0 writes `MANIFEST.json` before `COMPLETE`; a checkpoint without one is not
verifiable. Verifying compares every file's size (a `stat`, cheap: what the launcher checks before
starting the ranks) and this rank's share of the digests (the ranks before loading). The cost
model prices the hashing pass (costmodel.resilience.HASH_BYTES_PER_S_PER_DEVICE).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

MANIFEST = "MANIFEST.json"
COMPLETE = "COMPLETE"
_DIGEST = "sha256"
_CHUNK_BYTES = 8 << 20


def listed(root: Path) -> list[str]:
    """Every file under a checkpoint directory but the manifest and the marker, as sorted
    relative POSIX paths (the same list on every rank)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                  if p.is_file() and p.name not in (MANIFEST, COMPLETE))


def mine(names: list[str], share: tuple[int, int]) -> list[str]:
    """This rank's share of `names`: every count-th from its index."""
    index, count = share
    return names[index::count]


def digest(path: Path) -> str:
    h = hashlib.new(_DIGEST)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def entries(root: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"size_bytes", "sha256"}} of the named files."""
    return {n: {"size_bytes": (root / n).stat().st_size, _DIGEST: digest(root / n)} for n in names}


def write(root: Path, files: dict[str, dict]) -> None:
    (root / MANIFEST).write_text(json.dumps({"digest": _DIGEST, "files": dict(sorted(files.items()))}, indent=1))


def _read(root: Path) -> tuple[dict[str, dict] | None, str | None]:
    try:
        doc = json.loads((root / MANIFEST).read_text())
        files = doc["files"]
        if doc.get("digest") != _DIGEST or not isinstance(files, dict) or not files:
            raise ValueError("not a manifest of this planner")
        return files, None
    except FileNotFoundError:
        return None, f"{MANIFEST} is missing (written by an older planner, or removed): it cannot be verified"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return None, f"{MANIFEST} is unreadable ({exc})"


def problem(root: Path, share: tuple[int, int] | None = None) -> str | None:
    """Why the checkpoint at `root` does not match its manifest (naming the file), or None.
    Sizes of every file always; digests of this rank's `share` of them where one is given."""
    files, bad = _read(root)
    if files is None:
        return bad
    for name, entry in files.items():
        path = root / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry.get("size_bytes"):
            return f"{name} is {size} bytes, its manifest says {entry.get('size_bytes')} (truncated or rewritten)"
    for name in mine(sorted(files), share) if share else []:
        if digest(root / name) != files[name].get(_DIGEST):
            return f"{name} does not match its {_DIGEST} in {MANIFEST} (corrupted on storage)"
    return None
