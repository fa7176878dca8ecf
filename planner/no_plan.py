"""Why a search found no plan, in one line: the closest plan, what overflows and what would
help (the command line, the sweep and the Python API all say it this way)."""
from __future__ import annotations

from costmodel.estimate import offloads
from costmodel.plan import Recompute
from costmodel.units import GIB
from planner.search import SearchOptions, unsatisfiable_constraints
from planner.search_state import SearchResult


def ruled_out(pruned_by_reason: dict[str, int], shown: int = 3) -> str:
    """What ruled the candidates out, the most frequent reasons first, with their counts."""
    if not pruned_by_reason:
        return "the space holds no candidate (relax what is pinned: --fix, --max-tp, --schedule)"
    reasons = sorted(pruned_by_reason.items(), key=lambda item: (-item[1], item[0]))
    text = "; ".join(f"{reason} ({count:,} candidates)" for reason, count in reasons[:shown])
    more = f"; {len(reasons) - shown} more reasons" if len(reasons) > shown else ""
    return f"every candidate was ruled out: {text}{more}"


def infeasible_message(result: SearchResult, cluster_name: str) -> str:
    if result.closest is None:
        return "no plan satisfies the constraints: " + ruled_out(result.stats.pruned_by_reason)
    est, plan = result.closest.estimate, result.closest.plan
    tried = "; with states or activations on the host nothing fits either" if result.offloaded_because else ""
    if offloads(plan) and est.host_memory_bytes and est.min_headroom_fraction >= 0:
        host = max(est.host_memory_bytes)   # the device fits: the host is what overflows
        return (f"nothing fits: the closest plan ({plan.short()}) offloads {host / GIB:,.1f} GiB per "
                f"device, {(host - est.host_capacity_bytes) / GIB:,.1f} GiB over its {est.host_capacity_bytes / GIB:,.0f} "
                f"GiB share of the node's host memory; would help: more devices (a larger cluster than "
                f"{cluster_name})")
    rank = est.tightest_rank   # against its own device (a mixed cluster's groups differ)
    parts, capacity = est.memory_breakdown_bytes[rank], est.capacity_per_rank_bytes[rank]
    over = (est.peak_memory_bytes[rank] - capacity) / GIB
    states = (parts["params"] + parts["grads"] + parts["optimizer"]) / GIB
    hints = ["more devices (a larger cluster than " + cluster_name + ")"]
    # a lever is named where what it shrinks is at least a tenth of the overflow
    weights, acts = (parts["params"] + parts["grads"]) / GIB, parts["activations"] / GIB
    if plan.zero_stage < 3 and plan.dp * plan.cp > 1 and weights >= 0.1 * over:
        hints.append("ZeRO-3 (shards weights too)")
    if plan.recompute is not Recompute.FULL and acts >= 0.1 * over:
        hints.append("full recomputation")
    if plan.micro_batch_size > 1 and acts >= 0.1 * over:
        hints.append("a smaller micro-batch")
    if plan.schedule.traits.in_flight == "all" and plan.pp > 1:
        hints.append(f"a 1F1B schedule (GPipe holds all {plan.num_micro_batches} micro-batches' activations)")
    return (f"nothing fits: the closest plan ({plan.short()}) needs {est.peak_memory_bytes[rank] / GIB:.1f} GiB "
            f"on pipeline stage {rank}, {over:.1f} GiB over the {capacity / GIB:.0f} GiB device "
            f"({states:.1f} GiB of it model states, {parts['activations'] / GIB:.1f} GiB activations){tried}; "
            f"would help: {', '.join(hints)}")


def no_plan_reason(model, train, cluster, options: SearchOptions, result: SearchResult) -> str:
    """Why a search that ran to its end found no plan: the pins no plan can take (contradictory
    constraints), else what overflows in the closest candidate."""
    if result.closest is None:
        problems = unsatisfiable_constraints(model, train, cluster, options,
                                             ruled_out=bool(result.stats.pruned_by_reason))
        if problems:
            return "contradictory constraints: " + "; ".join(problems)
    return infeasible_message(result, cluster.name)
