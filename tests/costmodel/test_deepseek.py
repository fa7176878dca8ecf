"""DeepSeek-V2/V3 in the cost model: their mechanisms' checks are one line naming the field, MLA
and the dense first layers and MTP module are counted term by term as derived here, and
DeepSeek-V3's published layout is priced. (The whole configs against transformers:
tests/runtime/test_hf_deepseek.py.)"""
from __future__ import annotations

import dataclasses
import json

import pytest

from costmodel.deepseek import dense_layer_model
from costmodel.flops import model_flops_per_step
from costmodel.inputs import UserError
from costmodel.params import layer_params, mtp_params, rank_params_at
from costmodel.plan import Recompute
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.cli import main

V3 = resolve_model("deepseek-v3")


@pytest.mark.parametrize("changes, field", [
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim 63 must be even"),
    ({"qk_nope_head_dim": 0}, "qk_nope_head_dim must be positive"),
    ({"kv_lora_rank": 0}, "q_lora_rank is set but kv_lora_rank is 0"),
    ({"q_lora_rank": 7168}, "q_lora_rank 7168 must be below hidden_size"),
    ({"num_kv_heads": 8}, "num_kv_heads 8 must equal num_heads 128"),
    ({"first_k_dense": 61}, "first_k_dense 61 leaves no expert layer"),
    ({"topk_groups": 9}, "topk_groups 9 exceeds num_expert_groups 8"),
    ({"num_expert_groups": 3}, "num_expert_groups 3 does not divide num_experts 256"),
    ({"experts_per_token": 129}, "experts_per_token 129 exceeds the experts of topk_groups 4 groups"),
    ({"mtp_depth": -1}, "mtp_depth must not be negative"),
])
def test_inconsistent_fields_are_named(changes, field):
    with pytest.raises(UserError, match=field):
        dataclasses.replace(V3, **changes)


def test_a_bad_config_is_one_line_exit_2(tmp_path, capsys):
    """The HF reader: each refusal names its key, one line, exit 2."""
    base = {"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 96, "vocab_size": 256, "kv_lora_rank": 16, "q_lora_rank": 24,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2, "topk_group": 1,
            "first_k_dense_replace": 1, "n_shared_experts": 1}
    for changes, message in (({"qk_rope_head_dim": 7}, "qk_rope_head_dim 7 must be even"),
                             ({"topk_method": "random"}, "topk_method 'random' is not supported"),
                             ({"moe_layer_freq": 2}, "moe_layer_freq other than 1"),
                             ({"index_topk": 2048}, "keys this planner does not know, which may change the cost: index_topk"),
                             ({"qk_head_dim": 20}, "qk_head_dim 20 disagrees with the head sizes"),
                             ({"head_dim": 12}, "head_dim 12 disagrees with the head sizes (expected 8)"),
                             ({"kv_lora_rank": 0}, "kv_lora_rank must be a positive integer, not 0"),
                             ({"kv_lora_rank": 64}, "kv_lora_rank 64 must be below hidden_size 64"),
                             ({"q_lora_rank": 128}, "q_lora_rank 128 must be below hidden_size 64"),
                             ({"q_lora_rank": -3}, "q_lora_rank must not be negative"),
                             ({"v_head_dim": 0}, "v_head_dim must be a positive integer, not 0"),
                             ({"num_key_value_heads": 2}, "num_key_value_heads 2 must equal num_attention_heads 4")):
        cfg = tmp_path / "config.json"
        cfg.write_text(json.dumps({**base, **changes}))
        assert main(["predict", "--model", str(cfg), "--cluster", "1x8xH100", "--seq-len", "64",
                     "--global-batch", "8"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    # the shared experts' count is read as stated (transformers' default and DeepSeek's differ)
    cfg.write_text(json.dumps({k: v for k, v in base.items() if k != "n_shared_experts"}))
    assert main(["predict", "--model", str(cfg), "--cluster", "1x8xH100", "--seq-len", "64", "--global-batch", "8"]) == 2
    assert "n_shared_experts is missing" in capsys.readouterr().err


@pytest.mark.parametrize("cluster, flags, message", [
    ("32x8xH100", ["--pp", "16", "--ep", "3"], "ep=3 does not divide the model's 256 experts"),
    ("2x8xH100", ["--ep", "512"], "ep=512 is more than the tp x cp x dp = 16 ranks"),   # more than the cluster has
    ("4x8xH100", ["--tp", "8", "--pp", "2", "--ep", "16", "--mesh-order", "dp,pp,cp,tp"], "ep=16 does not fold over"),
])
def test_an_expert_layout_the_model_or_cluster_cannot_hold_is_one_line_exit_2(capsys, cluster, flags, message):
    assert main(["predict", "--model", "deepseek-v3", "--cluster", cluster, *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_v3_flops_per_token_are_derived_term_by_term():
    """Forward FLOPs per token at 4K, 2 per multiply-add: MLA's five projections (non-absorbed),
    attention over the full s x s square (Q·K^T over 128 + 64, P·V over 128: Megatron's model-FLOPs
    convention), the dense first layers' MLP, the router and 8 routed + 1 shared experts, the LM
    head, and the MTP module's projection, layer and second head pass; backward twice forward."""
    h, s, heads = 7168, 4096, 128
    mla = h * 1536 + 1536 * heads * 192 + h * (512 + 64) + 512 * heads * (128 + 128) + heads * 128 * h
    attention = s * heads * (192 + 128)
    experts = h * 256 + 9 * 3 * h * 2048
    layer = 2 * mla + 2 * attention
    head = 2 * h * 129280
    forward = 61 * layer + 3 * 2 * 3 * h * 18432 + 58 * 2 * experts + head
    forward += 2 * 2 * h * h + layer + 2 * experts + head   # MTP
    train = TrainSpec(seq_len=s, global_batch_size=1)
    assert model_flops_per_step(V3, train) == 3 * forward * s


def test_v3_flops_and_deepseeks_gpu_hours_give_a_plausible_mfu():
    """DeepSeek-V3 (arXiv 2412.19437) Table 1: 180K H800 GPU hours per trillion tokens, 1543 tokens/s
    per GPU; against the H800's dense bf16 peak (989 TFLOP/s) our model FLOPs make that 45 % MFU,
    41 % counting the causal half of attention only, where the paper's FP8 training on H800 is
    usually put at 37-43 %."""
    train = TrainSpec(seq_len=4096, global_batch_size=15360)
    per_token = model_flops_per_step(V3, train) / train.tokens_per_step
    causal = per_token - 3 * 62 * 4096 * 128 * (192 + 128)   # half the square, 61 layers and the MTP one
    tokens_per_s = 1e12 / (180e3 * 3600)
    assert 0.44 < per_token * tokens_per_s / 989e12 < 0.47
    assert 0.39 < causal * tokens_per_s / 989e12 < 0.43


def test_mla_under_tp_splits_heads_and_keeps_the_latents_whole():
    """The up-projections and the output projection split by head over TP, the down-projections
    and the latents' norms whole on every rank (Megatron-Core's MLA)."""
    h, heads, tp = 7168, 128, 8
    down = h * 1536 + h * (512 + 64) + 1536 + 512
    split = 1536 * heads * 192 + 512 * heads * 256 + heads * 128 * h
    dense = resolve_model("deepseek-v2-lite")
    moe = layer_params(V3, tp) - layer_params(V3, 1)
    assert moe == (down + split // tp) - (down + split)
    lite_attention = 2048 * 16 * 192 + 2048 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 2048
    assert layer_params(dense, 1) == 2 * 2048 + lite_attention + 2048 * (64 + 3 * 64 * 1408 + 3 * 2 * 1408)


def test_dense_first_layers_and_mtp_sit_on_the_first_and_last_ranks():
    from planner.space import Choice, build_plan
    from planner.specs import build_specs
    plan = build_plan(*build_specs("deepseek-v3", "256x8xH100"), Choice(pp=16, ep=64))
    first, middle, last = (rank_params_at(V3, plan, 4, True, False), rank_params_at(V3, plan, 4, False, False),
                           rank_params_at(V3, plan, 3, False, True))
    h, experts = 7168, 256 // 64 * 3 * 7168 * 2048
    dense = layer_params(dense_layer_model(V3))
    assert dense == 2 * h + 1536 + 512 + (h * 1536 + 1536 * 128 * 192 + h * 576 + 512 * 128 * 256
                                          + 128 * 128 * h) + 3 * h * 18432
    assert first.experts == experts and middle.experts == 4 * experts
    assert first.layers + first.experts == 3 * dense + layer_params(V3, 1, 64)
    assert last.experts == 4 * experts   # three layers' and the MTP layer's
    # the head (norm, output), the MTP module's own parameters and its copy of the embedding
    assert last.head - (h + 129280 * h) - 129280 * h == mtp_params(V3, 1, 64) - experts
    # of which the MTP module's linears (its projection, its layer's attention and shared expert)
    # run in float8 as the layers' do: the float8 caches copy them, not the norms or the head
    assert last.mtp_linears == 2 * h * h + layer_params(V3, 1, 64) - experts
    assert first.mtp_linears == middle.mtp_linears == 0
    # under TP 2: the projection (2h -> h, column-parallel) and the layer's replicated part halved
    tp2 = build_plan(*build_specs("deepseek-v3", "256x8xH100"), Choice(pp=16, ep=64, tp=2))
    split = rank_params_at(V3, tp2, 3, False, True)
    assert split.mtp_linears == h // 2 * 2 * h + layer_params(V3, 2, 64) - experts
    assert split.float8_linears == split.layers + split.experts + split.mtp_linears


def test_deepseeks_published_layout_is_priced(capsys):
    """PP16 x EP64 x ZeRO-1 on 2048 H100s (the paper's layout, under 1F1B rather than DualPipe),
    full recomputation to fit: it runs and its MFU is below the 37-43 % DeepSeek's FP8 run on
    H800s implies (no DualPipe overlap of the all-to-alls, bf16) but of that order."""
    assert main(["predict", "--model", "deepseek-v3", "--cluster", "256x8xH100", "--pp", "16", "--ep", "64",
                 "--zero", "1", "--seq-len", "4096", "--global-batch", "15360", "--framework", "megatron",
                 "--recompute", "full", "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)["estimate"]
    assert estimate["fits"] and 0.08 < estimate["mfu"] < 0.43
    assert estimate["time_breakdown_s"]["comm/ep_exposed"] > 0


# Megatron-Core's published DeepSeek-V3 layout, Et|(tt|)*30mL: the embedding with one layer, thirty
# stages of two, the MTP module and the loss alone (Megatron-MoE-ModelZoo best_practice/deepseek-v3)
V3_LAYOUT = (1,) + (2,) * 30 + (0,)


def test_dense_first_layers_are_priced_on_the_stages_that_hold_them():
    """Where a split spreads DeepSeek's 3 dense first layers over stages (the published layout:
    one on the first rank's first stage, two on the second rank's), each rank's parameters,
    time and activations carry the dense layers it holds, and the whole model is the same: the
    ranks' parameters sum to those of the split that keeps them on the first stage. Every
    stage's time stays positive (a first stage of one layer once carried all three layers'
    correction below zero, and the simulation deadlocked)."""
    from costmodel.check import check_structure
    from costmodel.estimate import estimate
    from costmodel.memory import activation_bytes
    from costmodel.params import dense_layers_by_stage, dense_layers_on_rank, rank_params
    from costmodel.rank_time import rank_times, spans
    from costmodel.stage_costs import stage_costs
    from planner.space import Choice, build_plan
    from planner.specs import build_specs
    model, train, cluster = build_specs("deepseek-v3", "128x8xH100", framework="megatron", seq_len=4096,
                                        global_batch=8192)
    traits = cluster.framework
    first = build_plan(model, train, cluster, Choice(tp=2, pp=8, vpp=4, ep=64, zero_stage=1,
                                                       recompute=Recompute.FULL))
    def split(layers: tuple[int, ...]):   # every layer recomputed, as `first`
        plan = dataclasses.replace(first, layers_per_stage=layers)
        return dataclasses.replace(plan, recompute_num_layers=tuple(plan.layers_on_rank(r) for r in range(plan.pp)))
    spread = split(V3_LAYOUT)
    assert not check_structure(model, train, cluster, spread)
    assert dense_layers_by_stage(model, spread)[:3] == (1, 2, 0)
    assert [dense_layers_on_rank(model, spread, r) for r in range(8)] == [1, 2, 0, 0, 0, 0, 0, 0]
    assert [dense_layers_on_rank(model, first, r) for r in range(8)] == [3, 0, 0, 0, 0, 0, 0, 0]
    total = lambda plan: sum(rank_params(model, plan, r, traits).total for r in range(plan.pp))  # noqa: E731
    assert total(spread) == total(first)
    sp = spans(spread, cluster)
    moved = split((3,) + (2,) * 29 + (1, 0))   # rank 1's first stage: 2 expert layers
    dense_less_expert = (layer_params(dense_layer_model(model), 2)
                         - layer_params(model, 2, 64, 1, traits.shared_expert_tp))   # a layer on a TP 2, EP 64 rank
    assert rank_params(model, spread, 1, traits).total - rank_params(model, moved, 1, traits).total \
        == 2 * dense_less_expert
    assert rank_times(model, train, spread, cluster, sp, 1).total_s != rank_times(model, train, moved, cluster, sp, 1).total_s
    kept = lambda plan: dataclasses.replace(plan, recompute=Recompute.NONE, recompute_num_layers=(0,) * 8)  # noqa: E731
    assert activation_bytes(model, train, kept(spread), 1, spread.layers_on_rank(1), 0, traits) \
        != activation_bytes(model, train, kept(moved), 1, moved.layers_on_rank(1), 0, traits)
    assert all(c.forward_s > 0 and c.backward_s > 0 for c in stage_costs(model, train, spread, cluster)[:-1])
    # the published layout lightens the first rank (one layer beside the embedding) and the last
    # (the MTP module and the loss alone), which the split that keeps the dense layers first cannot
    assert estimate(model, train, cluster, spread).step_time_s < estimate(model, train, cluster, first).step_time_s


def test_latent_down_projections_are_summed_over_tp_under_sequence_parallelism():
    """Whole on every TP rank and trained on its sequence shard, MLA's down-projections and their
    norms (15.1M a V3 layer) are all-reduced over TP once a step, as the norms are."""
    from costmodel.params import mla_down_params
    from costmodel.rank_time import spans, tp_replica_sync_s
    from planner.space import Choice, build_plan
    from planner.specs import build_specs
    model, train, cluster = build_specs("deepseek-v3", "256x8xH100")
    assert mla_down_params(model) == 7168 * (1536 + 512 + 64) + 1536 + 512
    plan = build_plan(model, train, cluster, Choice(tp=2, pp=16, ep=8, zero_stage=1, sequence_parallel=True))
    whole_seq = dataclasses.replace(plan, sequence_parallel=False)
    with_sp = tp_replica_sync_s(model, train, plan, cluster, spans(plan, cluster), 4)
    without = tp_replica_sync_s(model, train, whole_seq, cluster, spans(whole_seq, cluster), 4)
    assert with_sp > without > 0   # the mixture's router is summed either way


def test_latent_attention_under_sequence_parallelism_gathers_its_latents_not_the_hidden_states():
    """V3's attention block under TP+SP: its up-projections' inputs (1536 + 512 + 64 features a
    token) are all-gathered, its output (7168) reduce-scattered; the latents are kept gathered, so
    backward gathers nothing again (a MoE layer has no other dense block)."""
    from costmodel.comm import Collective, collective_time_s
    from costmodel.rank_time import spans
    from costmodel.rank_time.layer_comm import _sp_regather_s, _tp_layer_comm_s
    from planner.space import Choice, build_plan
    from planner.specs import build_specs
    model, train, cluster = build_specs("deepseek-v3", "256x8xH100")
    plan = build_plan(model, train, cluster, Choice(tp=4, pp=16, ep=32, zero_stage=1))
    span = spans(plan, cluster).tp
    token_bytes = train.compute_dtype.num_bytes * plan.micro_batch_size * train.seq_len
    assert _tp_layer_comm_s(model, train, plan, cluster, span) == pytest.approx(
        collective_time_s(Collective.ALL_GATHER, token_bytes * (1536 + 512 + 64), span, cluster)
        + collective_time_s(Collective.REDUCE_SCATTER, token_bytes * 7168, span, cluster))
    assert _sp_regather_s(model, train, plan, cluster, span) == 0.0
    lite = resolve_model("deepseek-v2-lite")   # no query latent: the input is gathered again for wq
    assert _sp_regather_s(lite, train, plan, cluster, span) > 0


def test_padded_values_price_the_attention_core_at_the_query_key_head_size():
    """Our runtime pads V3's 128-wide values to the 192 of queries and keys for torch's flash
    kernel (runtime.latent_attention): its attention core costs (192 + 192) / (192 + 128) of the
    vendor kernel's, which takes the two sizes as they are."""
    from costmodel.kernels import layer_kernel_times
    from planner.space import Choice, build_plan
    from planner.specs import build_specs
    model, train, cluster = build_specs("deepseek-v3", "256x8xH100")
    plan = build_plan(model, train, cluster, Choice(pp=16, ep=64))
    dev = cluster.device
    apart, padded = (layer_kernel_times(model, train, plan, dev, False, False, False, False, False, False, pad)
                     for pad in (False, True))
    assert padded.attention_forward_s / apart.attention_forward_s == pytest.approx(384 / 320, rel=0.01)


def test_multi_token_prediction_under_cp_is_refused_where_the_labels_do_not_cross_chunks():
    """runtime.mtp shifts labels inside a rank's chunk only; Megatron-Core's roll_tensor exchanges
    the CP chunks' boundaries (trait mtp_with_cp), so only the runtime refuses cp > 1 with MTP."""
    from costmodel.check import check_structure
    from costmodel.frameworks import FRAMEWORKS
    from costmodel.hardware import parse_cluster, run_by
    from costmodel.registry import resolve_model
    from costmodel.specs import TrainSpec
    from planner.space import Choice, build_plan
    model, train = resolve_model("debug-mla"), TrainSpec(seq_len=64, global_batch_size=8)
    for framework, refused in (("planner", True), ("megatron-core", False)):
        cluster = run_by(parse_cluster("1x4xH100"), FRAMEWORKS[framework])
        plan = build_plan(model, train, cluster, Choice(cp=2, dp=2))
        found = [p for p in check_structure(model, train, cluster, plan) if "multi-token prediction" in p]
        assert bool(found) is refused, (framework, found)
    # the search lists no such choice (it would only be refused later), and says why once per cp
    from planner.candidates import placement_groups
    from planner.search_options import SearchOptions
    for framework, refused in (("planner", True), ("megatron-core", False)):
        cluster = run_by(parse_cluster("1x4xH100"), FRAMEWORKS[framework])
        reasons: list[str] = []
        cps = {g.base.cp for g in placement_groups(model, train, cluster, SearchOptions(), reasons.append)}
        assert (cps == {1}) is refused and (max(cps) > 1) is not refused, (framework, cps)
        assert bool([r for r in reasons if "multi-token prediction" in r]) is refused


def test_the_search_s_memory_shapes_price_the_dense_layers_where_its_splits_keep_them():
    """The search's affine memory shapes price the dense first layers on the first stage's rank,
    where its splits keep them (and where their parameters are priced), whatever split the probe
    plan they are read from has: a probe that spreads them (an even split of 61 layers over 32
    stages) gives the same shapes as one that keeps them first."""
    from costmodel.memory import stage_memory_shapes
    from costmodel.plan import even_layers
    from planner.space import Choice, build_plan
    from planner.specs import build_specs
    model, train, cluster = build_specs("deepseek-v3", "128x8xH100", framework="megatron", seq_len=4096,
                                        global_batch=8192)
    first = build_plan(model, train, cluster, Choice(tp=2, pp=8, vpp=4, ep=64, zero_stage=1))
    spread = dataclasses.replace(first, layers_per_stage=even_layers(61, 32))
    assert first.layers_per_stage[0] == 3 and spread.layers_per_stage[0] == 1
    shapes = [stage_memory_shapes(model, train, plan, 0.0, cluster.framework) for plan in (first, spread)]
    assert shapes[0] == shapes[1]
