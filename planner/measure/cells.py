"""Cells of a runs-table row read as numbers, flags and choices, each error naming the row and
the column (planner.measure.runs_table's one boundary); and the date the arXiv paper a row's
source names gives its run."""
from __future__ import annotations

import math
import re

from costmodel.inputs import UserError

_ARXIV_ID = re.compile(r"\b(\d{4})\.(\d{4,5})\b")


def int_cell(row: dict[str, str], key: str, default: int | None = None, low: int = 1,
         high: int | None = None) -> int | None:
    """A size or degree in [low, high] (a positive integer unless said), or `default` when empty."""
    return number_cell(row, key, int, default, low, high)


def number_cell(row: dict[str, str], key: str, kind: type, default, low, high):
    """An int or float cell in [low, high] (no upper limit: None), or `default` when empty."""
    value = (row.get(key) or "").strip()
    if not value:
        return default
    try:
        number = kind(value)
    except ValueError:
        raise UserError(f"row {row.get('id')!r}: {key} = {value!r} is not "
                         f"{'an integer' if kind is int else 'a number'}") from None
    if not math.isfinite(number):   # float('nan') and float('inf') parse, and NaN passes every comparison
        raise UserError(f"row {row.get('id')!r}: {key} = {value} is not a finite number")
    if number < low or (high is not None and number > high):
        shown = lambda x: f"{x:g}" if isinstance(x, float) else str(x)  # noqa: E731
        raise UserError(f"row {row.get('id')!r}: {key} = {shown(number)} is out of range "
                         f"({f'{shown(low)} to {shown(high)}' if high is not None else f'at least {shown(low)}'})")
    return number


def flag_cell(row: dict[str, str], key: str, default: bool) -> bool:
    value = (row.get(key) or "").strip().lower()
    if not value:
        return default
    if value not in ("yes", "no", "true", "false", "1", "0"):
        raise UserError(f"row {row.get('id')!r}: {key} = {value!r} is not yes or no")
    return value in ("yes", "true", "1")


def choice_cell(row: dict[str, str], key: str, allowed: tuple[str, ...], default: str) -> str:
    """A cell that names one of `allowed` (lower case), or `default` when empty."""
    value = (row.get(key) or "").strip().lower()
    if not value:
        return default
    if value not in allowed:
        raise UserError(f"row {row.get('id')!r}: {key} = {value!r} is not one of {', '.join(allowed)}")
    return value


def published_before(row: dict[str, str], arxiv_id: tuple[int, int]) -> bool:
    """Whether the row's source names an arXiv paper older than `arxiv_id` (yymm, number): a run
    that paper describes trained before what appeared there or later."""
    arxiv = _ARXIV_ID.search(row.get("source", ""))
    return bool(arxiv) and (int(arxiv[1]), int(arxiv[2])) < arxiv_id
