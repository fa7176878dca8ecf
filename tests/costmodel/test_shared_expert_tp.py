"""A mixture's shared expert as each framework runs it (costmodel.frameworks `shared_expert_tp`):
Megatron-Core's SharedExpertMLP and torchtitan's shared_experts are split over the dense TP group
as a dense MLP (gate and up column-parallel, down row-parallel, the sequence shard gathered before
and the output reduce-scattered after); our runtime (runtime.moe) keeps it whole on every TP rank
over the rank's sequence shard. Per-rank parameters, states, GEMMs, saved tensors and TP
collectives follow."""
from dataclasses import replace

import pytest

from costmodel.frameworks import FRAMEWORKS, RUNTIME, framework_traits
from costmodel.hardware import parse_cluster, run_by
from costmodel.kernels.gemm import _moe_gemms_s, gemm_s, linear_shapes, moe_tokens
from costmodel.memory import layer_activation_bytes, stage_memory
from costmodel.params import (
    layer_params,
    moe_tp_replicated_params,
    rank_params,
    rank_params_at,
    shared_expert_params,
)
from costmodel.rank_time import spans
from costmodel.rank_time.after_pipeline import tp_replica_sync_s
from costmodel.rank_time.layer_comm import _tp_block_collective_s, _tp_layer_comm_s
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

DEEPSEEK = resolve_model("deepseek-v3")
MIXTRAL = resolve_model("mixtral-8x7b")   # no shared expert
TRAIN = TrainSpec(seq_len=4096, global_batch_size=1024)
MEGATRON = framework_traits("megatron-core")
# Megatron-Core with its shared expert held as our runtime holds it: what the trait alone changes
WHOLE = replace(MEGATRON, shared_expert_tp=False)


def _setup(model, traits, tp: int = 8, ep: int = 32, pp: int = 16, cluster: str = "256x8xH100"):
    cluster = run_by(parse_cluster(cluster), traits)
    plan = build_plan(model, TRAIN, cluster, Choice(tp=tp, pp=pp, ep=ep, zero_stage=1, micro_batch_size=1))
    return cluster, plan


def test_which_frameworks_split_the_shared_expert():
    """Megatron-Core (SharedExpertMLP on pg_collection.tp) and torchtitan (ColwiseParallel /
    RowwiseParallel on moe.shared_experts) split it; our runtime, its compiled form and the
    frameworks without shared experts do not."""
    split = {name for name, t in FRAMEWORKS.items() if t.shared_expert_tp}
    assert split == {"megatron-core", "torchtitan"}
    assert not RUNTIME.shared_expert_tp and not framework_traits("planner-compiled").shared_expert_tp


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_megatron_holds_1_over_tp_of_the_shared_expert_and_the_runtime_all_of_it(tp):
    """Per rank and layer, Megatron-Core holds 1/tp of DeepSeek-V3's shared expert (3 x 7168 x
    2048 / tp), our runtime all of it; the rest of the layer is the same, and so is the whole
    model's count (tp 1)."""
    shared = 3 * 7168 * 2048
    assert shared_expert_params(DEEPSEEK) == shared and shared_expert_params(DEEPSEEK, tp) == shared // tp
    runtime = layer_params(DEEPSEEK, tp, 32)
    assert layer_params(DEEPSEEK, tp, 32, shared_expert_tp=False) == runtime
    assert runtime - layer_params(DEEPSEEK, tp, 32, shared_expert_tp=True) == shared - shared // tp
    assert layer_params(DEEPSEEK, 1, 32, shared_expert_tp=True) == layer_params(DEEPSEEK, 1, 32)
    # a mixture without a shared expert is held alike
    assert layer_params(MIXTRAL, tp, 8, shared_expert_tp=True) == layer_params(MIXTRAL, tp, 8)


def test_a_megatron_ranks_parameters_and_states_hold_its_share():
    """A pipeline rank of DeepSeek-V3 under tp8 pp16 ep32: Megatron-Core's rank holds 7/8 of each
    of its MoE layers' shared experts (and of its MTP module's) fewer parameters than the same
    rank with the shared expert whole, none of them routed experts; our runtime's rank counts
    them whole, as before the trait (rank_params' default)."""
    cluster, plan = _setup(DEEPSEEK, MEGATRON)
    saved = 3 * 7168 * 2048 * 7 // 8
    for rank in range(plan.pp):
        split, whole = rank_params(DEEPSEEK, plan, rank, MEGATRON), rank_params(DEEPSEEK, plan, rank, WHOLE)
        moe_layers = plan.layers_on_rank(rank) - (DEEPSEEK.first_k_dense if rank == 0 else 0)
        moe_layers += DEEPSEEK.mtp_depth if rank == plan.pp - 1 else 0
        assert whole.total - split.total == moe_layers * saved, rank
        assert whole.experts == split.experts
        assert rank_params(DEEPSEEK, plan, rank, RUNTIME) == rank_params(DEEPSEEK, plan, rank) == whole
        first, last = rank == 0, rank == plan.pp - 1
        assert rank_params_at(DEEPSEEK, plan, plan.layers_on_rank(rank), first, last, MEGATRON) == split
    # states follow the parameters: weights, gradients and the ZeRO-1 shard of the optimizer's
    mem_split, mem_whole = stage_memory(DEEPSEEK, TRAIN, plan, 5, 0.0, MEGATRON), stage_memory(
        DEEPSEEK, TRAIN, plan, 5, 0.0, WHOLE)
    layers = plan.layers_on_rank(5)
    a = TRAIN.compute_dtype.num_bytes
    assert mem_whole.params_bytes - mem_split.params_bytes == pytest.approx(a * layers * saved)
    assert mem_whole.grads_bytes > mem_split.grads_bytes and mem_whole.optimizer_bytes > mem_split.optimizer_bytes
    assert mem_whole.activations_bytes == mem_split.activations_bytes


def test_split_shared_expert_leaves_the_tp_gradient_sync():
    """Parameters whole on every TP rank are all-reduced over TP after the step's DP reduction;
    a shared expert split over TP is not among them, its gate and the router are."""
    h = DEEPSEEK.hidden_size
    assert moe_tp_replicated_params(DEEPSEEK) - moe_tp_replicated_params(DEEPSEEK, True) == 3 * h * 2048
    assert moe_tp_replicated_params(DEEPSEEK, True) == h * DEEPSEEK.num_experts
    cluster, plan = _setup(DEEPSEEK, MEGATRON)
    whole_cluster = run_by(parse_cluster("256x8xH100"), WHOLE)
    sp = spans(plan, cluster)
    assert 0 < tp_replica_sync_s(DEEPSEEK, TRAIN, plan, cluster, sp, 4) < tp_replica_sync_s(
        DEEPSEEK, TRAIN, plan, whole_cluster, sp, 4)


def test_split_shared_expert_gemms_run_the_gathered_rows_at_1_over_tp_of_the_width():
    """The same FLOPs in other shapes: tokens x h x fs over the rank's shard whole, tp x the rows
    at fs/tp split; only the shared expert's three projections differ."""
    dev = parse_cluster("1x8xH100").device.for_dtype(TRAIN.compute_dtype)
    tokens, tp, h, fs = 4096, 8, DEEPSEEK.hidden_size, 2048
    shard = moe_tokens(tokens, tp)
    whole = _moe_gemms_s(DEEPSEEK, TRAIN, dev, shard, 32, grouped=True)
    split = _moe_gemms_s(DEEPSEEK, TRAIN, dev, shard, 32, grouped=True, shared_split=tp)

    def shared(m, width, npass):   # gate and up (h -> width), down (width -> h), each pass in its shape
        return (2 * gemm_s(*linear_shapes(m, h, width)[npass], dev, TRAIN)
                + gemm_s(*linear_shapes(m, width, h)[npass], dev, TRAIN))
    for npass, (got_split, got_whole) in enumerate(zip(split, whole)):
        assert got_split - got_whole == pytest.approx(shared(tokens, fs // tp, npass) - shared(shard, fs, npass))


def test_split_shared_expert_pays_a_dense_mlps_tp_collectives():
    """Under SP, Megatron-Core's shared expert gathers the sequence shard before fc1 and reduce-
    scatters after fc2 (the duals in backward): one all-gather and one reduce-scatter of the
    hidden states more per layer and direction than the shared expert whole; a mixture without
    a shared expert pays none, and neither does our runtime."""
    cluster, plan = _setup(DEEPSEEK, MEGATRON)
    sp = spans(plan, cluster)
    whole_cluster = run_by(parse_cluster("256x8xH100"), WHOLE)
    more = (_tp_layer_comm_s(DEEPSEEK, TRAIN, plan, cluster, sp.tp)
            - _tp_layer_comm_s(DEEPSEEK, TRAIN, plan, whole_cluster, sp.tp))
    one_mlp = (_tp_block_collective_s(DEEPSEEK, TRAIN, plan, cluster, sp.tp, output=True)
               + _tp_block_collective_s(DEEPSEEK, TRAIN, plan, cluster, sp.tp, output=False))
    assert more == pytest.approx(one_mlp) and more > 0
    runtime = run_by(parse_cluster("256x8xH100"), RUNTIME)
    assert _tp_layer_comm_s(DEEPSEEK, TRAIN, plan, runtime, sp.tp) == pytest.approx(
        _tp_layer_comm_s(DEEPSEEK, TRAIN, plan, replace(runtime, framework=replace(RUNTIME, shared_expert_tp=False)),
                         sp.tp))
    mcluster, mplan = _setup(MIXTRAL, MEGATRON, tp=4, ep=8, pp=4, cluster="8x8xH100")
    msp = spans(mplan, mcluster)
    assert _tp_layer_comm_s(MIXTRAL, TRAIN, mplan, mcluster, msp.tp) == pytest.approx(
        _tp_layer_comm_s(MIXTRAL, TRAIN, mplan, run_by(parse_cluster("8x8xH100"), WHOLE), msp.tp))


def test_saved_tensors_under_sp_are_the_same_count_and_torchtitan_keeps_the_gathered_input():
    """Under SP, Megatron-Core's split shared expert keeps its SwiGLU tensors over every token at
    1/tp of the width, as many bytes as the whole one over the rank's shard, and its input's
    sequence shard: a layer keeps the same bytes either way. torchtitan keeps the gathered
    (whole-sequence) input of its column-parallel projections (`tp_keeps_gathered_input`): the
    mixture's input whole."""
    cluster, plan = _setup(DEEPSEEK, MEGATRON)
    assert layer_activation_bytes(DEEPSEEK, TRAIN, plan, plan.recompute, MEGATRON) == pytest.approx(
        layer_activation_bytes(DEEPSEEK, TRAIN, plan, plan.recompute, WHOLE))
    titan = framework_traits("torchtitan")
    more = (layer_activation_bytes(DEEPSEEK, TRAIN, plan, plan.recompute, titan)
            - layer_activation_bytes(DEEPSEEK, TRAIN, plan, plan.recompute, replace(titan, shared_expert_tp=False)))
    tokens = plan.micro_batch_size * TRAIN.seq_len
    assert more == pytest.approx(TRAIN.compute_dtype.num_bytes * tokens * DEEPSEEK.hidden_size * (1 - 1 / plan.tp))


def test_a_tp_that_does_not_divide_the_shared_expert_is_refused_where_it_is_split():
    """Megatron-Core's column-parallel fc1 divides the shared expert's width by tp: such a plan
    is one line, and the search lists no such tp; our runtime keeps it whole and takes it."""
    from costmodel.check import check_structure
    from planner.candidates import placement_groups
    from planner.search_options import SearchOptions
    model = replace(resolve_model("deepseek-v2-lite"), shared_expert_ffn_hidden_size=2820)   # 4 | 2820, 8 does not
    train = TrainSpec(seq_len=4096, global_batch_size=64)
    for framework, refused in (("megatron-core", True), ("planner", False)):
        cluster = run_by(parse_cluster("2x8xH100"), FRAMEWORKS[framework])
        plan = build_plan(model, train, cluster, Choice(tp=8, ep=2, zero_stage=1))
        found = [p for p in check_structure(model, train, cluster, plan) if "shared expert's width" in p]
        assert bool(found) is refused, (framework, found)
        tps = {g.base.tp for g in placement_groups(model, train, cluster, SearchOptions(), lambda reason: None)}
        assert (8 in tps) is not refused and 4 in tps
