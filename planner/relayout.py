"""The best interleaved plans' layer layouts improved by simulation where the closed form misses
the pipeline's phase lock.

The search's closed form prices an interleaved pipeline by rank totals, m·max_r t_r, and its
split gives each rank's layers evenly to its virtual stages. Interleaved 1F1B has no slack
between its virtual stages, so a stage much heavier than the others of its phase (the last,
which holds the output head, the loss and DeepSeek's MTP modules) holds every rank back each
time it runs, however light the rest of its rank. The event simulation then finds the step
slower than the closed form said (DeepSeek-V3 at PP8 VP4: 26.7 s simulated, 21.9 s in closed
form), and the layouts that avoid it, such as Megatron-Core's for V3 whose last stage holds the
MTP module and the loss alone (Et|(tt|)*30mL), lie outside the search's splits.

Where a plan's simulated step exceeds its closed form by more than PHASE_LOCK_GAP, a descent by
simulation moves one layer at a time off its heaviest stages onto its lightest (the layers stay
in order: only the counts per stage move; the first and last stage may be left without a layer
where the framework runs that) while the simulated step falls and the plan fits and runs under
the framework. The plans it finds are outside the closed-form proof, as the schedules priced by
simulation only are (planner.repricing). `planner predict` runs the same descent from the plan
it is given and names the layout it finds where that is worth LAYOUT_GAIN (layout_hint)."""
from __future__ import annotations

import time
from dataclasses import replace

from costmodel.check import check_structure
from costmodel.estimate import Estimate, estimate
from costmodel.hardware import ClusterSpec
from costmodel.plan import Plan
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.stage_costs import stage_costs
from planner.search_options import SearchOptions
from planner.search_result import Found

# a simulated step this much above the plan's closed form: its layout, not noise (the closed
# form and the simulation agree on even interleaved layouts: benchmarks/phase_lock.py)
PHASE_LOCK_GAP = 0.02
DONORS, RECEIVERS = 3, 4   # the heaviest stages a layer may leave, the lightest it may join
MOST_EVALUATIONS = 60      # simulations per plan (each a whole estimate: benchmarks/simulate_speed.py times one)
LAYOUT_GAIN = 0.02         # a layout predict names runs at least this much faster than the one given


def phase_locked(found: Found, closed_form_s: float) -> bool:
    """Whether the plan's simulated step exceeds its closed form by more than PHASE_LOCK_GAP on an
    interleaved pipeline (the case a layout can mend)."""
    return found.plan.vpp > 1 and found.estimate.step_time_s > closed_form_s * (1 + PHASE_LOCK_GAP)


def relaid(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions, found: Found,
           deadline: float) -> Found | None:
    """The plan with a faster layout found by the descent (module docstring), or None."""
    best, evaluations = found, 0
    while evaluations < MOST_EVALUATIONS and time.perf_counter() < deadline:
        step = None
        for plan in _moves(model, train, cluster, best.plan):
            if evaluations >= MOST_EVALUATIONS or time.perf_counter() >= deadline:
                break
            if check_structure(model, train, cluster, plan) or (options.space and options.space.problems(plan)):
                continue
            evaluations += 1
            est = estimate(model, train, cluster, plan)
            if est.fits and est.step_time_s < (step or best).estimate.step_time_s:
                step = Found(plan=plan, estimate=est)
        if step is None:
            break
        best = step
    return None if best is found else best


def _moves(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> list[Plan]:
    """The plan with one layer moved from one of its DONORS heaviest stages to one of its
    RECEIVERS lightest (per micro-batch, as the simulation prices them), heaviest donor first."""
    costs = stage_costs(model, train, plan, cluster)
    seconds = [c.forward_s + c.recompute_s + c.backward_s + c.send_s for c in costs]
    order = sorted(range(len(seconds)), key=seconds.__getitem__)
    counts = plan.layers_per_stage
    donors = [j for j in reversed(order) if counts[j] > 0][:DONORS]
    moves = []
    for a in donors:
        for b in [j for j in order if j != a][:RECEIVERS]:
            per_stage = list(counts)
            per_stage[a] -= 1
            per_stage[b] += 1
            moves.append(_with_stages(plan, tuple(per_stage)))
    return moves


def _with_stages(plan: Plan, per_stage: tuple[int, ...]) -> Plan:
    """The plan with `per_stage` layers per virtual stage, each rank's recomputation kept: all of
    its layers where it recomputed all, else as many as it did (at most what it holds)."""
    moved = replace(plan, layers_per_stage=per_stage)
    counts = tuple(moved.layers_on_rank(r) if n == plan.layers_on_rank(r) else min(n, moved.layers_on_rank(r))
                   for r, n in enumerate(plan.recompute_num_layers))
    return replace(moved, recompute_num_layers=counts)


def layout_hint(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions, plan: Plan,
                est: Estimate, seconds: float = 5.0) -> Found | None:
    """For a plan priced as given (planner predict): the same degrees laid out again by the
    descent, where that runs at least LAYOUT_GAIN faster and fits; else None."""
    if plan.pp == 1 or not est.fits:
        return None
    found = relaid(model, train, cluster, options, Found(plan=plan, estimate=est), time.perf_counter() + seconds)
    return found if found is not None and found.estimate.step_time_s < est.step_time_s * (1 - LAYOUT_GAIN) else None


def hint_line(plan: Plan, est: Estimate, relaid_found: Found) -> str:
    """The line predict prints: the faster layout's flags (--layers, and --recompute-layers where a
    rank recomputes part of its layers) and time, and where the plan was phase-locked, by how much."""
    better = relaid_found.plan
    flags = f"--layers {','.join(map(str, better.layers_per_stage))}"
    if any(0 < n < better.layers_on_rank(r) for r, n in enumerate(better.recompute_num_layers)):
        flags += f" --recompute-layers {','.join(map(str, better.recompute_num_layers))}"
    gain = relaid_found.estimate.step_time_s / est.step_time_s - 1
    closed = est.closed_form_step_time_s
    why = (f" (a heavy stage holds this interleaved pipeline back: simulated {100 * (est.step_time_s / closed - 1):.1f}% "
           "above its rank totals' closed form)" if closed and phase_locked(Found(plan=plan, estimate=est), closed) else "")
    return (f"layout   the same degrees laid out again by simulation run {relaid_found.estimate.step_time_s:.3f} s "
            f"({100 * gain:+.1f}%){why}: {flags}")
