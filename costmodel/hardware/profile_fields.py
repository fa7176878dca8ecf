"""One profile value by its table and key, checked for its kind before any check of its range:
every error names the file, the table and the key."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from costmodel.inputs import UserError

# The precisions a peak may be given for: the training dtypes (costmodel.specs.DType) and fp8's
# tensor-core rate (costmodel.kernels.gemm).
PEAK_DTYPES = ("fp32", "bf16", "fp16", "fp8")


def _present(path: Path, table: str, raw: Any, key: str, default: Any) -> Any:
    if not isinstance(raw, dict):
        raise UserError(f"{path}: [{table}] is not a table")
    if key not in raw:
        if default is None:
            raise UserError(f"{path}: [{table}] {key} is missing")
        return default
    return raw[key]


def real(path: Path, table: str, raw: Any, key: str, default: float | None = None) -> float:
    """A finite number (TOML integer or float; not a string or a boolean); its range is the
    profile check's (profile_problems). Absent: `default`, or an error when it has none."""
    value = _present(path, table, raw, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{path}: [{table}] {key} is a number, got {value!r}")
    return float(value)


def whole(path: Path, table: str, raw: Any, key: str, default: int | None = None) -> int:
    """A count or a size in bytes: an integer, or a float with a whole value (a profile written by
    hand may say 2.0e9); not an infinity or a NaN, which int() cannot take."""
    value = _present(path, table, raw, key, default)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (isinstance(value, float) and not (math.isfinite(value) and value.is_integer()))):
        raise UserError(f"{path}: [{table}] {key} is a whole number, got {value!r}")
    return int(value)


def flag(path: Path, table: str, raw: Any, key: str) -> bool:
    """An optional true/false key (absent: false)."""
    value = _present(path, table, raw, key, False)
    if not isinstance(value, bool):
        raise UserError(f"{path}: [{table}] {key} is true or false, got {value!r}")
    return value


def text(path: Path, table: str, raw: Any, key: str, default: str | None = None) -> str:
    value = _present(path, table, raw, key, default)
    if not isinstance(value, str):
        raise UserError(f"{path}: [{table}] {key} is a string, got {value!r}")
    return value


def names(path: Path, table: str, raw: Any, key: str) -> tuple[str, ...]:
    """A list of strings (a device's aliases; absent: none)."""
    value = _present(path, table, raw, key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise UserError(f"{path}: [{table}] {key} is a list of names, got {value!r}")
    return tuple(value)


def peaks(path: Path, raw: Any) -> tuple[tuple[str, float], ...]:
    """[device] peak_flops_per_s: {dtype: FLOP/s} for dtypes of PEAK_DTYPES."""
    table = _present(path, "device", raw, "peak_flops_per_s", None)
    if not isinstance(table, dict) or not table:
        raise UserError(f"{path}: [device] peak_flops_per_s is a table of dtype = FLOP/s, got {table!r}")
    if unknown := sorted(set(table) - set(PEAK_DTYPES)):
        raise UserError(f"{path}: [device] peak_flops_per_s: unknown dtype(s) {', '.join(unknown)} "
                         f"(known: {', '.join(PEAK_DTYPES)})")
    return tuple((k, real(path, "device.peak_flops_per_s", table, k)) for k in table)
