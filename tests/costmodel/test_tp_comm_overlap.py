"""Megatron-Core's overlap of the tensor-parallel collectives with their GEMMs (Transformer
Engine's userbuffers, costmodel.frameworks `tp_comm_overlap`) is priced, and exported, only on a
device whose profile says it runs there (`tp_comm_gemm_overlap`: H100, H200, B200): on an A100 a
Megatron-Core plan pays its TP collectives as Megatron-LM does, and its script has no
--tp-comm-overlap."""
from dataclasses import replace

import pytest

from costmodel.estimate import estimate
from costmodel.frameworks import framework_traits
from costmodel.hardware import parse_cluster, parse_profile, profile_dir
from costmodel.inputs import UserError
from costmodel.plan import PlanFile
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.exports import megatron
from planner.space import Choice, build_plan

MODEL = resolve_model("llama-70b")
TRAIN = TrainSpec(seq_len=4096, global_batch_size=1024)
CHOICE = Choice(tp=8, pp=2, zero_stage=1, micro_batch_size=1, sequence_parallel=True)


def _tp_exposed_s(cluster_text: str, framework: str, contention: float | None = None) -> float:
    cluster = replace(parse_cluster(cluster_text), framework=framework_traits(framework))
    if contention is not None:
        dev = cluster.device
        cluster = replace(cluster, device=replace(dev, efficiency=replace(dev.efficiency, comm_contention=contention)))
    plan = build_plan(MODEL, TRAIN, cluster, CHOICE)
    return estimate(MODEL, TRAIN, cluster, plan).time_breakdown_s["comm/tp_exposed"]


def test_the_overlap_hides_tp_collectives_where_the_device_runs_it():
    # H100: all but one ring step of tp=8 hidden; A100: exposed as without the overlap
    assert _tp_exposed_s("8x8xH100", "megatron-core", 0.0) < 0.25 * _tp_exposed_s("8x8xH100", "megatron-lm")
    assert _tp_exposed_s("8x8xA100", "megatron-core") == pytest.approx(_tp_exposed_s("8x8xA100", "megatron-lm"))


def test_hidden_tp_collectives_cost_the_device_s_contention():
    """What hides behind the GEMMs slows them by comm_contention of its time, as hidden DP
    collectives do: the exposed share grows from s to s + c (1 - s)."""
    hidden, c = _tp_exposed_s("8x8xH100", "megatron-core", 0.0), 0.3
    whole = _tp_exposed_s("8x8xH100", "megatron-core", 1.0)   # every second of it paid
    assert _tp_exposed_s("8x8xH100", "megatron-core", c) == pytest.approx(hidden + c * (whole - hidden))
    assert _tp_exposed_s("8x8xH100", "megatron-lm", c) == pytest.approx(_tp_exposed_s("8x8xH100", "megatron-lm", 0.0))


@pytest.mark.parametrize("device,overlaps", [("A100-SXM4-80GB", False), ("H100-SXM5-80GB", True),
                                             ("H200-SXM-141GB", True), ("B200", True)])
def test_the_shipped_profiles_say_where_it_runs(device, overlaps):
    assert parse_cluster(f"1x8x{device}").device.tp_comm_gemm_overlap is overlaps


def test_the_export_asks_for_the_overlap_only_where_it_was_priced():
    def flags(cluster_text):
        cluster = replace(parse_cluster(cluster_text), framework=framework_traits("megatron-core"))
        plan = build_plan(MODEL, TRAIN, cluster, CHOICE)
        pf = PlanFile(model=MODEL, train=TRAIN, cluster=cluster, plan=plan)
        return [name for name, _ in megatron.arguments(pf, plan)]
    assert "--tp-comm-overlap" in flags("8x8xH100") and "--sequence-parallel" in flags("8x8xH100")
    assert "--tp-comm-overlap" not in flags("8x8xA100") and "--sequence-parallel" in flags("8x8xA100")


def test_a_profile_flag_that_is_not_true_or_false_is_named(tmp_path):
    text = (profile_dir() / "H100-SXM5-80GB.toml").read_text().replace(
        "tp_comm_gemm_overlap = true", 'tp_comm_gemm_overlap = "yes"')
    with pytest.raises(UserError, match=r"\[device\] tp_comm_gemm_overlap is true or false"):
        parse_profile(text, tmp_path / "mine.toml")


def test_torch_async_tp_leaves_the_backward_reduce_scatters_exposed():
    """Transformer Engine overlaps every ring step but one, both ways; torch's async TP
    (torchtitan) fuses no backward reduce-scatter, half the backward's collectives."""
    from costmodel.frameworks import tp_comm_exposed_shares
    te = framework_traits("megatron-core")
    titan = replace(framework_traits("torchtitan"), tp_comm_overlap=True)
    assert tp_comm_exposed_shares(te, True, 8, True, tp_within_node=True) == (1 / 8, 1 / 8)
    assert tp_comm_exposed_shares(titan, True, 8, True, tp_within_node=True) == (1 / 8, (1 + 1 / 8) / 2)
    assert tp_comm_exposed_shares(titan, False, 8, True, tp_within_node=True) == (1.0, 1.0)   # not on this device
    assert tp_comm_exposed_shares(te, True, 16, True, tp_within_node=False) == (1.0, 1.0)   # not over nodes


def test_tensor_parallelism_over_nodes_is_priced_and_exported_without_the_overlap():
    """Userbuffers and symmetric memory stay within a node's NVLink domain: a TP16 plan on
    8-GPU nodes under Megatron pays its collectives whole, and its export has no --tp-comm-overlap."""
    from costmodel.frameworks import tp_in_one_node
    assert tp_in_one_node(8, 8) and tp_in_one_node(4, 8) and not tp_in_one_node(16, 8) and not tp_in_one_node(4, 6)
    model = resolve_model("gpt3-175b")
    cluster = replace(parse_cluster("16x8xH100"), framework=framework_traits("megatron-core"))
    exposed_s, flags = {}, {}
    for tp in (8, 16):
        plan = build_plan(model, TRAIN, cluster, Choice(tp=tp, pp=4, zero_stage=1, micro_batch_size=1,
                                                        sequence_parallel=True))
        exposed_s[tp] = estimate(model, TRAIN, cluster, plan).time_breakdown_s["comm/tp_exposed"]
        pf = PlanFile(model=model, train=TRAIN, cluster=cluster, plan=plan)
        flags[tp] = [name for name, _ in megatron.arguments(pf, plan)]
    # TP16 moves about as many bytes per rank as TP8, over InfiniBand and all of them exposed
    assert exposed_s[16] > 5 * exposed_s[8]
    assert "--tp-comm-overlap" in flags[8] and "--tp-comm-overlap" not in flags[16]


def test_a_fused_loss_is_one_pass_over_16_bit_logits():
    from costmodel.kernels import cross_entropy_s
    dev = parse_cluster("1x8xA100").device
    assert cross_entropy_s(8192, 50368, TRAIN, dev, fused=True) < 0.2 * cross_entropy_s(8192, 50368, TRAIN, dev)


def _reserved_bytes(cluster_text: str, framework: str, **choice) -> tuple[float, float]:
    """(the plan's reserved bytes per rank, the device's own reserve)."""
    cluster = replace(parse_cluster(cluster_text), framework=framework_traits(framework))
    plan = build_plan(MODEL, TRAIN, cluster, replace(CHOICE, **choice))
    est = estimate(MODEL, TRAIN, cluster, plan)
    assert len({m["reserved"] for m in est.memory_breakdown_bytes}) == 1
    return est.memory_breakdown_bytes[0]["reserved"], cluster.device.efficiency.reserved_memory_bytes


def test_the_overlap_s_userbuffers_are_held_beside_the_device_s_reserve():
    """Transformer Engine's initialize_ub (Megatron-Core's --tp-comm-overlap) registers 12
    buffers of seq x micro-batch / cp by hidden outside torch's allocator, whatever the TP degree:
    0.75 GiB for Llama 2 70B at 4,096 tokens in bf16; under float8 the 8 all-gather buffers hold a
    byte an element. None where the overlap does not run (an A100, our runtime)."""
    tokens_hidden = 4096 * MODEL.hidden_size
    held, reserve = _reserved_bytes("8x8xH100", "megatron-core")
    assert held - reserve == 12 * 2 * tokens_hidden == 0.75 * 2**30
    assert _reserved_bytes("8x8xH100", "megatron-core", tp=4)[0] == held
    two = _reserved_bytes("8x8xH100", "megatron-core", micro_batch_size=2)
    assert two[0] - two[1] == 2 * (held - reserve)
    fp8 = _reserved_bytes("8x8xH100", "megatron-core", fp8_linears=True)
    assert fp8[0] - fp8[1] == (8 * 1 + 4 * 2) * tokens_hidden
    for cluster, framework in (("8x8xA100", "megatron-core"), ("8x8xH100", "megatron-lm"), ("8x8xH100", "planner")):
        assert _reserved_bytes(cluster, framework)[0] == _reserved_bytes(cluster, framework)[1]
