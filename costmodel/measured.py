"""`measured.json`: what `planner run` measured, beside what was predicted (versioned like
plan.json, strict on read; written and read here only).

Version 1 added `version` and `peak_reserved_bytes`; version 2 `complete` (false when the run was
interrupted and the file holds the steps measured before it). A file without `version` (written
before 2026-11-24) is read as version 0 and migrated. A newer version, a truncated file or one with
missing or unknown fields is refused with one line that names the file and the field.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from costmodel.inputs import InputError, dataclass_from_json, read_json_object, write_text_atomic

MEASURED_FORMAT_VERSION = 2


@dataclass(frozen=True, kw_only=True)
class MeasuredRun:
    step_time_s: float                 # median of the timed steps, slowest rank
    tokens_per_s: float
    mfu: float                         # the cost model's FLOPs over the device peak
    peak_memory_bytes: list[float] | None    # per pipeline stage (CUDA: max_memory_allocated)
    losses: list[float]                # every step, warm-up included
    step_times_s: list[float]
    predicted: dict[str, Any]          # Estimate.to_dict() of the plan on its profile
    error_pct: dict[str, Any]
    stage_breakdown_s: dict[str, list[float]] | None
    predicted_stage_breakdown_s: dict[str, list[float]] | None
    memory_source: str
    predicted_memory_compared_bytes: list[float]
    device: str
    world_size: int
    steps: int
    warmup_steps: int
    wall_s: float
    plan: dict[str, Any]
    model: str
    cluster: str
    peak_reserved_bytes: list[float] | None = None   # CUDA: max_memory_reserved per stage
    complete: bool = True              # False: interrupted, the steps measured before the signal

    @property
    def memory_from_cuda(self) -> bool:
        return self.memory_source.startswith("torch.cuda")

    def to_dict(self) -> dict[str, Any]:
        return {"version": MEASURED_FORMAT_VERSION, **asdict(self)}

    def save(self, path: Path) -> None:
        write_text_atomic(Path(path), json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: Any, where: str = "measured.json") -> "MeasuredRun":
        if not isinstance(data, dict):
            raise InputError(f"{where}: not a measured.json (a JSON object is expected)")
        data = dict(data)
        version = data.pop("version", 0)
        if version not in (0, 1, MEASURED_FORMAT_VERSION):
            raise InputError(f"{where}: measured.json version {version!r}; this planner reads versions 0 "
                             f"to {MEASURED_FORMAT_VERSION} (written by a newer planner?)")
        # Fields added later have defaults: peak_reserved_bytes (v1), complete (v2).
        return dataclass_from_json(cls, data, where)

    @classmethod
    def load(cls, path: Path) -> "MeasuredRun":
        return cls.from_dict(read_json_object(path, "measured run"), str(path))
