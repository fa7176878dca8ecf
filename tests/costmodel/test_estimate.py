import pytest

from costmodel.check import check_memory, check_plan
from costmodel.estimate import estimate
from costmodel.pipeline_closed_form import pipeline_time_s
from costmodel.plan import Recompute
from costmodel.rank_time import RankTimes
from costmodel.schedules import Schedule
from planner.space import Choice, build_plan


def _uniform(p, f=1.0, b=1.0, w=1.0):
    return [RankTimes(forward_s=f, backward_s=b + w, backward_weight_s=w, recompute_s=0.0,
                      tp_comm_s=0.0, cp_comm_s=0.0, pp_comm_s=0.0) for _ in range(p)]


def _plan(pp, m, schedule, vpp=1):
    from costmodel.hardware import parse_cluster
    from costmodel.registry import MODELS
    from costmodel.specs import TrainSpec
    train = TrainSpec(seq_len=32, global_batch_size=m)
    return build_plan(MODELS["megatron-145b"], train, parse_cluster(f"1x{pp}xA100"),
                      Choice(pp=pp, vpp=vpp, schedule=schedule))


@pytest.mark.parametrize("p,m", [(4, 8), (8, 32), (16, 128)])
def test_1f1b_bubble_is_closed_form(p, m):
    """Narayanan et al. 2021: bubble fraction (p - 1)/(m + p - 1) on uniform stages."""
    total, _ = pipeline_time_s(_plan(p, m, Schedule.ONE_F_ONE_B), _uniform(p))
    t = 3.0
    assert (total - m * t) / total == pytest.approx((p - 1) / (m + p - 1))


def test_interleaving_divides_the_bubble_by_v():
    p, m, v = 8, 32, 2
    total, _ = pipeline_time_s(_plan(p, m, Schedule.INTERLEAVED, vpp=v), _uniform(p))
    assert total - m * 3.0 == pytest.approx((p - 1) * 3.0 / v)


def test_zb_h1_bubble_is_a_third_of_1f1b():
    """Qi et al. 2023: (p - 1)(F + B - W) instead of (p - 1)(F + B + W); F = B = W gives 1/3."""
    p, m = 8, 32
    zb, _ = pipeline_time_s(_plan(p, m, Schedule.ZB_H1), _uniform(p))
    base, _ = pipeline_time_s(_plan(p, m, Schedule.ONE_F_ONE_B), _uniform(p))
    assert (zb - m * 3.0) == pytest.approx((base - m * 3.0) / 3)


@pytest.mark.parametrize("choice", [
    Choice(tp=8, pp=4, zero_stage=1, recompute=Recompute.SELECTIVE),
    Choice(tp=4, pp=4, vpp=5, zero_stage=1, micro_batch_size=2),
    Choice(tp=2, pp=2, cp=2, zero_stage=3, recompute=Recompute.FULL, recompute_layers=10),
    Choice(tp=8, pp=8, schedule=Schedule.ZB_H1),
    Choice(tp=8, zero_stage=3),
])
def test_ledger_sums_to_step_time(llama70b, a100_64, train_4k, choice):
    plan = build_plan(llama70b, train_4k, a100_64, choice)
    assert check_plan(llama70b, train_4k, a100_64, plan, memory=False) == []
    est = estimate(llama70b, train_4k, a100_64, plan)
    assert sum(est.time_breakdown_s.values()) == pytest.approx(est.step_time_s, rel=1e-12)
    assert all(v >= 0 for v in est.time_breakdown_s.values())
    assert est.tokens_per_s == pytest.approx(4096 * 1024 / est.step_time_s)
    assert est.mfu == pytest.approx(est.model_flops / (est.step_time_s * 64 * 312e12))
    assert est.fits == (check_memory(llama70b, train_4k, a100_64, plan) == [])


def test_more_recompute_trades_time_for_memory(llama70b, a100_64, train_4k):
    def run(rc):
        plan = build_plan(llama70b, train_4k, a100_64, Choice(tp=8, pp=4, recompute=rc))
        return estimate(llama70b, train_4k, a100_64, plan)
    none, sel, full = run(Recompute.NONE), run(Recompute.SELECTIVE), run(Recompute.FULL)
    assert none.step_time_s < full.step_time_s
    assert full.max_peak_memory_bytes < sel.max_peak_memory_bytes <= none.max_peak_memory_bytes


def test_tp_across_nodes_costs_more_than_inside(llama70b, a100_64, train_4k):
    inside = build_plan(llama70b, train_4k, a100_64, Choice(tp=8, pp=4))
    across = build_plan(llama70b, train_4k, a100_64,
                        Choice(tp=8, pp=4, mesh_axis_order=("pp", "tp", "cp", "dp")))
    t_in = estimate(llama70b, train_4k, a100_64, inside).time_breakdown_s["comm/tp_exposed"]
    t_out = estimate(llama70b, train_4k, a100_64, across).time_breakdown_s["comm/tp_exposed"]
    # 4 ranks per node over NVLink, then the 1/4 shard over InfiniBand: about twice the cost
    assert t_out > 1.5 * t_in


def test_zbv_is_priced_by_the_simulator_alone(llama70b, a100_64, train_4k):
    """ZBV has no closed form; the simulation prices it, below interleaved 1F1B's bubble."""
    zbv = estimate(llama70b, train_4k, a100_64,
                   build_plan(llama70b, train_4k, a100_64, Choice(tp=8, pp=4, vpp=2, schedule=Schedule.ZBV)))
    inter = estimate(llama70b, train_4k, a100_64,
                     build_plan(llama70b, train_4k, a100_64, Choice(tp=8, pp=4, vpp=2)))
    assert zbv.closed_form_step_time_s is None and inter.closed_form_step_time_s is not None
    assert 0 < zbv.time_breakdown_s["pipeline/bubble"] < inter.time_breakdown_s["pipeline/bubble"]


def test_the_steps_host_work_is_its_own_ledger_entry_and_not_the_optimizers():
    """A run times its optimizer step alone (runtime.train); the step's own host work
    (Efficiency.step_overhead_s) is priced apart, so the run's table compares like with like and
    the host work falls in the stage's remainder, as the runtime's does."""
    from dataclasses import replace

    from costmodel.hardware import parse_cluster
    from costmodel.plan import PlanFile
    from costmodel.registry import MODELS
    from costmodel.specs import TrainSpec
    from runtime.measure import _stage_parts
    base = parse_cluster("1x2xA100")
    slow = replace(base, device=replace(base.device, efficiency=replace(base.device.efficiency, step_overhead_s=0.25),
                                        dtype_efficiency=()))
    model, train = MODELS["debug-tiny"], TrainSpec(seq_len=32, global_batch_size=8)
    plan = build_plan(model, train, slow, Choice(pp=2, schedule=Schedule.ONE_F_ONE_B))
    fast = estimate(model, train, replace(slow, device=replace(slow.device, efficiency=replace(
        base.device.efficiency, step_overhead_s=0.0))), plan)
    est = estimate(model, train, slow, plan)
    assert est.time_breakdown_s["host/step"] == 0.25
    assert est.time_breakdown_s["optimizer/step"] == fast.time_breakdown_s["optimizer/step"]
    assert est.step_time_s == pytest.approx(fast.step_time_s + 0.25)
    raw = {"stage_busy_s": [0.01, 0.01], "stage_dp_sync_s": [0.0, 0.0], "stage_optimizer_s": [0.001, 0.001]}
    _, predicted = _stage_parts(PlanFile(plan=plan, model=model, train=train, cluster=slow), est, raw, 0.3)
    _, without = _stage_parts(PlanFile(plan=plan, model=model, train=train, cluster=slow), fast, raw, 0.3)
    assert predicted["optimizer"] == without["optimizer"] == [est.time_breakdown_s["optimizer/step"]] * 2
    assert predicted["work"] == without["work"]
    # the host work is the remainder's, on every stage
    assert [a - b for a, b in zip(predicted["wait"], without["wait"])] == pytest.approx([0.25, 0.25])
