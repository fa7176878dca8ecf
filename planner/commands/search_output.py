"""What `planner search` shows of a finished search: the JSON document of --json, or the summary,
the ranked table, the proof line and why the first plan won (planner.commands.search runs it)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from costmodel.fidelity import error_band, long_sequence_note
from costmodel.hardware import ClusterSpec
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.units import GIB
from planner.objective import RunGoal
from planner.search import Found, SearchResult


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchOutcome:
    """A search's result and what the command made of it, for either rendering."""
    model: ModelSpec
    train: TrainSpec
    cluster: ClusterSpec
    result: SearchResult
    framework: str
    objective: str
    top: int
    failures: Any            # costmodel.resilience's stated failure rates (None: unstated)
    goal: RunGoal | None     # --tokens: the run each row is priced for
    left_out: str            # the line saying which rows --deadline-days / --budget-usd left out
    compared: list           # planner.compare's comparisons of the first plan with the others
    exported: dict | None    # --export: the configuration written and its summary lines
    cost: Any                # --tokens: the first plan's training cost (None without)

    @property
    def best(self) -> Found:
        return self.result.plans[0]

    @property
    def runner_up_text(self) -> str:
        return "\n".join(c.text() for c in self.compared)


def search_json(o: SearchOutcome) -> dict[str, Any]:
    from costmodel.resilience import checkpoint_cost
    result, best = o.result, o.best
    fastest = result.fastest
    return {
        "plans": [{"plan": f.plan.to_dict(), "estimate": f.estimate.to_dict(),
                   "alternatives": [a.to_dict() for a in f.alternatives],
                   **({} if o.goal is None else
                      {"training": o.goal.cost(o.model, o.train, o.cluster, f.estimate).to_dict()})}
                  for f in result.plans],
        "comparisons": [c.to_dict() for c in o.compared],
        "search": {**result.stats.to_dict(), "framework": o.framework, "equivalent_plans": result.equivalent,
                   "error_band": result.error_band, "error_band_note": long_sequence_note(o.train.seq_len, o.cluster),
                   "offloaded_because": result.offloaded_because,
                   "rows_proven_to_s": result.rows_proven_to_s, "unpriced_plans": result.unpriced,
                   "fastest": None if fastest is None else
                   {"plan": fastest.plan.to_dict(), "estimate": fastest.estimate.to_dict()},
                   # what `optimal` is about: the fastest closed-form plan (`fastest` may be a variant
                   # priced by simulation alone, outside the proof)
                   "proven_fastest": None if result.proven_fastest is None else
                   {"plan": result.proven_fastest.plan.to_dict(),
                    "estimate": result.proven_fastest.estimate.to_dict()}},
        # the first plan's checkpoint interval and throughput with failures (costmodel.resilience)
        "checkpoint": checkpoint_cost(o.model, o.train, o.cluster.world_size, best.estimate.step_time_s,
                                      best.estimate.tokens_per_s, o.failures).to_dict(),
        **({} if o.exported is None else {"export": o.exported}),
        **({} if o.cost is None else {"training": o.cost.to_dict()})}


def print_search(o: SearchOutcome) -> None:
    from reports.tables import search_table, summary_lines
    print(summary_lines(o.model, o.train, o.cluster, o.best.plan, o.best.estimate, o.failures))
    if o.cost is not None:
        from costmodel.training_cost import summary_line
        print(summary_line(o.cost))
    print()
    print(search_table(o.result.plans, o.cluster))
    for line in _alternative_lines(o.result.plans):
        print(line)
    print()
    for line in _proof_lines(o.result, o.cluster):
        print(line)
    for line in (_equivalence_line(o.result, o.top), o.left_out, _rows_line(o),
                 ranked_for_robustness(o.result.plans, o.objective)):
        if line:
            print(line)
    if o.compared:
        print("why the first plan: each line the other plan's figure vs the first's")
        print(o.runner_up_text)
    if o.exported is not None:
        print()
        if o.exported["file"] is None:
            print(o.exported["text"], end="")
        print("\n".join(o.exported["summary"]))


def _alternative_lines(plans: list[Found]) -> list[str]:
    """Per row, the plans it stands for that are priced the same (time and memory)."""
    lines = []
    for i, f in enumerate(plans, 1):
        if f.alternatives:
            shown = ", ".join(a.short() for a in f.alternatives[:3]) + (" ..." if len(f.alternatives) > 3 else "")
            lines.append(f"row {i} stands for {len(f.alternatives)} more priced the same (time and memory): {shown}")
    return lines


def _proof(result: SearchResult, fastest: Found) -> str:
    stats = result.stats
    if stats.optimal:
        return "proven optimal under the cost model (closed-form pipeline; the top plans re-priced by simulation)"
    if not stats.enumerated:
        return ("NOT proven optimal (stopped at --time-limit while the space was still being listed: "
                "no bound on the rest; raise --time-limit)")
    closed_form_s = fastest.estimate.closed_form_step_time_s or fastest.estimate.step_time_s
    return (f"NOT proven optimal (stopped at --time-limit; no unexamined plan is faster than "
            f"{stats.lower_bound_s:.3f} s in closed form, gap {100 * (closed_form_s / stats.lower_bound_s - 1):.1f}%)")


def _proof_lines(result: SearchResult, cluster: ClusterSpec) -> list[str]:
    """The line saying whether the fastest plan is proven fastest, and of how many candidates;
    before it, where a plan priced only by simulation won (a schedule without a closed form, a
    layout laid out again by simulation), the line saying the proof is about the fastest
    closed-form plan."""
    fastest = result.fastest or result.plans[0]
    proven = result.proven_fastest
    # the gap is the closed-form proof's: of the plan it is about (a variant priced by simulation
    # alone, such as a plan laid out again, has no closed form the bound is tied to)
    proof = _proof(result, proven or fastest)
    lines, label = [], "fastest plan"
    if proven is not None and proven.plan != fastest.plan:
        why = (f"its layers were laid out again by simulation, which found the closed form of its {fastest.plan.schedule} "
               "too fast on the stages the search split (planner.relayout)" if fastest.plan.schedule.traits.closed_form
               else f"{fastest.plan.schedule} has no closed form, so it was priced by simulation")
        lines.append(f"fastest plan ({fastest.plan.short()}, {fastest.estimate.step_time_s:.3f} s): {why}, "
                     "as a variant of the best closed-form plans, outside the proof below")
        label, fastest = "fastest closed-form plan", proven
    stats = result.stats
    lines.append(f"{label} ({fastest.plan.short()}, {fastest.estimate.step_time_s:.3f} s) {proof}, "
                 f"within the model's measured error of +-{100 * result.error_band:.1f}% "
                 f"({error_band(cluster)[1]}): {stats.num_candidates:,} candidates, "
                 f"{stats.num_solved:,} solved exactly, {stats.num_feasible:,} feasible, {stats.wall_s:.2f} s")
    if result.offloaded_because:
        lines.append(f"the host holds what the devices cannot: {result.offloaded_because} (on-device plans are "
                     "searched first; --fix offload=yes|no and --fix act_offload=yes|no decide from the start)")
    return lines


def _equivalence_line(result: SearchResult, top: int) -> str:
    """How many plans the model's error cannot tell apart, and why the first of them leads."""
    if result.equivalent <= 1:
        return ""
    from costmodel.fidelity import MEMORY_ERROR_BAND
    from planner.ranking import memory_margin
    spare, peak, _ = memory_margin(result.plans[0].estimate)
    listed = f" (--top {top} lists {len(result.plans)} of them)" if result.equivalent > len(result.plans) else ""
    safe = (f"a margin of the memory model's largest error, {100 * MEMORY_ERROR_BAND:.1f}% of the peak = "
            f"{MEMORY_ERROR_BAND * peak / GIB:.1f} GiB here")
    why = (f"{safe}, is safe and larger ones are not told apart" if spare >= MEMORY_ERROR_BAND * peak
           else f"short of {safe}, the larger margin leads")
    return (f"{result.equivalent} plans within +-{100 * result.error_band:.1f}% of the fastest are equivalent "
            f"under that error{listed}: the first is the most robust ({spare / GIB:.1f} GiB to spare; {why}; "
            "then fewer moving parts, then time)")


def _rows_line(o: SearchOutcome) -> str:
    """When fewer rows than --top are listed: up to where the search proved their order."""
    result = o.result
    if result.rows_proven_to_s is None or len(result.plans) >= o.top or o.left_out:
        return ""
    more = (f"{result.unpriced:,} more plans found were not re-priced by simulation within --time-limit, "
            "which a larger --time-limit may list" if result.unpriced else "a larger --top proves more")
    return (f"{len(result.plans)} rows of --top {o.top}: the search proves the order of plans up to "
            f"{result.rows_proven_to_s:.3f} s (closed form) and lists no row above it, nor one a listed row "
            f"beats in both time and memory; {more}")


def ranked_for_robustness(plans: list[Found], objective: str = "time") -> str:
    """When row 2 is predicted faster than row 1, the line saying why it is second ("" otherwise);
    what the first plan wins by is planner.compare's."""
    if len(plans) < 2 or plans[1].estimate.step_time_s > plans[0].estimate.step_time_s - 1e-6:
        return ""
    gap = plans[0].estimate.step_time_s - plans[1].estimate.step_time_s
    why = ("--objective memory ranks the plans within 5% of the fastest by their memory" if objective == "memory"
           else "within the model's error band: ranked below the first for robustness")
    return f"row 2 ({plans[1].plan.short()}) is predicted {gap * 1e3:,.0f} ms faster per step, {why}"
