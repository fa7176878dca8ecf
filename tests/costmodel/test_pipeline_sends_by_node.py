"""A pipeline send crosses InfiniBand only where its two ranks sit on different nodes: where a node
holds several stages in a row, the sends between them run over NVLink (costmodel.stage_costs per
boundary; in the closed forms each rank its own sends, costmodel.rank_time.RankTimeModel.sends_s)."""
import pytest

from costmodel.estimate import estimate, simulate_plan
from costmodel.hardware import parse_cluster
from costmodel.rank_time import pp_sends_s, rank_time_model, spans
from costmodel.registry import resolve_model
from costmodel.schedules import Schedule
from costmodel.specs import TrainSpec
from costmodel.stage_costs import stage_costs
from planner.space import Choice, build_plan

M = 8   # micro-batches


def _setup(cluster_name: str, tp: int, pp: int, schedule: Schedule = Schedule.ONE_F_ONE_B, vpp: int = 1):
    model, train = resolve_model("llama2-13b"), TrainSpec(seq_len=4096, global_batch_size=M)
    cluster = parse_cluster(cluster_name)
    plan = build_plan(model, train, cluster, Choice(tp=tp, pp=pp, zero_stage=1, micro_batch_size=1,
                                                    schedule=schedule, vpp=vpp,
                                                    mesh_axis_order=("pp", "dp", "cp", "tp")))
    sp = spans(plan, cluster)
    return model, train, cluster, plan, sp, pp_sends_s(model, train, plan, cluster, sp.pp)


def test_two_stages_a_node_send_across_only_at_the_node_s_edge():
    model, train, cluster, plan, sp, (within, across) = _setup("2x8xH100", tp=4, pp=4)
    assert (sp.pp.members_per_node, sp.pp.num_nodes) == (2, 2)
    assert within < across / 3   # NVLink 4 against one NDR port a GPU
    costs = stage_costs(model, train, plan, cluster)
    assert [c.send_s for c in costs[:-1]] == [within, across, within]
    assert [c.send_back_s for c in costs[1:]] == [within, across, within]
    # each rank's sends over the step: the middle two each cross once a micro-batch
    sim = simulate_plan(model, train, cluster, plan)
    assert sim.send_s == pytest.approx((M * within, M * (within + across), M * (within + across), M * within))
    # the closed forms: each rank its own sends, as the simulation has them
    rtm = rank_time_model(model, train, plan, cluster, sp)
    assert [rtm.for_rank(r).pp_comm_s for r in range(4)] == pytest.approx([s / M for s in sim.send_s])
    assert rtm.pp_comm_s == pytest.approx(sum(sim.send_s) / M / 4)   # the ranks' mean: what planner.bounds sums
    est = estimate(model, train, cluster, plan)
    assert est.time_breakdown_s["comm/pp_exposed"] in (pytest.approx(M * within), pytest.approx(M * (within + across)))


def test_interleaved_chunks_wrap_across_nodes():
    """The last rank's chunk hands on to the first rank's next chunk: across the nodes too."""
    model, train, cluster, plan, sp, (within, across) = _setup("2x8xH100", tp=4, pp=4,
                                                              schedule=Schedule.INTERLEAVED, vpp=2)
    costs = stage_costs(model, train, plan, cluster)
    # stages 0-3 on ranks 0-3, stages 4-7 again on ranks 0-3
    assert [c.send_s for c in costs[:-1]] == [within, across, within, across, within, across, within]
    assert [c.send_back_s for c in costs[1:]] == [within, across, within, across, within, across, within]


@pytest.mark.parametrize("cluster_name, tp, pp, tier", [("1x8xH100", 2, 4, 0), ("2x8xH100", 8, 2, 1)])
def test_a_pipeline_on_one_node_or_a_node_a_stage_sends_on_one_tier(cluster_name, tp, pp, tier):
    model, train, cluster, plan, sp, sends = _setup(cluster_name, tp=tp, pp=pp)
    costs = stage_costs(model, train, plan, cluster)
    assert {c.send_s for c in costs[:-1]} | {c.send_back_s for c in costs[1:]} == {sends[tier]}
    rtm = rank_time_model(model, train, plan, cluster, sp)
    # the middle ranks send both ways, the end ranks one
    assert [rtm.for_rank(r).pp_comm_s for r in range(pp)] == pytest.approx(
        [sends[tier]] + [2 * sends[tier]] * (pp - 2) + [sends[tier]])


def test_four_stages_a_node_price_each_rank_s_own_sends():
    model, train, cluster, plan, sp, (within, across) = _setup("2x8xH100", tp=2, pp=8)
    assert (sp.pp.members_per_node, sp.pp.num_nodes) == (4, 2)
    sim = simulate_plan(model, train, cluster, plan)
    assert sim.send_s == pytest.approx((M * within, 2 * M * within, 2 * M * within, M * (within + across),
                                        M * (within + across), 2 * M * within, 2 * M * within, M * within))
    rtm = rank_time_model(model, train, plan, cluster, sp)
    assert [rtm.for_rank(r).pp_comm_s for r in range(8)] == pytest.approx([s / M for s in sim.send_s])
    # the closed form's critical rank pays its own sends
    est = estimate(model, train, cluster, plan, simulate=False)
    assert est.time_breakdown_s["comm/pp_exposed"] in [pytest.approx(s) for s in sim.send_s]


def test_a_v_placement_sends_its_second_chunk_back_down_the_ranks():
    """ZBV's stages 0-3 run on ranks 0-3 and 4-7 on ranks 3-0: stage 4's output goes to rank 2."""
    model, train, cluster, plan, sp, (within, across) = _setup("2x8xH100", tp=4, pp=4, schedule=Schedule.ZBV, vpp=2)
    costs = stage_costs(model, train, plan, cluster)
    assert [plan.stage_rank(j) for j in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [c.send_s for c in costs[:-1]] == [within, across, within, 0.0, within, across, within]
    assert [c.send_back_s for c in costs[1:]] == [within, across, within, 0.0, within, across, within]


def test_nodes_that_hold_uneven_shares_of_the_pipeline():
    """72-GPU racks, stages 16 ranks apart: the racks hold 5, 4, 5 and 4 stages, read off the
    ranks themselves (placement.axis_nodes), not a count per node."""
    model, train, cluster, plan, sp, (within, across) = _setup("4x72xGB200", tp=4, pp=18)
    assert sp.pp.nodes == (0,) * 5 + (1,) * 4 + (2,) * 5 + (3,) * 4
    costs = stage_costs(model, train, plan, cluster)
    assert [j for j, c in enumerate(costs[:-1]) if c.send_s == across] == [4, 8, 13]
    assert [j for j, c in enumerate(costs[1:], start=1) if c.send_back_s == across] == [5, 9, 14]
