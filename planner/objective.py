"""What a training run asks of a plan (tokens to train, price, deadline, budget) and the
objective that picks the answer, the same words in `search` and `sweep`:

- `--objective time`: the fastest (search: the shortest step; sweep: the size that ends soonest);
- `--objective cost`: the cheapest run of `--tokens` at `--gpu-hour-usd`. On one cluster the
  cost is GPUs x days x price and days follow the step time, so search's cheapest plan is its
  fastest; the objective decides in sweep, where the size changes the price;
- `--deadline-days` and `--budget-usd` are limits under either objective: answers that miss
  them are left out, and when none is left that is one line naming the closest.

Days, GPU-hours and cost come from costmodel.training_cost, with the checkpoint and failure
overhead of costmodel.resilience."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from costmodel.estimate import Estimate
from costmodel.hardware import ClusterSpec
from costmodel.inputs import UserError
from costmodel.resilience import LLAMA3, Failures, checkpoint_cost
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.training_cost import TrainingCost, training_cost


@dataclass(frozen=True, kw_only=True, slots=True)
class RunGoal:
    tokens: float
    gpu_hour_usd: float | None = None
    deadline_days: float | None = None
    budget_usd: float | None = None
    failures: Failures = LLAMA3

    def cost(self, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, est: Estimate) -> TrainingCost:
        kept = checkpoint_cost(model, train, cluster.world_size, est.step_time_s, est.tokens_per_s, self.failures)
        return training_cost(self.tokens, cluster.world_size, kept.effective_tokens_per_s, self.gpu_hour_usd)

    def misses(self, cost: TrainingCost) -> str:
        """Why a run of this cost misses the limits ("" when it meets them)."""
        if not math.isfinite(cost.days):
            return "the run never ends (failures outpace checkpoints)"
        if self.deadline_days is not None and cost.days > self.deadline_days:
            return f"{cost.days:,.1f} days, over the deadline of {self.deadline_days:g}"
        if self.budget_usd is not None and cost.cost_usd is not None and cost.cost_usd > self.budget_usd:
            return f"${cost.cost_usd:,.0f}, over the budget of ${self.budget_usd:,.0f}"
        return ""

    def limits(self) -> str:
        parts = ([] if self.deadline_days is None else [f"{self.deadline_days:g} days"]) + \
                ([] if self.budget_usd is None else [f"${self.budget_usd:,.0f}"])
        return " and ".join(parts)


OBJECTIVE_HELP = ("time: the fastest; cost: the cheapest run of --tokens at --gpu-hour-usd (on one cluster "
                  "that is the fastest plan: cost = GPUs x days x price)")


def refuse_bad_combinations(args: argparse.Namespace, command: str) -> None:
    """One line, exit 2, for run flags that cannot mean anything together."""
    tokens = getattr(args, "tokens", None)
    priced = args.gpu_hour_usd is not None
    if args.objective == "cost" and "objective" in getattr(args, "given", {"objective"}):
        if tokens is None or not priced:
            missing = " and ".join(f for f, gone in (("--tokens N", tokens is None), ("--gpu-hour-usd P", not priced))
                                   if gone)
            raise UserError(f"{command} --objective cost prices a training run of --tokens N at --gpu-hour-usd P: "
                            f"give {missing}")
    if args.deadline_days is not None and tokens is None:
        raise UserError("--deadline-days limits the days to train --tokens N; give --tokens")
    if args.budget_usd is not None and not (tokens is not None and priced):
        raise UserError("--budget-usd limits the cost of training --tokens N at --gpu-hour-usd P; give both")


def keep_within(goal: RunGoal, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plans: list,
                fastest) -> tuple[list, str]:
    """search: the ranked plans (planner.search_result.Found) whose run meets the goal's limits, in
    their order, and a line saying how many were left out ("" when none). Days grow with the
    step time, so when the fastest plan misses a limit every plan does: one line, exit 2."""
    if goal.deadline_days is None and goal.budget_usd is None:
        return plans, ""
    quickest = fastest if fastest is not None else plans[0]
    if why := goal.misses(goal.cost(model, train, cluster, quickest.estimate)):
        advice = (["more devices (planner sweep)"] if goal.deadline_days is not None else []) + ["fewer tokens"] + \
            (["a later deadline"] if goal.deadline_days is not None else []) + \
            (["a larger budget or another size or device (planner sweep)"] if goal.budget_usd is not None else [])
        raise UserError(f"no plan on {cluster.name} trains {goal.tokens:,.3g} tokens within {goal.limits()}: the "
                        f"fastest ({quickest.plan.short()}) takes {why}; {', '.join(advice[:-1])} or {advice[-1]}")
    kept = [f for f in plans if not goal.misses(goal.cost(model, train, cluster, f.estimate))]
    if not kept:
        kept = [quickest]
    left = len(plans) - len([f for f in plans if f in kept])
    return kept, (f"{left} of the {len(plans)} ranked plans left out: their run misses {goal.limits()}"
                  if left else "")
