"""The order in which each pipeline rank runs its operations, per schedule.

These are the orders `torch.distributed.pipelining` executes (torch 2.13), so the simulator
prices what the runtime runs; tests/costmodel/test_schedules.py compares them with the schedule
classes' own action lists. Operations: F (forward), B (whole backward), I (backward for inputs),
W (backward for weights); zero-bubble schedules split B into I then a deferred W.

- GPipe (Huang et al. 2019): all forwards, then all backwards.
- No pipeline (pp = 1): gradient accumulation, one micro-batch's forward then its backward.
- 1F1B (Narayanan et al. 2021; torch's Schedule1F1B): stage s runs min(m, p - s) forwards, then
  alternates one backward and one forward, then the remaining backwards.
- Interleaved 1F1B (SC'21 Sec. 2.2.2): v local stages, forwards taken round by round
  (`per_round` micro-batches per local stage before moving to the next), warm-up
  (v - 1)·per_round + 2·(p - 1 - r) forwards, then 1F1B over (stage, micro-batch) pairs.
- ZB-H1 / interleaved zero bubble (Qi et al. 2023, ZB1P): as interleaved 1F1B with warm-up
  (v - 1)·per_round + (p - 1 - r), backwards split into I and W; rank r runs r plain I's before
  it starts pairing each I with the W of the oldest pending one.
- ZBV (Qi et al. 2023 Sec. 6): two stages per rank in V placement (r and 2p - 1 - r); fixed
  warm-up / steady / cool-down counts over max(2p - 1, m) slots, slots past m left empty.
- DualPipeV (DeepSeek-V3, arXiv 2412.19437 Sec. 3.2.1, folded into a V; torch's
  ScheduleDualPipeV, ported step for step): stages r and 2p - 1 - r, m >= 2p. Eight phases:
  2(p - 1 - r) forwards of the first stage; r + 1 pairs of forwards on both; p - 1 - r rounds
  of I, W, F on the second; m - 2p + r + 1 rounds of two overlapped pairs (a forward on one
  stage, a whole backward on the other); p - 1 - r of B then a pair; r + 1 pairs of backwards,
  whole until half-way, then split (I only); p - 1 - r of a pending W then a backward; the
  remaining W's. An overlapped pair runs as its forward then its backward (torch's runner
  executes the two sub-actions one after the other), which is how the order lists it.
"""
from __future__ import annotations

from collections import deque
from functools import lru_cache

from costmodel.plan import Plan
from costmodel.schedules import Schedule

Action = tuple[int, str, int]   # (virtual stage, "F" | "B" | "I" | "W", micro-batch)


def rank_orders(plan: Plan) -> tuple[tuple[Action, ...], ...]:
    return _orders(plan.schedule, plan.pp, plan.num_micro_batches, plan.vpp)


@lru_cache(maxsize=256)
def _orders(s: Schedule, p: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    return tuple(map(tuple, _order_lists(s, p, m, v)))


def _order_lists(s: Schedule, p: int, m: int, v: int) -> list[list[Action]]:
    if s is Schedule.GPIPE and p > 1:
        return [[(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(p)]
    if s is Schedule.ONE_F_ONE_B or p == 1:   # pp = 1: gradient accumulation, F0 B0 F1 B1 ...
        return [_one_f_one_b(r, p, m) for r in range(p)]
    if s is Schedule.ZBV:
        return [_zbv(r, p, m) for r in range(p)]
    if s is Schedule.DUALPIPEV:
        return [_DualPipeV(r, p).order(m) for r in range(p)]
    zero_bubble = s is Schedule.ZB_H1
    return [_interleaved(r, p, m, v, zero_bubble) for r in range(p)]


def _one_f_one_b(r: int, p: int, m: int) -> list[Action]:
    warmup = min(m, p - r)
    ops: list[Action] = [(r, "F", i) for i in range(warmup)]
    f = warmup
    for b in range(m):
        ops.append((r, "B", b))
        if f < m:
            ops.append((r, "F", f))
            f += 1
    return ops


def _interleaved(r: int, p: int, m: int, v: int, zero_bubble: bool) -> list[Action]:
    rounds = max(1, m // p)
    per_round = m // rounds
    warmup = min((v - 1) * per_round + (1 if zero_bubble else 2) * (p - 1 - r), m * v)
    total = m * v   # forwards (= backwards) on this rank

    def fwd_stage(k: int) -> int:
        return (k // per_round) % v * p + r

    def bwd_stage(k: int) -> int:
        return (v - 1 - (k - warmup) // per_round % v) * p + r

    # the next micro-batch of each local stage, per kind (its stage // p indexes the lists)
    next_f, next_b, next_w = [0] * v, [0] * v, [0] * v
    ops: list[Action] = []
    backward_kind = "I" if zero_bubble else "B"
    pending_w: deque[int] = deque()   # op indices whose W is still to run
    for k in range(warmup + total):
        if k < total:
            stage = fwd_stage(k)
            ops.append((stage, "F", next_f[stage // p]))
            next_f[stage // p] += 1
        if k >= warmup:
            stage = bwd_stage(k)
            ops.append((stage, backward_kind, next_b[stage // p]))
            next_b[stage // p] += 1
            pending_w.append(k)
            if zero_bubble and k - warmup >= r:
                ops.append(_weight_pass(bwd_stage(pending_w.popleft()), p, next_w))
    while zero_bubble and pending_w:
        ops.append(_weight_pass(bwd_stage(pending_w.popleft()), p, next_w))
    return ops


def _weight_pass(stage: int, p: int, next_w: list[int]) -> Action:
    """The W of a local stage's next deferred backward."""
    mb = next_w[stage // p]
    next_w[stage // p] = mb + 1
    return stage, "W", mb


def _zbv(r: int, p: int, m: int) -> list[Action]:
    c0, c1 = r, 2 * p - 1 - r
    return [a for a in _zbv_main(r, p, max(2 * p - 1, m), c0, c1) if a[2] < m]


def _zbv_main(r: int, p: int, slots: int, c0: int, c1: int) -> list[Action]:
    f0 = f1 = b0 = b1 = 0
    ops: list[Action] = []
    for _ in range(2 * (p - r) - 1):
        ops.append((c0, "F", f0)); f0 += 1
    for _ in range(r):
        ops.append((c1, "F", f1)); f1 += 1
        ops.append((c0, "F", f0)); f0 += 1
    for _ in range(p - r):
        ops.append((c1, "F", f1)); f1 += 1
        ops += [(c1, "I", b1), (c1, "W", b1)]; b1 += 1
    while f1 < f0 or f0 < slots:
        if f0 < slots:
            ops.append((c0, "F", f0)); f0 += 1
        ops += [(c0, "I", b0), (c0, "W", b0)]; b0 += 1
        ops.append((c1, "F", f1)); f1 += 1
        ops += [(c1, "I", b1), (c1, "W", b1)]; b1 += 1
    w0, w1 = b0, b1
    for _ in range(r):
        ops.append((c0, "I", b0)); b0 += 1
        ops.append((c1, "I", b1)); b1 += 1
    for _ in range(p - r):
        ops.append((c0, "I", b0)); b0 += 1
        ops.append((c0, "W", w0)); w0 += 1
    ops += [(c1, "W", i) for i in range(w1, b1)]
    ops += [(c0, "W", i) for i in range(w0, b0)]
    return ops


class _DualPipeV:
    """One rank's DualPipeV order (torch's ScheduleDualPipeV._calculate_single_rank_operations):
    a micro-batch counter per (stage, kind), whole backwards counted as I and W both, and a
    queue of the weight passes the split backwards left."""

    def __init__(self, r: int, p: int) -> None:
        self.r, self.p, self.s0, self.s1 = r, p, r, 2 * p - 1 - r
        self.ops: list[Action] = []
        self.count: dict[tuple[int, str], int] = {}
        self.pending: list[tuple[int, int]] = []

    def add(self, stage: int, kind: str) -> None:
        key = (stage, "I" if kind == "B" else kind)
        i = self.count.get(key, 0)
        self.ops.append((stage, kind, i))
        self.count[key] = i + 1
        if kind == "I":
            self.pending.append((stage, i))

    def weight(self) -> None:
        if self.pending:
            stage, i = self.pending.pop(0)
            self.ops.append((stage, "W", i))

    def order(self, m: int) -> list[Action]:
        r, p, s0, s1 = self.r, self.p, self.s0, self.s1
        for _ in range(2 * (p - r - 1)):
            self.add(s0, "F")
        for _ in range(r + 1):
            self.add(s0, "F"); self.add(s1, "F")
        for _ in range(p - r - 1):
            self.add(s1, "I"); self.weight(); self.add(s1, "F")
        for _ in range(m - 2 * p + r + 1):   # overlapped pairs: forward, then whole backward
            self.add(s0, "F"); self.add(s1, "B")
            self.add(s1, "F"); self.add(s0, "B")
        for _ in range(p - r - 1):
            self.add(s1, "B"); self.add(s1, "F"); self.add(s0, "B")
        split = False
        for i in range(r + 1):   # the drain's second half splits its backwards
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            self.add(s1, "I" if split else "B")
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            self.add(s0, "I" if split else "B")
        for _ in range(p - r - 1):
            self.weight(); self.add(s0, "I" if split else "B")
        for _ in range(r + 1):
            self.weight()
        return self.ops
