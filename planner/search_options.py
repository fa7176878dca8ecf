"""What the user fixed or narrowed for a search and the bounds it works within: the search's
options (SearchOptions), the space a target framework runs (FrameworkSpace), the training-state
placements it weighs (States), and the filters every enumeration applies (allowed, dominant).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, NamedTuple

from costmodel.check_levers import offload_problems
from costmodel.hardware import ClusterSpec
from costmodel.plan import Plan

if TYPE_CHECKING:
    from planner.space import Choice

MAX_MICRO_BATCH = 64


MAX_CP = 8


REASON_CHARS = 80


def reason_key(problem: str) -> str:
    """A refusal as the search counts it: before its parenthesis, cut at a word within
    REASON_CHARS, so that refusals alike but for their figures count together."""
    head = problem.split(" (")[0]
    return head if len(head) <= REASON_CHARS else head[:REASON_CHARS].rsplit(" ", 1)[0] + " ..."


class States(NamedTuple):
    """Where a plan keeps its training states: the ZeRO stage, and whether the sharded ones (and
    their optimizer step) sit on the host (Plan.offload_optimizer)."""

    zero_stage: int
    offload_optimizer: bool = False


# Every state placement the search weighs, in the order of its bound table's columns. Offloading
# needs a shard to move (ZeRO >= 1) but not a data-parallel group: alone, a device still moves its
# states to the host, which is what lets a model too large for the device's memory train at all.
STATE_OPTIONS = (States(0), States(1), States(2), States(3), States(1, True), States(2, True), States(3, True))


def states_allowed(options: "SearchOptions", cluster: ClusterSpec) -> tuple[bool, ...]:
    """Per STATE_OPTIONS entry: whether the user's constraints and the device allow it."""
    stages = allowed(options, "zero_stage", [0, 1, 2, 3])
    offloads = allowed(options, "offload_optimizer", [False, True])
    runs = options.space.zero_stages if options.space is not None else None
    return tuple(o.zero_stage in stages and o.offload_optimizer in offloads and (runs is None or o.zero_stage in runs)
                 and not offload_problems(cluster, o.zero_stage, o.offload_optimizer) for o in STATE_OPTIONS)


def replicas_beside_parallelism(c: Plan | Choice) -> bool:
    """Whether data-parallel replicas share the mesh with TP, PP, CP or EP (FrameworkSpace's
    zero_stages_beside_parallelism)."""
    return c.dp > 1 and max(c.tp, c.pp, c.cp, c.ep) > 1


def states_for_group(states: States, sharded: bool) -> bool:
    """Whether a placement is its own plan for a choice with (`sharded`) or without a ZeRO group:
    without one ZeRO-1 and -2 on the device are stage 0's plan, but ZeRO-3 is not (FSDP2 still
    reshards after forward, freeing the gathered 16-bit copies of the fp32 weights:
    costmodel.memory.state_bytes_from_counts), nor is offloading."""
    return sharded or states.zero_stage in (0, 3) or states.offload_optimizer


@dataclass(frozen=True, kw_only=True, slots=True)
class FrameworkSpace:
    """What a framework other than our runtime can run (planner.targets builds it from the
    export target's rules): the rank orders it lays out, how it splits layers over pipeline
    stages and recomputes them, and its verdict on a whole plan (the changes its export would
    have to make; none for a plan it runs as it is)."""

    name: str
    mesh_orders: tuple[tuple[str, ...], ...]   # outermost first; any order with the same layout
    split: str = "free"   # free | even (even_layers)
    recompute_counts: str = "free"   # free (any per rank) | every_nth | block (the first k of every virtual stage) | all
    sequence_parallel: bool = True   # whether it has SP (without, SP cannot dominate TP without it)
    # the ZeRO stages and recompute modes it runs whatever else a plan holds (None: any); the
    # search lists no other, which its `problems` would refuse one by one
    zero_stages: frozenset | None = None
    zero_stages_with_pp: frozenset | None = None   # those it runs with a pipeline (None: zero_stages)
    # those it runs where data parallelism shares the mesh with TP, PP, CP or EP (None: zero_stages)
    zero_stages_beside_parallelism: frozenset | None = None
    recompute_modes: frozenset | None = None
    problems: Callable[[Plan], list[str]] = lambda plan: []


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchOptions:
    top_k: int = 5
    max_tp: int | None = None  # None: devices per node (TP across nodes is never competitive)
    fixed: dict = field(default_factory=dict)  # field name -> value, e.g. {"pp": 4}
    no_recompute: bool = False
    objective: str = "time"  # or "memory": least memory within 5 % of the best time
    time_limit_s: float = 60.0  # then stop: best found so far, not proven optimal
    # the schedules a plan may use (None: every one the runtime runs); e.g. the ones the
    # framework of a published run offers, for `planner validate`
    schedules: frozenset | None = None
    # plans within this fraction of the fastest are equivalent under the evidence; the most robust
    # of them is shown first. None: the cluster's (costmodel.fidelity.error_band: the model's
    # leave-one-source-out error, or a measured machine's own probe error where larger)
    error_band: float | None = None
    progress: Callable[[str], None] | None = None
    # the framework that will run the plan when not our runtime (planner.targets)
    space: FrameworkSpace | None = None


def allowed(options: SearchOptions, name: str, values: list) -> list:
    if name in options.fixed:
        return [v for v in values if v == options.fixed[name]]
    return values


def dominant(options: SearchOptions, name: str, values: list, best) -> list:
    """Keep only the value(s) that dominate the others under the cost model, unless the user
    fixed this field (then honour their choice). `best`: one value or a list of them."""
    if name in options.fixed:
        return allowed(options, name, values)
    kept = [b for b in (best if isinstance(best, (list, tuple)) else [best]) if b in values]
    return kept or values
