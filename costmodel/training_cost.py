"""What training a number of tokens takes: wall-clock days, GPU-hours and money, from the
throughput a plan keeps once checkpoints and failures are paid (costmodel.resilience)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from costmodel.inputs import UserError

SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingCost:
    tokens: float
    num_gpus: int
    effective_tokens_per_s: float   # with checkpoint writes and failures' lost work
    wall_s: float
    gpu_hours: float
    gpu_hour_usd: float | None      # the price per GPU-hour, when given
    cost_usd: float | None

    @property
    def days(self) -> float:
        return self.wall_s / SECONDS_PER_DAY

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "num_gpus": self.num_gpus, "effective_tokens_per_s": self.effective_tokens_per_s,
                "days": self.days, "gpu_hours": self.gpu_hours, "gpu_hour_usd": self.gpu_hour_usd,
                "cost_usd": self.cost_usd}


def training_cost(tokens: float, num_gpus: int, effective_tokens_per_s: float,
                  gpu_hour_usd: float | None = None) -> TrainingCost:
    """Days = tokens / effective throughput; GPU-hours = GPUs x hours; cost = GPU-hours x price."""
    if not (math.isfinite(tokens) and tokens > 0):
        raise UserError(f"tokens to train must be a positive number, got {tokens!r}")
    if gpu_hour_usd is not None and not (math.isfinite(gpu_hour_usd) and gpu_hour_usd >= 0):
        raise UserError(f"the price per GPU-hour must be zero or more, got {gpu_hour_usd!r}")
    if not effective_tokens_per_s > 0:   # failures faster than checkpoints: the run never ends
        wall = math.inf
    else:
        wall = tokens / effective_tokens_per_s
    hours = num_gpus * wall / 3600.0
    return TrainingCost(tokens=tokens, num_gpus=num_gpus, effective_tokens_per_s=effective_tokens_per_s, wall_s=wall,
                        gpu_hours=hours, gpu_hour_usd=gpu_hour_usd,
                        cost_usd=None if gpu_hour_usd is None else hours * gpu_hour_usd)


def summary_line(cost: TrainingCost) -> str:
    money = "" if cost.cost_usd is None else f", ${cost.cost_usd:,.0f} at ${cost.gpu_hour_usd:,.2f} per GPU-hour"
    return (f"training {cost.tokens:,.3g} tokens: {cost.days:,.1f} days on {cost.num_gpus:,} GPUs at "
            f"{cost.effective_tokens_per_s:,.0f} tokens/s (checkpoints and failures paid), "
            f"{cost.gpu_hours:,.0f} GPU-hours{money}")
