"""Writing device profiles: the one writer, for `planner profile` (a new file) and `planner
calibrate` (the base profile's text with fitted values set). Every number in a profile cites its
source, so the writer keeps comments: tomlkit builds and edits the document, comments included.
Reading is `costmodel.hardware.load_profile`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import tomlkit
from tomlkit.items import Table

from costmodel.hardware import DeviceProfile, parse_profile

# (key, value, comment or None)
Row = tuple[str, Any, str | None]


def document(header: Iterable[str]) -> tomlkit.TOMLDocument:
    doc = tomlkit.document()
    for line in header:
        doc.add(tomlkit.comment(line))
    doc.add(tomlkit.nl())
    return doc


def table(rows: Iterable[Row], comment: str | None = None) -> Table:
    out = tomlkit.table()
    if comment:
        out.comment(comment)
    for key, value, note in rows:
        set_value(out, key, value, note)
    return out


def set_value(container, key: str, value: Any, comment: str | None = None) -> None:
    """Set `key` (added or replaced) with `comment` after it (kept as it was when None)."""
    item = tomlkit.item(_plain(value))
    if comment is None and key in container:
        old = container.item(key) if hasattr(container, "item") else None
        comment = old.trivia.comment.lstrip("# ").rstrip() if old is not None and old.trivia.comment else None
    if comment:
        item.comment(comment)
    container[key] = item


def networks(tiers: Iterable[Iterable[Row]]) -> tomlkit.items.AoT:
    out = tomlkit.aot()
    for rows in tiers:
        out.append(table(rows))
    return out


def write(path: Path, doc: tomlkit.TOMLDocument, overwrite: bool = True) -> DeviceProfile:
    """Whole or not at all (planner.outputs.write_file: not over a file that appeared meanwhile
    unless `overwrite`): never half a profile, and never one the reader would refuse (a fitted
    number out of its range is an error here, named). Returns the profile as the reader reads it."""
    from planner import outputs
    device = checked(path, doc)
    outputs.write_file(path, tomlkit.dumps(doc), overwrite)
    return device


def checked(path: Path, doc: tomlkit.TOMLDocument) -> DeviceProfile:
    """The profile `doc` as the reader would read it from `path`, or its refusal (UserError)."""
    return parse_profile(tomlkit.dumps(doc), path)


def parse(text: str) -> tomlkit.TOMLDocument:
    return tomlkit.parse(text)


def _plain(value: Any) -> Any:
    """Tuples as arrays, curves' points as arrays of two floats, dicts as inline tables."""
    if isinstance(value, dict):
        inline = tomlkit.inline_table()
        inline.update({k: _plain(v) for k, v in value.items()})
        return inline
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, float):
        return float(f"{value:.6g}")   # six significant digits: what was measured, no more
    return value
