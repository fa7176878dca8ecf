"""What training a number of tokens takes: wall-clock days, GPU-hours and money, from the
throughput a plan keeps once checkpoints and failures are paid (costmodel.resilience)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from costmodel.inputs import UserError

SECONDS_PER_DAY = 86_400.0
# What a run's arithmetic stays finite and meaningful for: 10^18 tokens (four orders beyond the
# largest published runs) at one token per second on 10^6 GPUs is 3e17 GPU-hours, 3e23 USD at a
# million dollars a GPU-hour, far inside a float; at 1e308 a cost overflows to inf.
TOKENS_RANGE = (1.0, 1e18)
GPU_HOUR_USD_RANGE = (0.0, 1e6)


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
    if not TOKENS_RANGE[0] <= tokens <= TOKENS_RANGE[1]:   # also false for nan
        raise UserError(f"tokens to train: give {TOKENS_RANGE[0]:g} to {TOKENS_RANGE[1]:g}, got {tokens!r}")
    if gpu_hour_usd is not None and not GPU_HOUR_USD_RANGE[0] <= gpu_hour_usd <= GPU_HOUR_USD_RANGE[1]:
        raise UserError(f"the price per GPU-hour: give {GPU_HOUR_USD_RANGE[0]:g} to {GPU_HOUR_USD_RANGE[1]:g} USD, "
                        f"got {gpu_hour_usd!r}")
    if not effective_tokens_per_s > 0:   # failures faster than checkpoints: the run never ends
        wall = math.inf
    else:
        wall = tokens / effective_tokens_per_s
    hours = num_gpus * wall / 3600.0
    return TrainingCost(tokens=tokens, num_gpus=num_gpus, effective_tokens_per_s=effective_tokens_per_s, wall_s=wall,
                        gpu_hours=hours, gpu_hour_usd=gpu_hour_usd,
                        cost_usd=None if gpu_hour_usd is None else hours * gpu_hour_usd)


def summary_line(cost: TrainingCost) -> str:
    if not math.isfinite(cost.wall_s):
        return (f"training {cost.tokens:,.3g} tokens never ends on {cost.num_gpus:,} GPUs: a failure comes before "
                "a checkpoint is written, so no work is kept (0 tokens/s with checkpoints and failures paid)")
    money = "" if cost.cost_usd is None else f", ${cost.cost_usd:,.0f} at ${cost.gpu_hour_usd:,.2f} per GPU-hour"
    return (f"training {cost.tokens:,.3g} tokens: {cost.days:,.1f} days on {cost.num_gpus:,} GPUs at "
            f"{cost.effective_tokens_per_s:,.0f} tokens/s (checkpoints and failures paid), "
            f"{cost.gpu_hours:,.0f} GPU-hours{money}")
