"""`planner export`: a plan in the configuration another framework reads (torchtitan's job TOML,
Megatron-LM's arguments, a DeepSpeed config), the nearest plan that framework can run when it
cannot say ours, each difference in one line, and that plan priced as the framework runs it."""
from __future__ import annotations

from types import ModuleType

from costmodel.estimate import estimate
from costmodel.plan import Plan, PlanFile, Recompute
from costmodel.units import GIB
from planner.exports import deepspeed, megatron, torchtitan
from planner.exports.common import (
    CannotExport,
    Export,
    checked,
    priced,
    recompute_is_uniform,
    refuse_if_over,
    to_uniform_recompute,
)

TARGETS: dict[str, ModuleType] = {m.NAME: m for m in (torchtitan, megatron, deepspeed)}

__all__ = ["TARGETS", "CannotExport", "Export", "export_plan"]


def export_plan(pf: PlanFile, target: str) -> Export:
    if target not in TARGETS:
        raise CannotExport(f"unknown export target {target!r}; choose one of {', '.join(TARGETS)}")
    module = TARGETS[target]
    adjusted = module.nearest(pf)
    if pf.cluster.framework.name == module.FRAMEWORK and adjusted.plan != pf.plan:
        # searched for this target: its space held only plans it runs (planner.targets)
        raise RuntimeError(f"a plan searched for {target} is not one it runs: {'; '.join(adjusted.differences)}")
    checked(pf, adjusted.plan, target, module.FRAMEWORK)
    est = priced(pf, adjusted.plan, module.FRAMEWORK)
    if not est.fits and not (adjusted.plan.recompute is Recompute.FULL and recompute_is_uniform(adjusted.plan)):
        # the target's nearest plan keeps more than ours: its lever is recomputation
        over = max(est.peak_memory_bytes) / GIB
        to_uniform_recompute(adjusted, Recompute.FULL, f"memory: that plan needs {over:.1f} GiB per device as "
                                                       f"{target} runs it; with full recomputation of every layer")
        checked(pf, adjusted.plan, target, module.FRAMEWORK)
        est = priced(pf, adjusted.plan, module.FRAMEWORK)
    refuse_if_over(target, est, adjusted.plan)
    text, launch = module.render(pf, adjusted.plan)
    return Export(target=target, text=text, suffix=module.SUFFIX, launch=launch, plan=adjusted.plan,
                  differences=tuple(adjusted.differences), estimate=est,
                  planned=est if searched_for_target(pf, adjusted.plan, module.FRAMEWORK)
                  else estimate(pf.model, pf.train, pf.cluster, pf.plan))


def searched_for_target(pf: PlanFile, plan: Plan, framework: str) -> bool:
    """Whether the export is the plan file's plan, priced with the same framework's traits."""
    return plan == pf.plan and pf.cluster.framework.name == framework
