"""Event-level simulation of one optimizer step's pipeline phase.

Each pipeline rank runs its operations in the order torch executes them (costmodel.schedule_orders),
one at a time: an operation starts when the rank is free and its input has arrived. A forward
needs the previous stage's forward of the same micro-batch, a backward (or backward-for-inputs)
the next stage's; backward-for-weights follows its own backward-for-inputs. A stage boundary
between two ranks costs a point-to-point transfer the sender waits for (torch's pipelining
waits on its sends); between two stages on one rank (the turn of ZBV's V) it costs nothing.
Stages may be non-uniform: costs come per virtual stage from the cost model (costmodel.stage_costs).

Memory: a micro-batch's activations for a stage are held from the start of its forward to the
end of its backward; under zero-bubble schedules the backward-for-inputs frees them except the
inputs of the projections, which the deferred backward-for-weights still needs and frees (Qi et
al. 2023 Sec. 3.1 count that memory; torch's order decides how many are deferred at once); a
recomputed stage also holds the rebuilt layer during its backward. The data-parallel synchronisation and the optimizer step follow the pipeline phase
(costmodel.estimate adds them).
"""
from __future__ import annotations

from dataclasses import dataclass

from costmodel.plan import Plan
from costmodel.schedule_orders import rank_orders

# Event kinds, in the words the reports use.
FORWARD, RECOMPUTE, BACKWARD = "forward", "recompute", "backward"
BACKWARD_INPUT, BACKWARD_WEIGHT, SEND = "backward-input", "backward-weight", "send"

Event = tuple[int, int, str, int, float, float]   # (rank, stage, kind, micro-batch, start_s, end_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class StageCost:
    """Seconds and bytes of one virtual stage for one micro-batch."""

    forward_s: float
    recompute_s: float
    backward_s: float          # inputs and weights, without recomputation
    backward_weight_s: float   # the part of backward_s a zero-bubble schedule defers
    send_s: float              # its output to the next stage's rank (its input's gradient too, unless send_back_s)
    activation_bytes: float    # held from forward to backward
    transient_bytes: float     # extra while its backward runs (the recomputed layer)
    weight_input_bytes: float = 0.0  # held from backward-for-inputs to backward-for-weights
    sent_held_bytes: float = 0.0     # each send to another rank, held until the step ends
    send_back_s: float | None = None  # its input's gradient to the previous stage's rank (None: send_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class Simulation:
    time_s: float
    events: tuple[Event, ...]
    busy_s: tuple[float, ...]            # per rank: compute and sends
    send_s: tuple[float, ...]            # per rank: sends only
    peak_activation_bytes: tuple[float, ...]
    memory_curves: tuple[tuple[tuple[float, float], ...], ...]  # per rank: (time, bytes) steps

    # Idle shares of the pipeline phase (not of the step): the textbook (p-1)/(m+p-1) on uniform
    # stages. The plan's bubble is a share of the step (costmodel.estimate.Estimate.bubble_fraction).
    @property
    def idle_fractions(self) -> list[float]:
        """Per rank: its idle time as a share of the pipeline phase."""
        return [1.0 - b / self.time_s if self.time_s else 0.0 for b in self.busy_s]

    @property
    def mean_idle_fraction(self) -> float:
        """The ranks' idle time together, as a share of their pipeline phase."""
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.time_s) if self.time_s else 0.0


_CACHE: dict[tuple, Simulation] = {}
_CACHE_SIZE = 256


def simulate(plan: Plan, costs: list[StageCost], *, keep_events: bool = True) -> Simulation:
    """Run the plan's schedule over `costs` (one per virtual stage). Without `keep_events` only
    the totals are kept (what the search needs), which is faster (benchmarks/simulate_speed.py
    times both).
    Plans that differ only where the pipeline phase cannot see it (ZeRO stage, a placement with
    the same send costs) share one simulation: the result depends on the schedule's shape and
    the costs."""
    key = (plan.pp, plan.vpp, plan.num_micro_batches, plan.schedule, tuple(costs), keep_events)
    hit = _CACHE.get(key)
    if hit is None:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.pop(next(iter(_CACHE)))   # oldest first
        hit = _CACHE[key] = _simulate(plan, costs, keep_events)
    return hit


def _simulate(plan: Plan, costs: list[StageCost], keep_events: bool) -> Simulation:
    """The event loop, written out in one function on purpose: it runs tens of thousands of
    times per call. Each rank runs its operations until one's input has not arrived, then the
    next rank takes over. A rank's held activation bytes are summed as it goes: its operations
    run one after another, a free at one's end before the next one's allocation, so the running
    sum is its memory curve."""
    orders = rank_orders(plan)
    n, m, p = plan.num_virtual_stages, plan.num_micro_batches, plan.pp
    owner = [plan.stage_rank(j) for j in range(n)]
    # per stage: seconds of each part, and whether its forward / backward output crosses ranks
    fwd_cross = [j < n - 1 and owner[j + 1] != owner[j] for j in range(n)]
    bwd_cross = [j > 0 and owner[j - 1] != owner[j] for j in range(n)]
    fwd_send = [c.send_s if cross else 0.0 for c, cross in zip(costs, fwd_cross)]
    bwd_send = [(c.send_s if c.send_back_s is None else c.send_back_s) if cross else 0.0
                for c, cross in zip(costs, bwd_cross)]
    fwd_hold = [c.sent_held_bytes if cross else 0.0 for c, cross in zip(costs, fwd_cross)]
    bwd_hold = [c.sent_held_bytes if cross else 0.0 for c, cross in zip(costs, bwd_cross)]
    # when micro-batch i's k-th hop has arrived (slot k·m + i; -1 before): its path runs forward
    # through the n stages and back, so stage j's forward reads hop j and gives hop j + 1, its
    # backward reads hop 2n - 1 - j and gives hop 2n - j; hop 0, the input, is there from the start
    arrived = [0.0] * m + [-1.0] * (2 * n * m)
    back = (2 * n - 1) * m
    clock, pos = [0.0] * p, [0] * p
    busy, sends = [0.0] * p, [0.0] * p
    level, peak = [0.0] * p, [0.0] * p
    events: list[Event] | None = [] if keep_events else None
    curves: list[list[tuple[float, float]]] = [[(0.0, 0.0)] for _ in range(p)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = 0
        for r in range(p):
            ops, i, t = orders[r], pos[r], clock[r]
            held, top, curve = level[r], peak[r], curves[r]
            while i < len(ops):
                stage, kind, mb = ops[i]
                c = costs[stage]
                # each span inline (events and curves only when kept): this loop runs tens of thousands of times
                if kind == "F":
                    hop = stage * m + mb
                    ready = arrived[hop]
                    if ready < 0:
                        break
                    if ready > t:
                        t = ready
                    held += c.activation_bytes
                    if held > top:
                        top = held
                    if events is not None:
                        curve.append((t, held))
                        events.append((r, stage, FORWARD, mb, t, t + c.forward_s))
                    t = t + c.forward_s
                    send = fwd_send[stage]
                    if send:
                        sends[r] += send
                        if events is not None:
                            events.append((r, stage, SEND, mb, t, t + send))
                        t = t + send
                    if fwd_hold[stage]:
                        held += fwd_hold[stage]
                        if held > top:
                            top = held
                        if events is not None:
                            curve.append((t, held))
                    arrived[hop + m] = t
                    busy[r] += c.forward_s + send
                elif kind == "W":
                    if events is not None:
                        events.append((r, stage, BACKWARD_WEIGHT, mb, t, t + c.backward_weight_s))
                    t = t + c.backward_weight_s
                    held -= c.weight_input_bytes
                    if events is not None:
                        curve.append((t, held))
                    busy[r] += c.backward_weight_s
                else:
                    hop = back - stage * m + mb
                    ready = arrived[hop]
                    if ready < 0:
                        break
                    if ready > t:
                        t = ready
                    held += c.transient_bytes
                    if held > top:
                        top = held
                    if events is not None:
                        curve.append((t, held))
                    if c.recompute_s:
                        if events is not None:
                            events.append((r, stage, RECOMPUTE, mb, t, t + c.recompute_s))
                        t = t + c.recompute_s
                    work = c.backward_s if kind == "B" else c.backward_s - c.backward_weight_s
                    if events is not None:
                        events.append((r, stage, BACKWARD if kind == "B" else BACKWARD_INPUT, mb, t, t + work))
                    t = t + work
                    # a deferred weight pass keeps its projections' inputs until it runs
                    kept = c.weight_input_bytes if kind != "B" else 0.0
                    held += kept - c.activation_bytes - c.transient_bytes
                    if held > top:
                        top = held
                    if events is not None:
                        curve.append((t, held))
                    send = bwd_send[stage]
                    if send:
                        sends[r] += send
                        if events is not None:
                            events.append((r, stage, SEND, mb, t, t + send))
                        t = t + send
                    if bwd_hold[stage]:
                        held += bwd_hold[stage]
                        if held > top:
                            top = held
                        if events is not None:
                            curve.append((t, held))
                    arrived[hop + m] = t
                    busy[r] += c.recompute_s + work + send
                i += 1
            progressed += i - pos[r]
            pos[r], clock[r], level[r], peak[r] = i, t, held, top
        remaining -= progressed
        if not progressed:
            raise AssertionError(f"schedule {plan.schedule} deadlocks: operation order is inconsistent")
    return Simulation(time_s=max(clock), events=tuple(events or ()), busy_s=tuple(busy),
                      send_s=tuple(sends), peak_activation_bytes=tuple(peak),
                      memory_curves=tuple(map(tuple, curves)))
