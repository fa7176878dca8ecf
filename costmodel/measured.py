"""`measured.json`: what `planner run` measured, beside what was predicted (versioned like
plan.json, strict on read; written and read here only).

Version 1 added `version` and `peak_reserved_bytes`; a file without `version` (written before
2026-11-24) is read as version 0 and migrated. A newer version, a truncated file or one with
missing or unknown fields is refused with one line that names the file and the field.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

MEASURED_FORMAT_VERSION = 1


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

    @property
    def memory_from_cuda(self) -> bool:
        return self.memory_source.startswith("torch.cuda")

    def to_dict(self) -> dict[str, Any]:
        return {"version": MEASURED_FORMAT_VERSION, **asdict(self)}

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, data: Any, where: str = "measured.json") -> "MeasuredRun":
        if not isinstance(data, dict):
            raise ValueError(f"{where}: not a measured.json (a JSON object is expected)")
        data = dict(data)
        version = data.pop("version", 0)
        if version == 0:
            data.setdefault("peak_reserved_bytes", None)   # version 0 did not record it
        elif version != MEASURED_FORMAT_VERSION:
            raise ValueError(f"{where}: measured.json version {version}; this planner reads versions 0 and "
                             f"{MEASURED_FORMAT_VERSION} (written by a newer planner?)")
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.name != "peak_reserved_bytes"}
        if missing := sorted(required - set(data)):
            raise ValueError(f"{where}: measured.json lacks {', '.join(missing)}")
        if unknown := sorted(set(data) - names):
            raise ValueError(f"{where}: measured.json has unknown fields {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def load(cls, path: Path) -> "MeasuredRun":
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"{path}: cannot read ({exc.strerror})") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON (truncated? {exc.msg} at line {exc.lineno})") from None
        return cls.from_dict(data, str(path))
