"""Megatron-Core's expert all-to-all overlap (--overlap-moe-expert-parallel-comm,
costmodel.rank_time.ep_overlap): paired steps hide each all-to-all behind the other
micro-batch's compute at the device's contention, the warmup and cooldown passes pay theirs
whole, and an interleaved pipeline holds one virtual micro-batch more."""
from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.frameworks import framework_traits
from costmodel.hardware import parse_cluster
from costmodel.inputs import UserError
from costmodel.memory import in_flight_micro_batches
from costmodel.rank_time.ep_overlap import overlapped_ep_s, unpaired_share
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.measure.row_traits import _ep_overlap
from planner.space import Choice, build_plan

QWEN3 = resolve_model("qwen3-235b-a22b")
TRAIN = TrainSpec(seq_len=4096, global_batch_size=2048)
CHOICE = Choice(tp=2, pp=8, vpp=4, ep=32, zero_stage=1, micro_batch_size=1, sequence_parallel=True)


def _cluster(overlap: bool, contention: float | None = None):
    cluster = parse_cluster("32x8xH100")
    cluster = replace(cluster, framework=replace(framework_traits("megatron-core"), ep_a2a_overlap=overlap))
    if contention is not None:
        dev = cluster.device
        cluster = replace(cluster, device=replace(dev, efficiency=replace(dev.efficiency, comm_contention=contention)))
    return cluster


def _ep_exposed_s(overlap: bool, contention: float | None = None) -> float:
    cluster = _cluster(overlap, contention)
    plan = build_plan(QWEN3, TRAIN, cluster, CHOICE)
    return estimate(QWEN3, TRAIN, cluster, plan).time_breakdown_s["comm/ep_exposed"]


def test_unpaired_passes_are_the_first_rank_s_warmup():
    assert unpaired_share(build_plan(QWEN3, TRAIN, _cluster(True), CHOICE)) == pytest.approx((14 + 24 + 1) / (128 * 4))
    alone = replace(CHOICE, pp=1, vpp=1, tp=8, ep=8, micro_batch_size=4)
    assert unpaired_share(build_plan(QWEN3, TRAIN, parse_cluster("32x8xH100"), alone)) == pytest.approx(1 / 16)   # 2048 / dp 32 / 4


def test_a_paired_all_to_all_costs_contention_up_to_its_cover():
    assert overlapped_ep_s(2.0, 5.0, 0.0, 0.3) == pytest.approx(0.6)
    assert overlapped_ep_s(2.0, 1.5, 0.0, 0.3) == pytest.approx(0.5 + 0.45)   # outlasting its cover
    assert overlapped_ep_s(2.0, 5.0, 1.0, 0.3) == pytest.approx(2.0)          # nothing paired
    assert overlapped_ep_s(2.0, 5.0, 0.25, 0.0) == pytest.approx(0.5)


def test_the_overlap_hides_the_steady_state_s_all_to_alls():
    whole = _ep_exposed_s(False)
    u = (14 + 24 + 1) / (128 * 4)
    assert _ep_exposed_s(True, 0.0) == pytest.approx(u * whole, rel=1e-6)
    c = 0.4
    assert _ep_exposed_s(True, c) == pytest.approx((u + (1 - u) * c) * whole, rel=1e-6)
    assert _ep_exposed_s(False, c) == pytest.approx(whole)


def test_an_interleaved_pipeline_holds_one_virtual_micro_batch_more():
    cluster = _cluster(True)
    plan = build_plan(QWEN3, TRAIN, cluster, CHOICE)
    plain = in_flight_micro_batches(plan, 0)
    assert in_flight_micro_batches(plan, 0, cluster.framework) == pytest.approx(plain + 1 / plan.vpp)
    alone = build_plan(QWEN3, TRAIN, cluster, replace(CHOICE, pp=1, vpp=1, tp=8, ep=8, micro_batch_size=4))
    assert in_flight_micro_batches(alone, 0, cluster.framework) == in_flight_micro_batches(alone, 0) == 1


ROW = {"id": "r", "framework": "megatron-core", "ep": "32", "pp": "8", "vpp": "4", "micro_batch": "1",
       "recompute": "none", "zero_stage": "1", "ep_overlap": "yes"}


@pytest.mark.parametrize("change,message", [
    ({"framework": "torchtitan"}, "has no such overlap"),
    ({"ep": "1"}, "needs expert parallelism"),
    ({"micro_batch": ""}, "needs micro_batch stated"),
    ({"tp": "2"}, "needs sp stated"),
    ({"recompute": "full"}, "without full recomputation"),
    ({"vpp": "1"}, "needs an interleaved pipeline"),
    ({"precision": "fp32"}, "needs bf16 or fp16 compute"),
])
def test_a_row_states_what_megatron_core_requires_of_the_overlap(change, message):
    row = {**ROW, **change}
    with pytest.raises(UserError, match=message):
        _ep_overlap(row, framework_traits(row["framework"]), QWEN3)
    assert _ep_overlap(ROW, framework_traits("megatron-core"), QWEN3)
    assert not _ep_overlap({**ROW, "ep_overlap": "no"}, framework_traits("torchtitan"), QWEN3)


def test_the_simulated_peak_holds_the_overlap_s_extra_virtual_micro_batch():
    """The pipeline simulation runs interleaved 1F1B's order; what the overlap's warmup adds (one
    virtual micro-batch) is added to its peak, so that the plans shown (simulated) and the search's
    closed form agree on the overlap's memory: the same bytes more on every rank whose chunks are
    alike (the edge ranks' largest chunk holds the embedding or the head)."""
    def added(simulate: bool) -> list[float]:
        out = []
        for overlap in (False, True):
            cluster = _cluster(overlap)
            plan = build_plan(QWEN3, TRAIN, cluster, CHOICE)
            est = estimate(QWEN3, TRAIN, cluster, plan, simulate=simulate)
            out.append([m["activations"] for m in est.memory_breakdown_bytes])
        return [b - a for a, b in zip(*out)]
    simulated, closed = added(True), added(False)
    assert all(x > 0 for x in simulated)
    assert simulated[1:-1] == pytest.approx(closed[1:-1], rel=1e-6)


def test_a_multi_token_prediction_layer_needs_a_pipeline_beside_the_overlap():
    """Megatron-Core's TransformerConfig refuses the overlap with an MTP layer at pp = 1 (and more
    than one MTP layer at any pp): the one check refuses what it refuses."""
    from costmodel.rank_time.ep_overlap import overlap_problems
    from costmodel.specs import DType
    v3 = resolve_model("deepseek-v3")
    assert v3.mtp_depth == 1
    alone = overlap_problems(v3, DType.BF16, ep=8, full_recompute=False, pp=1, vpp=1)
    assert alone == ["needs a pipeline (pp of 2 or more) beside a multi-token prediction layer, as Megatron-Core does"]
    assert not overlap_problems(v3, DType.BF16, ep=8, full_recompute=False, pp=2, vpp=2)
    assert not overlap_problems(QWEN3, DType.BF16, ep=8, full_recompute=False, pp=1, vpp=1)
