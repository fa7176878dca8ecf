"""Why a search found no plan, in one line: the closest plan, what overflows and what would
help, or the pinned fields no plan can take (the command line, the sweep and the Python API all
say it this way)."""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from costmodel.check_degrees import dispatcher_problems, tp_problems
from costmodel.estimate import estimate, offloads
from costmodel.frameworks import shards_in_part
from costmodel.hardware import ClusterSpec
from costmodel.plan import Recompute
from costmodel.schedules import Schedule
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.units import GIB
from planner.candidates import replica_degrees, time_groups
from planner.search_options import MAX_MICRO_BATCH, STATE_OPTIONS, SearchOptions, states_allowed, states_for_group
from planner.search_result import SearchResult
from planner.space import Choice


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
    if over <= 0:   # laid out and simulated as predict prices it, it fits: a split the search does not take
        layers = ",".join(str(n) for n in plan.layers_per_stage)
        return (f"nothing fits as the search splits layers; the closest plan ({plan.short()}) fits as `planner "
                f"predict` lays it out, layers/stage {layers}: {est.peak_memory_bytes[rank] / GIB:.1f} GiB on "
                f"pipeline stage {rank} of {capacity / GIB:.0f} GiB (the search splits a rank's layers evenly "
                f"over its virtual stages, the first rank's each at least as long as a mixture's dense first "
                f"layers; `planner predict --layers {layers}` prices this one)")
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


CONTRADICTORY = "contradictory constraints: "   # how no_plan_reason begins where the pins admit no plan


def no_plan_reason(model, train, cluster, options: SearchOptions, result: SearchResult) -> str:
    """Why a search that ran to its end found no plan: the pins no plan can take (contradictory
    constraints), else what overflows in the closest candidate."""
    if result.closest is None:
        problems = unsatisfiable_constraints(model, train, cluster, options,
                                             ruled_out=bool(result.stats.pruned_by_reason))
        if problems:
            return CONTRADICTORY + "; ".join(problems)
    elif result.closest.estimate.fits:   # in the closed form: as predict prices it, with its simulation
        simulated = estimate(model, train, cluster, result.closest.plan)
        result = replace(result, closest=replace(result.closest, estimate=simulated))
    return infeasible_message(result, cluster.name)


def unsatisfiable_constraints(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
                              options: SearchOptions, ruled_out: bool = False) -> list[str]:
    """When the constraints leave no candidate at all: each fixed field whose value no plan can
    take, with the values it could take; or, when each is possible alone and no candidate was
    ruled out by a rule the search names (`ruled_out`: those rules are the better answer), that
    they are not together."""
    possible: dict[str, set] = {name: set() for name in options.fixed}
    pinned = list(options.fixed.items())
    together: set[int] = set()   # per choice, the pinned fields it matches (bit i: pinned[i])
    free = replace(options, fixed={})
    placements = [o for o, ok in zip(STATE_OPTIONS, states_allowed(free, cluster)) if ok]
    for base, group in time_groups(model, train, cluster, free, lambda reason: None):
        for vpp, schedule in group:
            for states in placements:
                if not states_for_group(states, base.dp * base.cp > 1) or (base.dp_replicate > 1
                                                                           and states.zero_stage == 0):
                    continue
                # the choice's fields, read without building it (hundreds of thousands of choices)
                chosen = {"vpp": vpp, "schedule": schedule, **states._asdict()}
                for name, seen in possible.items():
                    seen.add(_field(base, chosen, name))
                together.add(sum(1 << i for i, (name, value) in enumerate(pinned)
                                 if _field(base, chosen, name) == value))
    if cluster.is_mixed:   # replicas on groups (planner.shares): no pipeline
        for tp, cp, dp, _, sps in replica_degrees(model, train, cluster, free):
            values = {"pp": {1}, "tp": {tp}, "cp": {cp}, "dp": {dp}, "sequence_parallel": set(sps), "vpp": {1},
                      "ep": {1}, "etp": {1}, "dp_replicate": {1}, "schedule": {Schedule.ONE_F_ONE_B},
                      "micro_batch_size": set(range(1, MAX_MICRO_BATCH + 1)),
                      "zero_stage": {o.zero_stage for o in placements if not o.offload_optimizer}}
            for name, seen in possible.items():
                seen |= values.get(name, set())
    problems = []
    for name, value in options.fixed.items():
        if name == "schedule" and not Schedule(value).traits.closed_form:
            problems.append(f"schedule={value} has no closed-form pipeline time, so the search cannot pin it: "
                            f"unpinned, it lays its best plans out under {value} and prices them by simulation "
                            f"(the table's rows say their schedule); to price one plan under it: planner predict "
                            f"--schedule {value}")
        elif name == "dp_replicate" and value != 1 and not shards_in_part(cluster.framework, 1):
            problems.append(f"dp_replicate={value}: {cluster.framework.name} does not shard over part of the "
                            "data-parallel ranks (hybrid sharding: --framework torchtitan or planner; "
                            "optimizer instances at ZeRO-1: --framework megatron)")
        elif value not in possible[name]:
            shown = ", ".join(str(v) for v in sorted(possible[name]))
            why = _why_not(model, train, cluster, name, value)
            problems.append(f"{name}={value} is not possible for {model.name} on {cluster.name}"
                            + (f": {why}" if why else f" (the search considers: {shown})"))
    if ruled_out and not problems:
        return []
    if not problems and options.fixed and not cluster.is_mixed:
        shown = ", ".join(f"{k}={v}" for k, v in _fewest_apart(pinned, together))
        problems.append(f"{shown} are not possible together for {model.name} on {cluster.name}, though each is alone")
    elif not problems and options.fixed:
        problems.append(f"each of {', '.join(f'{k}={v}' for k, v in pinned)} is possible, but not all together")
    return problems


def _field(base: Choice, chosen: dict[str, Any], name: str) -> Any:
    """Field `name` of `replace(base, **chosen)`."""
    return chosen[name] if name in chosen else getattr(base, name)


def _why_not(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, name: str, value: Any) -> str:
    """The rule that keeps one pinned value out of every plan, where one does."""
    if name == "fp8_linears" and value and not train.float8:
        return "float8 linears need --dtype fp8"
    if name == "tp" and (found := tp_problems(model, value)):
        return found[0]
    if name == "ep" and (found := dispatcher_problems(model, value, 1, cluster.framework, cluster.devices_per_node)):
        return found[0].removeprefix(f"ep={value}: ")
    return ""


def _fewest_apart(pinned: list[tuple[str, Any]], together: set[int]) -> list[tuple[str, Any]]:
    """The smallest set of pinned fields no enumerated choice matches all of (`together`: each
    choice's matches as bits): the pair, or more, to name instead of every field."""
    for size in range(2, len(pinned) + 1):
        for subset in itertools.combinations(range(len(pinned)), size):
            mask = sum(1 << i for i in subset)
            if not any(m & mask == mask for m in together):
                return [pinned[i] for i in subset]
    return pinned
