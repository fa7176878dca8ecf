"""The order the branch and bound takes candidates in: by their lower bounds, built lazily.

Groups that differ only in their recompute mode and whether activations go to the host enter
the queue as one family, with the floor of their relaxation: no recomputation, activations kept,
every variant of any of them (each only adds time: a recomputed layer, a copy to the host). Taken,
a family prices its groups. Each Group (outer choices alike but for mesh order, virtual stages,
schedule and state placement) enters the queue with floors below every candidate of it (SharedModels.group_floors_s:
per variant the least pipeline floor over its orders, per state placement one that reads no
placement). Taken, a group puts each of its variants under each state placement in the queue;
such a choice, taken, is checked for memory once (memory does not depend on the order), and only
if some split fits does it put its candidates in, one per mesh order the framework runs, each
with its own order's bound (planner.bounds). Coarser entries leave the queue before finer ones
of the same bound, so candidates leave it in the order of their bounds (ties: generation order,
then placement), as if every bound had been computed first, and a group whose floor reaches the
cutoff is never priced under any order.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, fields, replace
from operator import attrgetter
from typing import Iterable, Iterator

from costmodel.plan import Plan, Recompute
from costmodel.schedules import Schedule
from planner.bounds import MemoryFit, time_floor_s
from planner.candidates import Group
from planner.search_result import SearchStats
from planner.search_state import SharedModels
from planner.space import Choice

_FAMILY, _GROUP, _CHOICE, _CANDIDATE = -1, 0, 1, 2   # at equal bounds the coarser item opens first


@dataclass(frozen=True, slots=True)
class Candidate:
    bound_s: float
    base: Choice   # placed: its own mesh order
    vpp: int
    schedule: Schedule
    zero: int   # index into STATE_OPTIONS
    fit: MemoryFit
    plan: Plan


class Queue:
    """Candidates in order of their bounds. Four kinds of entries: a family of groups (the floor
    of their relaxation), a Group (its floor: its least variant's and state placement's), one
    variant and state placement of a group (both floors summed; checked for memory when taken),
    and a candidate (its own order's bound).
    `num_candidates` counts every candidate of every group, `taken` those that left the queue or
    were pruned before entering it."""

    def __init__(self, shared: SharedModels, groups: Iterable[Group], stats: SearchStats, deadline: float) -> None:
        # choices that cannot fit, (base, vpp, schedule, zero): taken from the queue, and listed
        # without room for their states
        self.shared, self.stats, self.too_big, self.roomless = shared, stats, [], []
        self.heap: list[tuple] = []
        self._placed: dict[int, list[Choice]] = {}
        self.num_candidates = self.taken = 0
        families: dict[tuple, list[tuple[int, Group, list[int]]]] = {}
        for index, group in enumerate(groups):
            if time.perf_counter() > deadline:   # a space too large to list within the limit: no bound
                stats.optimal, stats.enumerated = False, False
                break
            zeros = shared.placements(group.base)
            if not zeros:   # the constraints leave it no state placement
                continue
            count = len(group.orders) * len(group.variants) * len(zeros)
            self.num_candidates += count
            if not shared.states_room(group, zeros):   # its states alone overflow: no bound needed
                stats.prune("memory", count)
                self.taken += count
                self.roomless += [(group.base, vpp, schedule, z) for vpp, schedule in group.variants for z in zeros]
                continue
            families.setdefault(_family_key(group), []).append((index, group, zeros))
        for members in families.values():
            if time.perf_counter() > deadline:   # as above: the rest are never priced
                stats.optimal, stats.enumerated = False, False
                break
            self.heap.append(self._family(members))
        heapq.heapify(self.heap)

    def _family(self, members: list[tuple[int, Group, list[int]]]) -> tuple:
        """The queue's entry of groups alike but for recompute mode and activation offload: one
        group as itself; more under the floor of their relaxation (its variants all theirs)."""
        if len(members) == 1:
            return self._group(*members[0])
        first = members[0][1]
        relaxed = replace(first.base, recompute=Recompute.NONE, offload_activations=False)
        variants = list(dict.fromkeys(v for _, group, _ in members for v in group.variants))
        pipeline, after = self.shared.group_floors_s(Group(relaxed, variants, first.orders))
        floor = min(pipeline) + min(after[z] for _, _, zeros in members for z in zeros)
        return floor, _FAMILY, (members[0][0],), members

    def _group(self, index: int, group: Group, zeros: list[int]) -> tuple:
        pipeline, after = self.shared.group_floors_s(group)
        return min(pipeline) + min(after[z] for z in zeros), _GROUP, (index,), (group, pipeline, after, zeros)

    def in_order(self) -> Iterator[Candidate]:
        """Candidates by bound; the caller stops once one reaches its cutoff."""
        while self.heap:
            floor, kind, seq, item = heapq.heappop(self.heap)
            if kind == _CANDIDATE:
                self.taken += 1
                yield item
            elif kind == _CHOICE:
                self._place(seq, *item, floor)
            elif kind == _FAMILY:
                for entry in map(lambda member: self._group(*member), item):
                    assert entry[0] >= floor - 1e-9 * abs(floor), "a family's floor above one of its groups'"
                    heapq.heappush(self.heap, entry)
            else:
                group, pipeline, after, zeros = item
                for v in range(len(group.variants)):
                    for z in zeros:
                        heapq.heappush(self.heap, (pipeline[v] + after[z], _CHOICE, (*seq, v, z), (group, v, z)))

    def _place(self, seq: tuple, group: Group, v: int, z: int, floor: float) -> None:
        """One variant and state placement of a group: its memory once, then, if some split fits,
        a candidate per mesh order that runs it, with that order's bound."""
        runs, fit, plan = self._fitting(group, v, z)
        if not runs:
            return
        shared, base = self.shared, group.base
        vpp, schedule = group.variants[v]
        m = shared.train.global_batch_size // base.dp // base.micro_batch_size
        if seq[0] not in self._placed:   # the group's choice under each of its orders, made once
            self._placed[seq[0]] = [base if order == base.mesh_axis_order else replace(base, mesh_axis_order=order)
                                    for order in group.orders]
        for o, (order, placed) in enumerate(zip(group.orders, self._placed[seq[0]])):
            if order not in runs:
                continue
            timed = shared.time_model(placed)
            bound = (time_floor_s(shared.model, shared.floor_rtm(timed.rtm, base.ep), base.pp, m, schedule, vpp,
                                  base.recompute, timed.slowest_floor_s) + timed.zero_floors_s[z])
            assert bound >= floor - 1e-9 * abs(floor), "a placement-free floor above a candidate's bound"
            heapq.heappush(self.heap, (bound, _CANDIDATE, (seq[0], o, v, z),
                                       Candidate(bound, placed, vpp, schedule, z, fit, plan)))

    def _fitting(self, group: Group, v: int, z: int) -> tuple[list, MemoryFit | None, Plan | None]:
        """(the orders that run the group's variant v under state placement z, its memory fit, its
        plan) when some split of it fits; else no orders, each of its candidates counted pruned:
        by why it is no plan, by the framework's refusal (which may depend on the order), or by
        memory."""
        shared, stats, base, space = self.shared, self.stats, group.base, self.shared.options.space
        vpp, schedule = group.variants[v]
        runs, entry = group.orders, shared.memory(base, vpp, schedule, z)   # priced with another placement of states
        if entry is None or space is not None:
            plan = entry[1] if entry is not None and entry[1] is not None else shared.built(base, vpp, schedule, z)
            if isinstance(plan, str):
                stats.prune(plan, len(group.orders))
                self.taken += len(group.orders)
                return [], None, None
        if space is not None:
            runs = []
            for order in group.orders:
                placed = plan if order == plan.mesh_axis_order else replace(plan, mesh_axis_order=order)
                if changes := space.problems(placed):
                    stats.prune(f"{space.name} cannot run: {changes[0].split(':')[0][:50]}")
                    self.taken += 1
                else:
                    runs.append(order)
            if not runs:
                return [], None, None
        fit, fitted = entry or shared.add_memory(base, plan)
        if not fit.fits:
            stats.prune("memory", len(runs))
            self.taken += len(runs)
            self.too_big.append((base, vpp, schedule, z))
            return [], None, None
        return runs, fit, fitted


# every field of a choice but those a family's groups differ in (read once: a field added to
# Choice joins the key by itself)
_FAMILY_FIELDS = attrgetter(*(f.name for f in fields(Choice) if f.name not in ("recompute", "offload_activations")))


def _family_key(group: Group) -> tuple:
    """What the groups of a family share: every field of their choice but the recompute mode and
    activation offload, and their mesh orders."""
    return _FAMILY_FIELDS(group.base), tuple(group.orders)
