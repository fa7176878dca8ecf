"""The search drops a rank placement whose every link is at least as slow as another's
(costmodel.rank_time.link_costs). That is only sound if every time the cost model prices is
nondecreasing in those links: checked here on whole plans, with the simulator's pricing too."""
import itertools

import pytest

from costmodel.estimate import estimate
from costmodel.hardware import parse_cluster
from costmodel.plan import Recompute
from costmodel.rank_time import link_costs, spans
from costmodel.registry import resolve_model
from costmodel.schedules import Schedule
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

TRAIN = TrainSpec(seq_len=4096, global_batch_size=64)


@pytest.mark.parametrize("choice", [
    Choice(tp=2, pp=4, cp=2, zero_stage=1, recompute=Recompute.FULL, schedule=Schedule.ZB_H1),
    Choice(tp=4, pp=2, cp=2, zero_stage=3, micro_batch_size=2),
    Choice(tp=2, pp=2, vpp=2, zero_stage=2, recompute=Recompute.SELECTIVE),
])
def test_a_placement_with_no_faster_link_gives_no_faster_plan(choice):
    model, cluster = resolve_model("llama2-13b"), parse_cluster("4x8xH100")
    plans = [build_plan(model, TRAIN, cluster, Choice(**{**{f: getattr(choice, f) for f in Choice.__slots__},
                                                          "mesh_axis_order": order}))
             for order in itertools.permutations(("pp", "dp", "cp", "tp"))]
    priced = [(link_costs(spans(p, cluster), cluster), p) for p in plans]
    pairs = 0
    for (costs_a, a), (costs_b, b) in itertools.permutations(priced, 2):
        if all(x <= y for x, y in zip(costs_a, costs_b)):
            pairs += 1
            for simulate in (False, True):
                fast = estimate(model, TRAIN, cluster, a, simulate=simulate).step_time_s
                slow = estimate(model, TRAIN, cluster, b, simulate=simulate).step_time_s
                assert fast <= slow * (1 + 1e-12), (a.short(), b.short())
    assert pairs > len(plans)  # more than each placement against itself
