"""DeepEP's buffers (costmodel.memory.dispatcher): held outside torch's allocator where the framework
runs the expert group with the per-node dispatcher, sized by DeepEP's own hints, and a group size
DeepEP has no configuration for is refused rather than priced."""
from __future__ import annotations

from dataclasses import replace

from costmodel.check import check_plan
from costmodel.frameworks import FRAMEWORKS, RUNTIME
from costmodel.hardware import parse_cluster
from costmodel.memory import reserved_bytes
from costmodel.memory.dispatcher import deepep_buffer_bytes, uses_per_node_dispatcher
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

V3 = resolve_model("deepseek-v3")
CORE = FRAMEWORKS["megatron-core"]


def test_deepseek_v3_ep64_holds_deepeps_hinted_buffers():
    """DeepEP's own hints for 64 ranks at hidden 7168 in bf16 (Config.get_nvl_buffer_size_hint and
    get_rdma_buffer_size_hint at Megatron-Core's 20 SMs, worked by hand): 377,677,824 bytes over
    NVLink and 336,047,360 for RDMA, which takes one 512 MiB step of NVSHMEM's heap; the 32 MiB
    workspace. A group in one node has no RDMA buffer: 10 x 8 x 256 rows."""
    assert deepep_buffer_bytes(V3.hidden_size, 64) == 377_677_824 + 2**29 + 2**25
    assert deepep_buffer_bytes(V3.hidden_size, 8) == 335_709_824 + 2**25
    # float32 values take 4 bytes a value, as Megatron-Core's get_hidden_bytes counts them
    assert deepep_buffer_bytes(V3.hidden_size, 8, value_bytes=4) > deepep_buffer_bytes(V3.hidden_size, 8) + 2.9e8


def test_the_buffers_are_held_where_the_framework_runs_deepep():
    qwen, mixtral = resolve_model("qwen3-30b-a3b"), resolve_model("mixtral-8x7b")
    assert uses_per_node_dispatcher(V3, CORE, 64, 8)          # across nodes
    assert uses_per_node_dispatcher(qwen, CORE, 8, 8)         # top-8 of 128 over 8 ranks: 5.3 ranks a token
    assert not uses_per_node_dispatcher(mixtral, CORE, 8, 8)  # top-2 of 8 over 8: all-to-all
    assert not uses_per_node_dispatcher(V3, RUNTIME, 64, 8)   # the included runtime's all-to-all
    assert not uses_per_node_dispatcher(V3, CORE, 1, 8)


def test_reserved_memory_adds_the_buffers_under_megatron_only():
    train = TrainSpec(seq_len=4096, global_batch_size=1024)
    cluster = replace(parse_cluster("128x8xH100"), framework=CORE)
    plan = build_plan(V3, train, cluster, Choice(tp=2, pp=8, ep=64, zero_stage=1, micro_batch_size=1,
                                                 sequence_parallel=True))
    core = reserved_bytes(V3, train, plan, cluster.device, CORE, 8)
    runtime = reserved_bytes(V3, train, plan, cluster.device, RUNTIME, 8)
    assert core - runtime >= deepep_buffer_bytes(V3.hidden_size, 64)


def test_an_expert_group_deepep_cannot_run_is_refused():
    train = TrainSpec(seq_len=4096, global_batch_size=1024)
    cluster = replace(parse_cluster("256x8xH100"), framework=CORE)
    plan = build_plan(V3, train, cluster, Choice(tp=1, pp=8, ep=256, zero_stage=1, micro_batch_size=1))
    problems = check_plan(V3, train, cluster, plan, memory=False)
    assert any("DeepEP" in p and "ep=256" in p for p in problems), problems
    fine = build_plan(V3, train, cluster, Choice(tp=1, pp=8, ep=128, zero_stage=1, micro_batch_size=1))
    assert not any("DeepEP" in p for p in check_plan(V3, train, cluster, fine, memory=False))
    # across nodes of 4 GPUs: DeepEP's kernels take 8 a node
    qwen, four = resolve_model("qwen3-30b-a3b"), replace(parse_cluster("8x4xH100"), framework=CORE)
    across = build_plan(qwen, train, four, Choice(tp=1, pp=1, ep=8, zero_stage=1, micro_batch_size=1))
    assert any("take nodes of 8 GPUs, not 4" in p for p in check_plan(qwen, train, four, across, memory=False))
    within = build_plan(qwen, train, four, Choice(tp=1, pp=1, ep=4, zero_stage=1, micro_batch_size=1))
    assert not any("DeepEP" in p for p in check_plan(qwen, train, four, within, memory=False))


def test_a_pinned_expert_group_deepep_cannot_run_is_told_why(capsys):
    """The search leaves such groups out; pinned, the one-line refusal names DeepEP's rule, not
    just the degrees it considers."""
    from planner.cli import main
    assert main(["search", "--model", "qwen3-30b-a3b", "--cluster", "8x4xH100", "--framework", "megatron",
                 "--fix", "ep=8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ep=8 is not possible" in err and "take nodes of 8 GPUs, not 4" in err
