"""The plans a report compares, built and priced here (reports render; they build no plans):
the chosen plan under every other pipeline schedule."""
from __future__ import annotations

from dataclasses import replace

from costmodel.check import check_structure
from costmodel.estimate import estimate, simulate_plan
from costmodel.groups import representative
from costmodel.hardware import ClusterSpec
from costmodel.plan import Plan
from costmodel.schedules import Schedule
from costmodel.specs import ModelSpec, TrainSpec
from planner.space import under_schedule
from reports.bubble import Variant


def schedule_variants(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> list[Variant]:
    """The chosen plan first, then the same plan under each other schedule (planner.space.
    under_schedule), or why that schedule cannot run it. Replicas on device groups: the group
    the per-rank pictures draw (costmodel.groups.representative)."""
    train, cluster, plan = representative(train, cluster, plan)
    out = [_priced("chosen: " + str(plan.schedule) + (f" (v={plan.vpp})" if plan.vpp > 1 else ""),
                   model, train, cluster, plan)]
    if plan.pp == 1:
        return out
    for schedule in Schedule:
        if schedule is plan.schedule:
            continue
        variant = under_schedule(model, plan, schedule)
        problems = check_structure(model, train, cluster, variant)
        label = str(schedule) + (f" (v={variant.vpp})" if variant.vpp > 1 else "")
        out.append(Variant(label=label, plan=None, reason=problems[0]) if problems
                   else _priced(label, model, train, cluster, variant))
    return out


# A timeline is drawn event by event: past this many micro-batches the figure shows the first
# ones (warm-up, steady state, cool-down look the same) and says so; the estimate is the whole.
DRAWN_MICRO_BATCHES = 64


def _priced(label: str, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> Variant:
    cap = plan.pp * max(1, DRAWN_MICRO_BATCHES // plan.pp)
    if plan.num_micro_batches <= cap:
        return Variant(label=label, plan=plan, estimate=estimate(model, train, cluster, plan),
                       sim=simulate_plan(model, train, cluster, plan, keep_events=True))
    drawn = replace(plan, num_micro_batches=cap)
    return Variant(label=label, plan=plan, estimate=estimate(model, train, cluster, plan),
                   sim=simulate_plan(model, train, cluster, plan),
                   timeline=simulate_plan(model, train, cluster, drawn, keep_events=True))
