"""The branch and bound's cutoff: the step time no candidate reaching it can enter the answer,
which is the DECISION_K fastest rows the first plan is chosen from and the `--top` rows of the
table, counted as planner.ranking lists them: one row per layout (outer_key: a plan less its
layer split and recomputed-layer counts), one per price.

The table also leaves out rows another row beats in both time and memory (undominated). A plan
found later may beat several rows at once, so the number of such rows under a cutoff can fall;
counting them would make the cutoff rise again after plans were pruned against it, and a space
whose fastest plans are also its leanest has so few that nothing is pruned. So the cutoff counts
rows before that filter and keeps its lowest value, and the table shows only rows at or under it
(`complete_below_s`), where every faster plan was examined: it may list fewer than `--top` rows,
never an unproven one."""
from __future__ import annotations

import heapq
import math

from planner.ranking import DECISION_K, MEMORY_BAND, outer_key, price
from planner.search_options import SearchOptions
from planner.search_result import Found

# Rows proven per row asked for. Some rows near the fastest are beaten in time and memory by a
# faster one and left out, but each row proven more costs CP-SAT layer-split solves, seconds on
# the largest MoE spaces (benchmarks/search_speed.py); a table shorter than --top says so
# (planner.commands.search).
TABLE_ROWS_PER_SHOWN = 1


class Cutoff:
    """The cutoff of one branch and bound, tightened as its plans are found (`add`)."""

    def __init__(self, options: SearchOptions) -> None:
        self.top_k, self.objective = options.top_k, options.objective   # (a half's comes back pickled)
        self.s = math.inf   # its lowest value yet: every plan faster than it was examined
        self._best: dict = {}   # layout -> its best plan's (step time, price)

    def add(self, found: Found) -> None:
        key, t = outer_key(found.plan), found.estimate.step_time_s
        if key in self._best and self._best[key][0] <= t:
            return
        self._best[key] = (t, price(found))   # the time itself: the table compares the unrounded one
        if t < self.s or self.objective == "memory":
            self.s = min(self.s, self._from_rows())

    def _from_rows(self) -> float:
        by_price: dict = {}   # one row per price (rank: one_row_per_price), at its fastest time
        for t, p in self._best.values():
            by_price[p] = min(t, by_price.get(p, t))
        times = sorted(by_price.values())
        cutoff = self._kth(times, max(TABLE_ROWS_PER_SHOWN * self.top_k, DECISION_K))
        if self.objective == "memory" and times:   # the leanest within MEMORY_BAND of the fastest
            cutoff = max(cutoff, (1 + MEMORY_BAND) * times[0])
        return cutoff

    @staticmethod
    def _kth(times: list[float], k: int) -> float:
        return heapq.nsmallest(k, times)[-1] if len(times) >= k else math.inf
