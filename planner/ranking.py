"""Ranking found plans: by step time, ties by memory and simplicity; within the model's error
band the most robust first; the plan closest to fitting when none does (the cutoff the branch
and bound prunes against: planner.cutoff)."""
from __future__ import annotations

from dataclasses import replace

from costmodel.estimate import estimate
from costmodel.fidelity import MEMORY_ERROR_BAND
from costmodel.plan import Plan, Recompute
from planner.partition import apply_split, least_overflow_split
from planner.search_options import SearchOptions
from planner.search_result import Found


def robust_first(ranked: list[Found], band: float) -> tuple[list[Found], int]:
    """The plans within `band` of the fastest, most robust first: states on the device, bf16
    linears, a memory margin of at least the memory model's largest measured error
    (MEMORY_ERROR_BAND of its peak: safe), among the plans short of it the larger margin, then
    fewer moving parts (context, pipeline and virtual stages, tensor ranks, hybrid sharding, a
    zero-bubble schedule), then time; the rest by time after them. Safe margins are not told
    apart: beyond the largest error, more memory to spare buys nothing the evidence can show.
    Returns the order and how many are equivalent."""
    if not ranked or band <= 0:
        return ranked, min(len(ranked), 1)
    limit = ranked[0].estimate.step_time_s * (1 + band)
    near = [f for f in ranked if f.estimate.step_time_s <= limit]

    def robustness(f: Found) -> tuple:
        e, p = f.estimate, f.plan
        margin, peak, _ = memory_margin(e)
        safe = margin >= MEMORY_ERROR_BAND * peak
        # states kept on the device before states on the host: offloading trades device memory
        # for a dependence on the host's link and cores, priced from datasheets no run has checked
        # likewise bf16 linears before float8 ones, whose speed no run of ours has measured
        return (p.offload_optimizer, p.fp8_linears, not safe, 0.0 if safe else -margin, p.cp, p.pp * p.vpp,
                p.tp, p.dp_replicate > 1, p.schedule.defers_weight_grad, e.step_time_s)

    near.sort(key=robustness)
    return near + [f for f in ranked if f not in near], len(near)


def memory_margin(est) -> tuple[float, float, float]:
    """(bytes to spare, peak, capacity) on the tightest rank."""
    r = est.tightest_rank
    cap = est.capacity_per_rank_bytes[r]
    return cap - est.peak_memory_bytes[r], est.peak_memory_bytes[r], cap


MEMORY_BAND = 0.05   # `--objective memory`: the leanest plan within this of the fastest
# The first plan is chosen among this many best plans (by the closed form; within the error band
# of the fastest once simulated), which the search finds whatever `--top` asks to show: a display
# flag never changes it.
DECISION_K = 5


def outer_key(plan: Plan) -> Plan:
    return replace(plan, layers_per_stage=(), recompute_num_layers=())


def price(f: Found) -> tuple[float, float]:
    """What the model tells plans apart by: step time (to the microsecond) and peak memory."""
    return round(f.estimate.step_time_s, 6), f.estimate.max_peak_memory_bytes


def rank(found: list[Found], options: SearchOptions) -> list[Found]:
    best: dict[Plan, Found] = {}
    for f in found:
        key = outer_key(f.plan)
        if key not in best or f.estimate.step_time_s < best[key].estimate.step_time_s:
            best[key] = f
    # equal predicted times (to the microsecond): less memory, then the simpler plan first
    by_time = one_row_per_price(sorted(best.values(), key=lambda f: (*price(f), f.plan.cp, f.plan.pp, f.plan.tp,
                                                                      f.plan.vpp, f.plan.short())))
    if options.objective == "memory" and by_time:
        limit = (1 + MEMORY_BAND) * by_time[0].estimate.step_time_s
        near = [f for f in by_time if f.estimate.step_time_s <= limit]
        near.sort(key=lambda f: (f.estimate.max_peak_memory_bytes, f.estimate.step_time_s))
        by_time = near + [f for f in by_time if f not in near]
    return by_time[: options.top_k]


def one_row_per_price(ordered: list[Found]) -> list[Found]:
    """Plans the model prices identically are one answer: the first (simplest) stands for them,
    the others named as its alternatives."""
    out: list[Found] = []
    index: dict[tuple[float, float], int] = {}
    for f in ordered:
        at = index.get(price(f))
        if at is None:
            index[price(f)] = len(out)
            out.append(f)
        else:
            kept = out[at]
            more = [p for p in (f.plan, *f.alternatives) if p != kept.plan and p not in kept.alternatives]
            out[at] = replace(kept, alternatives=(*kept.alternatives, *dict.fromkeys(more)))
    return out


def undominated(rows: list[Found]) -> list[Found]:
    """The rows of a table worth listing: the first (the decision, robust-first, kept whatever
    beats it), then each row no listed row matches or beats in both step time and peak memory
    (`price`; beats in one at least): a plan slower and no leaner than another, such as one
    recomputing a layer that fits without recomputation, answers no question the other does not."""
    prices = [price(f) for f in rows]

    def beaten(p: tuple[float, float]) -> bool:
        return any(q != p and q[0] <= p[0] and q[1] <= p[1] for q in prices)
    return rows[:1] + [f for f, p in zip(rows[1:], prices[1:]) if not beaten(p)]


def closer(model, train, cluster, plan, closest: Found | None, free_split: bool = False) -> Found:
    """The candidate with every layer of its mode recomputed: how far from fitting is it? Its
    layers even, or where the framework splits them freely (`free_split`) also split so that its
    worst rank overflows least (planner.partition.least_overflow_split; priced only where its
    memory shapes say it is the closer), the closer of the two."""
    probes = [plan]
    if free_split and plan.pp > 1 and (least := least_overflow_split(model, train, cluster, plan)) is not None:
        split, headroom = least
        if closest is None or headroom > closest.estimate.min_headroom_fraction:
            probes.append(apply_split(plan, split))
    for probe in probes:
        counts = tuple(probe.layers_on_rank(r) for r in range(probe.pp)) if probe.recompute is not Recompute.NONE \
            else (0,) * probe.pp
        probe = replace(probe, recompute_num_layers=counts)
        est = estimate(model, train, cluster, probe, simulate=False)
        # the least over its own budget (on a uniform cluster: the lowest peak)
        if closest is None or est.min_headroom_fraction > closest.estimate.min_headroom_fraction:
            closest = Found(plan=probe, estimate=est)
    return closest
