"""The one boundary for what users hand us: every file is read here, and every JSON object is
checked against the dataclass it becomes, so an error names the file and the field.

Readers above this (plan files, model configs, measured runs, profiles, CSV tables) only add
what is particular to their kind; none of them opens a file or trusts a JSON value's type.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
import types
import typing
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Any

# A plan, config, profile or table is kilobytes; anything this large is not one of them.
MAX_INPUT_BYTES = 64 * 1024 * 1024

# Sanity limits on sizes: far beyond any published run (the largest have ~100k GPUs, 126 layers,
# 256k vocabularies, 1M-token contexts and batches of a few thousand sequences), near enough that
# nothing loops for minutes on them (the pipeline simulation is linear in micro-batches).
MAX_WORLD_SIZE = 1 << 20
MAX_LAYERS = 10_000
MAX_WIDTH = 1 << 20          # hidden, FFN, heads
MAX_VOCAB = 1 << 24
MAX_EXPERTS = 1 << 14         # routed experts per layer; published models use up to a few hundred
MAX_SEQ_LEN = 1 << 24
MAX_GLOBAL_BATCH = 1 << 16    # sequences; published LLM runs use up to a few thousand


MISSING = dataclasses.MISSING   # "no default": the key is required


class UserError(ValueError):
    """A file or value a user handed us is not what it must be: one line naming file and field."""


def check_limit(where: str, name: str, value: int, limit: int) -> None:
    # a plain ValueError: the reader that called the dataclass puts the file in front
    if value > limit:
        raise UserError(f"{where}: {name} {value:,} is beyond this planner's limit of {limit:,}")


def _os_reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def read_bytes(path: Path | str, what: str) -> bytes:
    """The whole file, or an UserError saying what is wrong with the path."""
    path = Path(path)
    try:
        if path.is_dir():
            raise UserError(f"{what} {path} is a directory, not a file")
        if not stat.S_ISREG(path.stat().st_mode):   # /dev/zero, a FIFO: endless or blocking
            raise UserError(f"{what} {path} is not a regular file")
        with open(path, "rb") as fh:
            raw = fh.read(MAX_INPUT_BYTES + 1)   # the size a file reports is not trusted
        if len(raw) > MAX_INPUT_BYTES:
            raise UserError(f"{what} {path} is over {MAX_INPUT_BYTES // 2**20} MiB; a {what} is far smaller")
        return raw
    except FileNotFoundError:
        raise UserError(f"{what} {path} does not exist") from None
    except OSError as exc:   # permission, symlink loop, I/O error
        raise UserError(f"{what} {path}: cannot read ({_os_reason(exc)})") from None


def read_text(path: Path | str, what: str) -> str:
    raw = read_bytes(path, what)
    try:
        return raw.decode("utf-8-sig")   # a byte-order mark is not part of the first column's name
    except UnicodeDecodeError:
        raise UserError(f"{what} {path} is not a text file (not UTF-8)") from None


def _cut_short(text: str, exc: json.JSONDecodeError) -> bool:
    """Whether a JSON error is where a text cut short would put it: a string left open, or nothing
    but the rest of one token (a number, a literal, a key) after the error's place."""
    if exc.msg.startswith("Extra data"):   # what follows a whole value: nothing was cut
        return False
    return exc.msg.startswith("Unterminated string") or re.fullmatch(r'[^\s{}\[\],:"]*\s*', text[exc.pos:]) is not None


def read_json_object(path: Path | str, what: str) -> dict[str, Any]:
    text = read_text(path, what)
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except DuplicateKey as exc:
        raise UserError(f"{what} {path}: key {exc.args[0]!r} is given twice in one object (which one was meant?)") from None
    except json.JSONDecodeError as exc:   # "truncated?" only where the text may end early
        cut = " (truncated?)" if _cut_short(text, exc) else ""
        raise UserError(f"{what} {path}: not valid JSON{cut}: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise UserError(f"{what} {path}: nested too deeply to be a {what}") from None
    except ValueError as exc:   # e.g. an integer of over 4,300 digits
        raise UserError(f"{what} {path}: not readable JSON ({str(exc).split(';')[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"{what} {path}: a JSON object is expected, not {_kind(data)}")
    return data


class DuplicateKey(ValueError):
    """A JSON object with one key twice: json.loads would keep the last one without a word."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, item in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = item
    return out


def _shown(raw: Any) -> str:
    if raw is None:
        return "null"
    text = repr(raw) if not isinstance(raw, int) or abs(raw) < 10**40 else "(an integer of over 40 digits)"
    return f"{_kind(raw)} {text if len(text) <= 40 else text[:37] + '...'}"


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def value(data: dict[str, Any], key: str, kind: Any, where: str, default: Any = MISSING) -> Any:
    """data[key] checked against `kind` (int, float, bool, str, an Enum, tuple[X, ...], X | None).
    A key with a default may be absent or null (Hugging Face configs write `"n_inner": null`)."""
    if key not in data or (data[key] is None and default is not MISSING):
        if default is MISSING:
            raise UserError(f"{where}: {key} is missing")
        return default
    return _coerce(data[key], kind, f"{where}: {key}")


def positive_field(data: dict[str, Any], key: str, where: str, default: Any = MISSING) -> int | None:
    """data[key] as a positive integer (or `default`, which may be None, when absent or null)."""
    number = value(data, key, int, where, default)
    if number is not None and number <= 0:
        raise UserError(f"{where}: {key} must be a positive integer, not {number}")
    return number


def _coerce(raw: Any, kind: Any, where: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        kind = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return raw
    if origin is dict:
        if not isinstance(raw, dict):
            raise UserError(f"{where} must be a JSON object, not {_kind(raw)}")
        return {k: _coerce(v, args[1], f"{where}.{k}") for k, v in raw.items()}
    if origin is list:
        if not isinstance(raw, list):
            raise UserError(f"{where} must be a list, not {_kind(raw)}")
        return [_coerce(item, args[0], f"{where}[{i}]") for i, item in enumerate(raw)]
    if origin is tuple:
        if not isinstance(raw, (list, tuple)):
            raise UserError(f"{where} must be a list, not {_kind(raw)}")
        return tuple(_coerce(item, args[0], f"{where}[{i}]") for i, item in enumerate(raw))
    if isinstance(kind, type) and issubclass(kind, Enum):
        choices = [str(m.value) for m in kind]
        if not isinstance(raw, str) or raw not in choices:
            raise UserError(f"{where} must be one of {', '.join(choices)}, not {raw!r}")
        return kind(raw)
    if kind is bool:
        if not isinstance(raw, bool):
            raise UserError(f"{where} must be true or false, not {_shown(raw)}")
        return raw
    if kind is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise UserError(f"{where} must be an integer, not {_shown(raw)}")
        return raw
    if kind is float:
        try:
            number = None if isinstance(raw, bool) or not isinstance(raw, (int, float)) else float(raw)
        except OverflowError:   # an integer of hundreds of digits
            number = None
        if number is None or not math.isfinite(number):
            raise UserError(f"{where} must be a finite number, not {_shown(raw)}")
        return number
    if kind is str:
        if not isinstance(raw, str):
            raise UserError(f"{where} must be a string, not {_kind(raw)}")
        if not raw.isprintable():   # a newline in a name would reach launch scripts and paths
            raise UserError(f"{where} holds control characters (a newline?)")
        return raw
    raise TypeError(f"no input rule for {kind!r}")   # a programming error, not a user's


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def dataclass_from_json(cls: type, data: Any, where: str):
    """`cls(**data)` after checking that data is an object with exactly cls's fields (those with
    defaults may be left out), each of its annotated type; the dataclass's own checks
    (__post_init__) then speak with `where` in front."""
    if not isinstance(data, dict):
        raise UserError(f"{where} must be a JSON object, not {_kind(data)}")
    fields = dataclasses.fields(cls)
    names = {f.name for f in fields}
    if unknown := sorted(set(data) - names):
        raise UserError(f"{where}: unknown keys {unknown}")
    required = {f.name for f in fields if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING}
    if missing := sorted(required - set(data)):
        raise UserError(f"{where}: missing keys {missing}")
    hints = _hints(cls)
    kwargs = {name: _coerce(raw, hints[name], f"{where}: {name}") for name, raw in data.items()}
    try:
        return cls(**kwargs)
    except ValueError as exc:   # the dataclass's own checks, which do not know the file
        raise UserError(f"{where}: {exc}") from None


def write_text_atomic(path: Path, text: str) -> None:
    """Write to a temporary name beside `path`, then rename: a reader (or a resume) never sees a
    half-written file, and an interrupted write leaves the old one whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class NotFinite(ValueError):
    """A number without a finite value bound for JSON where none may be: a bug, shown as one."""


def json_text(doc: Any) -> str:
    """Every JSON document a command writes or prints (strict: `allow_nan=False`). An infinity is
    null: an unbounded value, documented where a field can hold one (a run that never ends: its
    days, GPU-hours and cost, --tokens' help). A NaN is a bug (NotFinite, naming the field), never
    written as a number or as a silent null."""
    return json.dumps(_finite(doc, "$"), indent=2, allow_nan=False) + "\n"


def _finite(doc: Any, where: str) -> Any:
    if isinstance(doc, float) and not math.isfinite(doc):
        if math.isnan(doc):
            raise NotFinite(f"{where} is not a number (NaN) in a JSON output")
        return None
    if isinstance(doc, dict):
        return {k: _finite(v, f"{where}.{k}") for k, v in doc.items()}
    if isinstance(doc, (list, tuple)):
        return [_finite(v, f"{where}[{i}]") for i, v in enumerate(doc)]
    return doc
