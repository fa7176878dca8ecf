"""The branch and bound's cutoff: the step time no candidate reaching it can enter the answer,
which is the DECISION_K fastest rows the first plan is chosen from and the `--top` rows of the
table, as planner.ranking lists them: one row per layout (outer_key), one per price.

Counting every plan found instead (a layout's ZeRO-0/1 twins, its recompute variants) set the
cutoff at a near-duplicate of the first row and pruned faster layouts than the table's last
rows. The table then leaves out rows another row beats in both time and memory (undominated);
it shows only rows at or under the cutoff (`complete_below_s`), where every faster plan was
examined, so it may list fewer than `--top` rows but never a wrong one; the cutoff counts
TABLE_ROWS_PER_SHOWN rows per row asked for, so that it seldom does. (Counting only
undominated rows would prove more rows, but a space whose fastest plans are also its leanest
has few of them, and the search then examines everything: 405B on 16,384 GPUs took minutes.)"""
from __future__ import annotations

import heapq
import math

from planner.candidates import SearchOptions
from planner.ranking import DECISION_K, MEMORY_BAND, outer_key, price
from planner.search_state import Found

# Rows proven per row asked for: about half the rows near the fastest are beaten in time and
# memory by a faster one and left out (llama-70b on 8x8xA100: 4 of --top 5 shown with one row
# per row asked, 5 with two, for 15 % more search).
TABLE_ROWS_PER_SHOWN = 2


class Cutoff:
    """The cutoff of one branch and bound, tightened as its plans are found (`add`)."""

    def __init__(self, options: SearchOptions) -> None:
        self.top_k, self.objective = options.top_k, options.objective   # (a half's comes back pickled)
        self.s = math.inf   # its lowest value yet: every plan faster than it was examined
        self._best: dict = {}   # layout -> its best (step time, peak memory)

    def add(self, found: Found) -> None:
        key, p = outer_key(found.plan), price(found)
        if key in self._best and self._best[key] <= p:
            return
        self._best[key] = p
        if p[0] < self.s or self.objective == "memory":
            self.s = min(self.s, self._from_rows())

    def _from_rows(self) -> float:
        prices = sorted(set(self._best.values()))   # one row per price
        cutoff = self._kth([t for t, _ in prices], max(TABLE_ROWS_PER_SHOWN * self.top_k, DECISION_K))
        if self.objective == "memory" and prices:   # the leanest within MEMORY_BAND of the fastest
            cutoff = max(cutoff, (1 + MEMORY_BAND) * prices[0][0])
        return cutoff

    @staticmethod
    def _kth(times: list[float], k: int) -> float:
        return heapq.nsmallest(k, times)[-1] if len(times) >= k else math.inf
