"""`measured.json`: what `planner run` measured, beside what was predicted (versioned like
plan.json, strict on read; written and read here only).

Version 1 added `version` and `peak_reserved_bytes`; version 2 `complete` (false when the run was
interrupted and the file holds the steps measured before it); version 3 `rank_forward_s` (each rank's
own layer-forward seconds per step, median: a straggler shows there); version 4 `checkpoint_wait_s` (per
checkpoint saved, the seconds the slowest rank's training stood still for it); version 5
`probe_layer_now_s` and `probe_layer_profiled_s` (on a CPU, the profile's probe layer timed after the run
and as the profile timed it: how fast the machine went against its profile); version 6 `grad_norms` (every
step's global gradient norm; a loss or norm that was not finite is null in both lists) and `diverged`
(the step, ranks, loss and gradient norm of a run stopped because they were not finite; null otherwise);
version 7 `oversubscribed`; version 8 `compiled` (the layers ran under `planner run --compile`, so
the run is priced as costmodel.frameworks `compiled_layer`). A file without a `version`, of
a newer version, truncated, or with missing or unknown fields is refused with one line that names the
file and the field.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from costmodel.inputs import UserError, dataclass_from_json, read_json_object, write_text_atomic

MEASURED_FORMAT_VERSION = 8
STAGE_PARTS = ("work", "dp_sync", "optimizer", "wait")   # runtime.measure's split of a stage's step
# Parts of a step predicted below this share of it are compared in milliseconds, not percent.
SMALL_PART_SHARE = 0.05


def part_error(predicted_s: float, measured_s: float, error: float | None, step_s: float) -> str:
    """A step part's error cell: a part predicted near 0 (under SMALL_PART_SHARE of the step) has
    no meaningful relative error (a 2 ms wait predicted as 1 us is "+199900 %"), so its
    difference in milliseconds; every table of predicted against measured parts shows it so."""
    if abs(predicted_s) < SMALL_PART_SHARE * step_s:
        return f"{(measured_s - predicted_s) * 1e3:+,.1f} ms"
    return "-" if error is None else f"{error:+.1f}%"


def finite_or_none(value: float) -> float | None:
    """A loss or gradient norm as measured.json holds it: JSON has no NaN or infinity."""
    return value if math.isfinite(value) else None


def shown_loss(value: float | None) -> str:
    return "not finite" if value is None else f"{value:.4f}"


def shown_mfu(mfu: float, digits: int = 1) -> str:
    """A measured MFU; above 100 % the profile's peak (on a measured profile its best GEMM, which
    a short budget may have measured at small sizes only) is below what the run reached."""
    return f"{100 * mfu:.{digits}f}%" + (" (above the profile's peak: profile again, longer)" if mfu > 1 else "")


def _number(value: Any, none_ok: bool = False) -> bool:
    if value is None:
        return none_ok
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# A measured step takes at most 11 days, and a run reads at most a quadrillion tokens a second:
# beyond, no run measured it, and calibrate's fit and the report's figures leave the floats (a
# step of 1e308 s pushed a fitted profile out of range, and overflowed matplotlib's transforms).
STEP_S_MAX = 1e6
TOKENS_PER_S_MAX = 1e15


@dataclass(frozen=True, kw_only=True)
class MeasuredRun:
    step_time_s: float                 # median of the timed steps, slowest rank
    tokens_per_s: float
    mfu: float                         # the cost model's FLOPs over the device peak
    peak_memory_bytes: list[float] | None    # per pipeline stage (CUDA: max_memory_allocated)
    losses: list[float | None]         # every step, warm-up included; null where not finite
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
    rank_forward_s: list[float] | None = None   # per global rank: its own layer forwards per step (median)
    checkpoint_wait_s: list[float] | None = None   # per checkpoint saved: the step's wait, slowest rank
    # on a CPU, the profile's probe layer's kernels timed after the run and as the profile timed
    # them (planner.measure.machine_speed): how fast the machine went against its profile
    probe_layer_now_s: float | None = None
    probe_layer_profiled_s: float | None = None
    # every step's global gradient norm, warm-up included, null where not finite (runtime.health)
    grad_norms: list[float | None] | None = None
    # a run stopped because its loss or gradient norm was not finite: the step, the ranks that saw
    # it, the loss, the norm and how many such steps came in a row (runtime.health.nonfinite_step)
    diverged: dict[str, Any] | None = None
    # on a CPU, more rank threads than the machine's cores: the ranks shared cores, which no
    # profile prices (calibrate refuses such runs)
    oversubscribed: bool = False
    # the layers ran compiled (`planner run --compile`): the run is priced as the compiled runtime
    # (planner.measure.run_dirs.priced_as_run), by its own prediction and by calibrate alike
    compiled: bool = False

    def __post_init__(self) -> None:
        """Consistent as `planner run` writes it; what reports and calibrate index into."""
        if problems := self._problems():
            raise UserError("; ".join(problems))

    def _problems(self) -> list[str]:
        out = [f"{name} must be positive, not {getattr(self, name)}"
               for name in ("step_time_s", "tokens_per_s", "world_size", "steps") if not getattr(self, name) > 0]
        out += [f"{name} must not be negative" for name in ("mfu", "warmup_steps", "wall_s") if getattr(self, name) < 0]
        if not self.losses or not self.step_times_s or min(self.step_times_s) <= 0:
            out.append("losses and step_times_s must be non-empty, step times positive")
        elif max(self.step_time_s, *self.step_times_s) > STEP_S_MAX or self.tokens_per_s > TOKENS_PER_S_MAX:
            out.append(f"step times must be at most {STEP_S_MAX:g} s and tokens_per_s at most {TOKENS_PER_S_MAX:g} "
                       "(not a measurement: a fit or a figure of them overflows)")
        elif not math.isclose(self.step_time_s, statistics.median(self.step_times_s), rel_tol=1e-6):
            out.append(f"step_time_s {self.step_time_s:g} is not the median of step_times_s "
                       f"({statistics.median(self.step_times_s):g}), as `planner run` writes it")
        pp = self.plan.get("pp")
        if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
            return out + ["plan.pp must be a positive integer"]
        per_stage = {"peak_memory_bytes": self.peak_memory_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
                     "predicted_memory_compared_bytes": self.predicted_memory_compared_bytes,
                     "error_pct.peak_memory_bytes": self.error_pct.get("peak_memory_bytes")}
        triple = (self.stage_breakdown_s, self.predicted_stage_breakdown_s, self.error_pct.get("stage_breakdown_s"))
        if len({part is None for part in triple}) > 1:
            out.append("stage_breakdown_s, predicted_stage_breakdown_s and error_pct.stage_breakdown_s are "
                       "all present or all null")
        if self.memory_source.startswith("torch.cuda") and self.peak_memory_bytes is None:
            out.append("peak_memory_bytes is null, but memory_source says CUDA measured it")
        for name, parts in (("stage_breakdown_s", self.stage_breakdown_s),
                            ("predicted_stage_breakdown_s", self.predicted_stage_breakdown_s),
                            ("error_pct.stage_breakdown_s", self.error_pct.get("stage_breakdown_s"))):
            if parts is not None:
                if not isinstance(parts, dict) or set(parts) != set(STAGE_PARTS):
                    out.append(f"{name} must hold {', '.join(STAGE_PARTS)}")
                    continue
                per_stage.update({f"{name}.{k}": v for k, v in parts.items()})
        out += [f"{name} must have one entry per pipeline stage ({pp})" for name, v in per_stage.items()
                if v is not None and (not isinstance(v, list) or len(v) != pp)]
        out += [f"{name} must hold numbers" for name, v in per_stage.items()
                if isinstance(v, list) and not all(_number(x, none_ok=name.startswith("error_pct")) for x in v)]
        for name, doc, none_ok in (("predicted", self.predicted, False), ("error_pct", self.error_pct, True)):
            if bad := [k for k in ("step_time_s", "tokens_per_s", "mfu") if not _number(doc.get(k, "-"), none_ok)]:
                out.append(f"{name}: {', '.join(bad)} must be numbers")
        if self.rank_forward_s is not None and (len(self.rank_forward_s) != self.world_size
                                             or not all(_number(x) and x >= 0 for x in self.rank_forward_s)):
            out.append(f"rank_forward_s must hold one non-negative number per rank ({self.world_size})")
        if self.checkpoint_wait_s is not None and not all(_number(x) and x >= 0 for x in self.checkpoint_wait_s):
            out.append("checkpoint_wait_s must hold non-negative numbers")
        probe = (self.probe_layer_now_s, self.probe_layer_profiled_s)
        if probe != (None, None) and not all(_number(x) and x > 0 for x in probe):
            out.append("probe_layer_now_s and probe_layer_profiled_s must both be positive numbers, or both null")
        if self.grad_norms is not None and len(self.grad_norms) != len(self.losses):
            out.append(f"grad_norms must have one entry per step, as losses ({len(self.losses)})")
        if self.diverged is not None and (self.complete or not isinstance(self.diverged.get("step"), int)):
            out.append("diverged must name its step (an int), and a diverged run is not complete")
        if missing := [k for k in ("peak_memory_bytes", "stage_breakdown_s") if k not in self.error_pct]:
            out.append(f"error_pct lacks {', '.join(missing)}")
        return out

    @property
    def memory_from_cuda(self) -> bool:
        return self.memory_source.startswith("torch.cuda")

    def to_dict(self) -> dict[str, Any]:
        return {"version": MEASURED_FORMAT_VERSION, **asdict(self)}

    def save(self, path: Path) -> None:
        """measured.json for tests and scripts, replacing `path`. `planner run` publishes its
        record through planner.outputs instead (strict JSON, never over another run's)."""
        write_text_atomic(Path(path), json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    @classmethod
    def from_dict(cls, data: Any, where: str = "measured.json") -> "MeasuredRun":
        if not isinstance(data, dict):
            raise UserError(f"{where}: not a measured.json (a JSON object is expected)")
        data = dict(data)
        if {"train", "cluster"} <= set(data) and "step_times_s" not in data:
            raise UserError(f"{where}: a plan file, not a measured.json (the record `planner run` writes of a run)")
        if "version" not in data:
            raise UserError(f"{where}: has no version; this planner reads measured.json versions 1 to "
                            f"{MEASURED_FORMAT_VERSION} (written by `planner run`)")
        version = data.pop("version")
        if version not in range(1, MEASURED_FORMAT_VERSION + 1):
            raise UserError(f"{where}: measured.json version {version!r}; this planner reads versions 1 "
                             f"to {MEASURED_FORMAT_VERSION} (written by `planner run`)")
        # Fields added later have defaults: peak_reserved_bytes (v1), complete (v2), rank_forward_s (v3),
        # checkpoint_wait_s (v4), probe_layer_now_s and probe_layer_profiled_s (v5), grad_norms and diverged (v6),
        # oversubscribed (v7), compiled (v8).
        return dataclass_from_json(cls, data, where)

    @classmethod
    def load(cls, path: Path) -> "MeasuredRun":
        return cls.from_dict(read_json_object(path, "measured run"), str(path))
