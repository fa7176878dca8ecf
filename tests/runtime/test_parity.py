"""Every parallelism the runtime executes equals a single process: same seed, same global batch,
fp32, SGD; losses of every step and all parameters after the steps within 1e-5 relative.
Ranks are forked from this process (gloo on CPU), 2-8 of them."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace as dc_replace

import pytest
import torch
from parity import assert_parity, distributed, plan_file, reference

from costmodel.check import check_structure
from costmodel.groups import replica_samples
from costmodel.hardware import DeviceGroup, mixed_cluster
from costmodel.plan import Recompute
from costmodel.schedules import Schedule
from costmodel.specs import AttentionKernel, DType, FfnKind, Optimizer, PositionKind, RouterScoring
from planner.space import Choice
from runtime.fork import run_forked

GPT = dict(model="debug-tiny-gpt", dropout=False)
MOE = dict(model="debug-moe")
# DeepSeek's mechanisms but the MTP module: latent attention, a dense first layer, grouped sigmoid
# routing with its balancing bias (updated after every step), routed scaling, a shared expert
MLA = dict(model="debug-mla", mtp_depth=0)
# all of DeepSeek-V3's mechanisms: the above and a multi-token-prediction module
MTP = dict(model="debug-mla")
# latent attention in a dense model, the query not compressed (TP without sequence parallelism)
MLA_DENSE = dict(MLA, q_lora_rank=0, num_experts=0, experts_per_token=0, moe_ffn_hidden_size=0,
                 shared_expert_ffn_hidden_size=0, first_k_dense=0, router_scoring=RouterScoring.SOFTMAX,
                 num_expert_groups=1, topk_groups=1, routed_scaling_factor=1.0)
# GPT-NeoX's mechanisms: parallel residual, RoPE on a quarter of each head, exact GeLU, untied
NEOX = dict(GPT, position_kind=PositionKind.ROPE, parallel_residual=True, rotary_fraction=0.25,
            ffn_kind=FfnKind.GELU_ERF, tied_embeddings=False)
# Falcon's: one norm for both parallel branches, no biases, grouped KV, tied embeddings
FALCON = dict(GPT, position_kind=PositionKind.ROPE, parallel_residual=True, shared_norm=True, bias=False,
              num_kv_heads=2, ffn_kind=FfnKind.GELU_ERF)

CASES = {
    # data parallel, each ZeRO stage; mbs 2 of a 4-sample replica batch -> 2 micro-batches accumulated
    "ddp": (Choice(zero_stage=0, micro_batch_size=2), 2, {}),
    "zero1": (Choice(zero_stage=1, micro_batch_size=2), 2, {}),
    "zero2": (Choice(zero_stage=2, micro_batch_size=2), 2, {}),
    "zero3": (Choice(zero_stage=3, micro_batch_size=2), 2, {}),
    # hybrid sharding: two replicas of 2-rank shard groups (FSDP2 over a 2-D mesh)
    "hsdp2x2_zero1": (Choice(zero_stage=1, dp_replicate=2), 4, {}),
    "hsdp2x2_zero3": (Choice(zero_stage=3, dp_replicate=2), 4, {}),
    # tensor parallel, with and without sequence parallelism; DDP (ZeRO-0) x TP
    "tp": (Choice(tp=2, sequence_parallel=False), 2, {}),
    "tp_sp": (Choice(tp=2), 2, {}),
    "dp2_tp2_zero0": (Choice(tp=2, zero_stage=0), 4, {}),
    # every pipeline schedule
    "pp_gpipe": (Choice(pp=2, schedule=Schedule.GPIPE), 2, {}),
    "pp_1f1b": (Choice(pp=2), 2, {}),
    "pp_interleaved": (Choice(pp=2, vpp=2), 2, {}),
    "pp_zb_h1": (Choice(pp=2, schedule=Schedule.ZB_H1), 2, {}),
    "pp_zbv": (Choice(pp=2, vpp=2, schedule=Schedule.ZBV), 2, {}),
    "pp_dualpipev": (Choice(pp=2, vpp=2, schedule=Schedule.DUALPIPEV), 2, {}),
    # recomputation, full (some layers) and selective (under TP, where it is used)
    "recompute_full": (Choice(zero_stage=3, recompute=Recompute.FULL, recompute_layers=2), 2, {}),
    "recompute_selective": (Choice(tp=2, recompute=Recompute.SELECTIVE), 2, {}),
    "pp_recompute_full": (Choice(pp=2, recompute=Recompute.FULL), 2, {}),
    # the 3-D combination, 8 ranks
    "pp2_dp2_tp2": (Choice(pp=2, tp=2, zero_stage=1, micro_batch_size=2), 8, {}),
    # GPT paths: fused QKV, learned positions under SP, tied embeddings (shared, split, same rank)
    "gpt_ddp_tied": (Choice(zero_stage=0), 2, GPT),
    "gpt_tp_sp": (Choice(tp=2), 2, GPT),
    "gpt_pp_tied_split": (Choice(pp=2), 2, GPT),
    "gpt_zbv_tied_same_rank": (Choice(pp=2, vpp=2, schedule=Schedule.ZBV), 2, GPT),
    "neox_tp_sp": (Choice(tp=2), 2, NEOX),
    "head_dim_apart_tp_sp": (Choice(tp=2), 2, {"explicit_head_dim": 32}),   # debug-tiny: 4 heads of 32 over 64
    "neox_cp2_pp2": (Choice(cp=2, pp=2), 4, NEOX),
    "falcon_tp_sp": (Choice(tp=2), 2, FALCON),
    # Qwen3's per-head Q/K norms: whole on each TP rank, trained on its heads, summed over TP
    "qk_norm_tp_sp_zero1": (Choice(tp=2, zero_stage=1), 2, {"qk_norm": True}),
    "qk_norm_tp2_dp2_zero3": (Choice(tp=2, zero_stage=3), 4, {"qk_norm": True}),
    "falcon_pp2_zero3": (Choice(pp=2, zero_stage=3), 2, FALCON),
    "eager_attention_tp": (Choice(tp=2), 2, {"attention_kernel": AttentionKernel.EAGER}),
    # context parallelism (runtime.context_parallel): load-balanced chunks, K/V all-gathered
    "cp2": (Choice(cp=2), 2, {}),
    "cp4": (Choice(cp=4), 4, {}),
    "cp2_dp2": (Choice(cp=2, zero_stage=1), 4, {}),
    "cp2_tp2_selective": (Choice(cp=2, tp=2, recompute=Recompute.SELECTIVE), 4, {}),
    "cp2_pp2_recompute_full": (Choice(cp=2, pp=2, recompute=Recompute.FULL), 4, {}),
    "cp2_eager_attention": (Choice(cp=2), 2, {"attention_kernel": AttentionKernel.EAGER}),
    "cp2_gpt_learned_positions": (Choice(cp=2), 2, GPT),
    # mixtures of experts (runtime.moe, experts local): routing, the shared expert and its gate,
    # and the load-balancing loss's gradient per micro-batch
    "moe_dp2": (Choice(zero_stage=1, micro_batch_size=2), 2, MOE),
    "moe_zero3_micro_batches": (Choice(zero_stage=3), 2, MOE),
    "moe_pp2": (Choice(pp=2), 2, MOE),
    "moe_zero2_recompute_full": (Choice(zero_stage=2, recompute=Recompute.FULL), 2, MOE),
    # expert parallelism: experts sharded over EP ranks, tokens exchanged by all-to-all, expert
    # gradients reduced over the edp ranks holding the same ones (runtime.parallel)
    "moe_ep2": (Choice(ep=2, zero_stage=1), 2, MOE),
    "moe_ep4": (Choice(ep=4, zero_stage=2), 4, MOE),
    "moe_ep2_dp2_zero3": (Choice(ep=2, zero_stage=3), 4, MOE),
    "moe_ep2_dp2_ddp_recompute_full": (Choice(ep=2, zero_stage=0, recompute=Recompute.FULL), 4, MOE),
    "moe_ep2_pp2": (Choice(ep=2, pp=2, zero_stage=1), 4, MOE),
    # split backward with experts: their weight passes deferred, the all-to-alls in the input pass;
    # DualPipeV's V over 4 layers (its pairs of one micro-batch's forward and another's backward)
    "moe_pp2_zb_h1": (Choice(pp=2, schedule=Schedule.ZB_H1), 2, MOE),
    "moe_ep2_pp2_zb_h1": (Choice(ep=2, pp=2, zero_stage=1, schedule=Schedule.ZB_H1), 4, MOE),
    "moe_pp2_dualpipev": (Choice(pp=2, vpp=2, schedule=Schedule.DUALPIPEV), 2, {**MOE, "num_layers": 4}),
    # context parallelism: each CP rank routes its chunks' tokens; the load-balancing loss is the
    # micro-batch's (routed counts summed over the CP group)
    "moe_cp2": (Choice(cp=2), 2, MOE),
    "moe_cp2_dp2_zero3": (Choice(cp=2, zero_stage=3), 4, MOE),
    "moe_cp2_pp2": (Choice(cp=2, pp=2), 4, MOE),
    # expert parallelism under CP: folded, the EP group the CP ranks and the experts' ZeRO group
    # dp; carved from dp (DeepSpeed's layout), the ZeRO group edp x cp
    "moe_ep2_cp2": (Choice(ep=2, cp=2, zero_stage=1), 4, MOE),
    "moe_ep2_cp2_carved": (Choice(ep=2, cp=2, zero_stage=1), 4, {**MOE, "framework": "deepspeed"}),
    "moe_ep2_cp2_zero3": (Choice(ep=2, cp=2, zero_stage=3), 4, MOE),
    "moe_ep2_cp2_zero0_cp_outer": (Choice(ep=2, cp=2, zero_stage=0, mesh_axis_order=("pp", "cp", "dp", "tp")), 4, MOE),
    # tensor parallelism: attention split, experts whole on each TP rank routing its sequence
    # shard (expert TP 1), their gradients summed over TP
    "moe_tp2": (Choice(tp=2), 2, MOE),
    "moe_tp2_pp2_recompute_full": (Choice(tp=2, pp=2, recompute=Recompute.FULL), 4, MOE),
    "moe_tp2_cp2_zero3": (Choice(tp=2, cp=2, zero_stage=3), 4, MOE),
    # the tokens' group cp x tp sliced in the world mesh's order, whichever it is
    "moe_tp2_cp2_tp_outer": (Choice(tp=2, cp=2, mesh_axis_order=("pp", "tp", "dp", "cp")), 4, MOE),
    # EP folded over TP x DP as Megatron-Core lays it (costmodel.placement.expert_layout, expert
    # TP 1): the EP group the TP ranks (dp 1, or the experts' ZeRO group dp), then the TP ranks
    # of both replicas; each rank's experts whole, their gradients reduced over the ranks holding
    # them, not summed over TP (carved from dp, DeepSpeed's layout: whole on each TP rank, summed)
    "moe_tp2_ep2": (Choice(tp=2, ep=2, zero_stage=1), 2, MOE),
    "moe_ep2_tp2": (Choice(ep=2, tp=2, zero_stage=1), 4, MOE),
    "moe_tp2_dp2_ep4": (Choice(tp=2, ep=4, zero_stage=1), 4, MOE),
    # EP inside the TP ranks: the mesh's tp axis cut in two, the other TP pair holding the same experts
    "moe_tp4_ep2": (Choice(tp=4, ep=2, zero_stage=1), 4, {**MOE, "num_kv_heads": 4}),
    "moe_ep2_tp2_carved": (Choice(ep=2, tp=2, zero_stage=1), 4, {**MOE, "framework": "deepspeed"}),
    # latent attention under TP: heads split, the down-projections whole on each rank; under SP
    # each trains them on its sequence shard, their gradients summed over TP (runtime.job)
    "mla_tp2": (Choice(tp=2), 2, MLA),
    "mla_dense_tp2_no_sp": (Choice(tp=2, sequence_parallel=False), 2, MLA_DENSE),
    "mla_dense_tp2_sp": (Choice(tp=2), 2, MLA_DENSE),
    # the dense first layer on one pipeline stage, the mixtures on the other
    "mla_pp2": (Choice(pp=2), 2, MLA),
    # the routers' counts summed over the expert-parallel ranks before the bias update
    "mla_ep2": (Choice(ep=2, zero_stage=1), 2, MLA),
    # multi-token prediction (runtime.mtp): its projection column-parallel, its norms on sequence
    # shards; under pp2 the last stage's own copy of the embedding, its gradient summed with the
    # first stage's; a dense MLA model's MTP under TP without SP
    "mtp_tp2_sp": (Choice(tp=2), 2, MTP),
    "mtp_pp2": (Choice(pp=2, micro_batch_size=4), 2, MTP),
    "mtp_dense_tp2_no_sp": (Choice(tp=2, sequence_parallel=False), 2, dict(MLA_DENSE, mtp_depth=1)),
    # V placement: the last stage on the first one's rank, its embedding copy summed there; and
    # DualPipeV's split backward through the MTP loss
    "mtp_zbv_same_rank": (Choice(pp=2, vpp=2, schedule=Schedule.ZBV, micro_batch_size=4), 2, dict(MTP, num_layers=4)),
    "mtp_dualpipev": (Choice(pp=2, vpp=2, schedule=Schedule.DUALPIPEV, micro_batch_size=2), 2, dict(MTP, num_layers=4)),
    # offloaded states (FSDP2's CPUOffloadPolicy): shards on the host, copied in and out around
    # each collective; every ZeRO stage, a lone rank, the TP-replicated and tied-embedding syncs
    "zero1_offload": (Choice(zero_stage=1, micro_batch_size=2, offload_optimizer=True), 2, {}),
    "zero2_offload": (Choice(zero_stage=2, micro_batch_size=2, offload_optimizer=True), 2, {}),
    "zero3_offload": (Choice(zero_stage=3, micro_batch_size=2, offload_optimizer=True), 2, {}),
    "tp2_alone_zero3_offload": (Choice(tp=2, zero_stage=3, offload_optimizer=True), 2, {"qk_norm": True}),
    "gpt_pp2_tied_zero2_offload": (Choice(pp=2, zero_stage=2, offload_optimizer=True), 2, GPT),
    # offloaded activations (runtime.offload): saved tensors through host copies, weights left alone
    "zero3_act_offload": (Choice(zero_stage=3, micro_batch_size=2, offload_activations=True), 2, {}),
    "pp2_act_offload_gpt_tied": (Choice(pp=2, offload_activations=True), 2, GPT),
    "cp2_act_offload": (Choice(cp=2, offload_activations=True), 2, {}),
    # one expert per EP rank, two edp ranks: FSDP2 shards each expert's rows (runtime.parallel)
    "moe_ep2_dp2_one_expert_each": (Choice(ep=2, zero_stage=3), 4, {**MOE, "num_experts": 2}),
}


# TP and CP cases take two micro-batches a step (2 x pp under a pipeline) instead of one
# sequence each: accumulation is still proven, and DTensor's per-op dispatch on a CPU makes each
# micro-batch of a TP case cost almost a step. These keep one sequence per micro-batch, as every
# case without TP or CP does.
ONE_SEQUENCE_MICRO_BATCHES = {"tp", "cp2"}


def _fewer_micro_batches(name: str, pf):
    plan = pf.plan
    wanted = 2 * plan.pp
    if name in ONE_SEQUENCE_MICRO_BATCHES or plan.tp == plan.cp == 1 or plan.num_micro_batches <= wanted:
        return pf
    choice, world, kwargs = CASES[name]
    mbs = plan.micro_batch_size * plan.num_micro_batches // wanted
    return plan_file(dc_replace(choice, micro_batch_size=mbs), world=world, **kwargs)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_process(name):
    choice, world, kwargs = CASES[name]
    pf = _fewer_micro_batches(name, plan_file(choice, world=world, **kwargs))
    assert pf.plan.num_micro_batches >= 2   # gradients accumulate in every case
    assert_parity(pf)


@pytest.mark.parametrize("choice", [Choice(tp=2, sequence_parallel=False), Choice(pp=2), Choice(zero_stage=0),
                                    Choice(zero_stage=3, offload_optimizer=True)],
                         ids=["tp", "pp", "ddp", "zero3_offload_fused_cpu_adamw"])
def test_adamw_trains_alike(choice):
    """AdamW (the default optimizer): same losses; Adam's normalisation amplifies fp32 reduction
    noise in near-zero gradients, so parameters are not compared this tightly."""
    pf = plan_file(choice, world=2, optimizer=Optimizer.ADAMW)
    ref_losses, _ = reference(pf, lr=1e-2)
    got = distributed(pf, lr=1e-2)["losses"]
    assert got == pytest.approx(ref_losses, rel=1e-5)


def test_bf16_mixed_precision_stays_close():
    """bf16 compute with fp32 master weights and fp32 reduction: loss within bf16 noise."""
    pf = plan_file(Choice(zero_stage=3, micro_batch_size=2), world=2, compute_dtype=DType.BF16)
    ref_losses, _ = reference(pf)
    got = distributed(pf)["losses"]
    assert max(abs(a - b) for a, b in zip(got, ref_losses)) < 2e-3


@pytest.mark.parametrize("choice", [Choice(zero_stage=3, micro_batch_size=2, fp8_linears=True),
                                    Choice(pp=2, zero_stage=1, fp8_linears=True)], ids=["zero3", "pp2"])
def test_float8_linears_train_as_one_process_does(choice):
    """fp8_linears: torchao's Float8Linear (tensorwise) in the layers, bf16 beside them, sharded or
    pipelined; the single process runs the same conversion. Losses within bf16 noise of it (torch's
    CPU _scaled_mm: the numbers, not the speed, of float8 training)."""
    pytest.importorskip("torchao", reason="torchao (test extra) is not installed")
    pf = plan_file(choice, world=2, compute_dtype=DType.BF16)
    with _emulated_float8_gemms():   # the forked ranks inherit it
        ref_losses, _ = reference(pf)
        got = distributed(pf)["losses"]
    assert max(abs(a - b) for a, b in zip(got, ref_losses)) < 2e-3, (got, ref_losses)


@contextmanager
def _emulated_float8_gemms():
    """torch's CPU _scaled_mm as it runs on a CPU without AMX (the float8 operands scaled up to
    fp32, one fp32 GEMM, the result cast to bf16), for the single process and the ranks alike.
    On a CPU with AMX-INT8 torch hands it to oneDNN's float8 GEMM instead, ~250x slower on these
    shapes (each case above took ~30 s on 2 cores, nearly all of it in _scaled_mm). oneDNN is
    off for the bf16 ops beside them too, on both sides: the same torchao linears, float8 casts
    and scales either way."""
    enabled = torch.backends.mkldnn.set_flags(False, _fp32_precision=None)[0]
    try:
        yield
    finally:
        torch.backends.mkldnn.set_flags(enabled, _fp32_precision=None)


def test_float8_conversion_reaches_every_layer_linear():
    pytest.importorskip("torchao", reason="torchao (test extra) is not installed")
    from runtime.float8 import apply_float8
    from runtime.model import Transformer
    pf = plan_file(Choice(), world=1)
    model = Transformer(pf.model, pf.train.attention_kernel)
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.layers.modules())
    assert apply_float8(model) == linears == 7 * pf.model.num_layers   # q, k, v, o, gate, up, down
    assert isinstance(model.output, torch.nn.Linear) and type(model.output).__name__ == "Linear"   # the head stays


def test_the_runtime_builds_float8_linears_for_a_float8_plan():
    """What build_job makes of an fp8 plan (each pipeline stage's share, under FSDP2): every layer
    linear torchao's, none where the plan says bf16. (The losses above cannot tell float8 from
    bf16 on a model this small: both are within 2e-3 of each other.)"""
    pytest.importorskip("torchao", reason="torchao (test extra) is not installed")
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.job import build_job
    for fp8 in (True, False):
        pf = plan_file(Choice(pp=2, zero_stage=3, fp8_linears=fp8), world=2, compute_dtype=DType.BF16)
        counts = []
        for rank in range(2):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
            try:
                job = build_job(pf, torch.device("cpu"), seed=0, materialize=False)
                counts.append(sum(type(m).__name__ == "Float8Linear" for mod in job.modules.values()
                                  for m in mod.modules()))
            finally:
                dist.destroy_process_group()
        assert counts == ([7 * pf.model.num_layers // 2] * 2 if fp8 else [0, 0])


def test_tensor_parallel_after_checkpoint_wrapping_is_an_error():
    """The trap torch only warns about: a wrapper hides the plan keys and TP silently does not
    apply. The runtime applies TP first; done the other way round, it raises."""
    run_forked(2, _tp_after_wrapping)


def _tp_after_wrapping():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh

    from runtime.model import Transformer
    from runtime.parallel import apply_tensor_parallel
    model = Transformer(plan_file(Choice(tp=2), world=2).model)
    model.layers["0"] = checkpoint_wrapper(model.layers["0"])
    with pytest.raises(UserWarning, match="Parallelize plan key"):
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), sp=True)


def test_experts_under_tensor_parallelism_without_sequence_parallelism_are_refused():
    """Every TP rank would train the experts on the same tokens (runtime.job), even for a plan
    that skipped check_plan."""
    from runtime.fork import RankFailed
    with pytest.raises(RankFailed, match="needs sequence parallelism"):
        distributed(plan_file(Choice(tp=2, sequence_parallel=False), world=2, **MOE), steps=1)



def test_offloaded_activations_leave_the_device_and_weights_stay(monkeypatch):
    """runtime.offload's hooks: a saved activation becomes a host copy (new storage), a weight is
    saved as it is; every layer runs under them; the gradients equal a run without them."""
    from runtime import offload
    from runtime.model import Transformer
    pack, unpack = offload._pack(False), offload._unpack(False)
    weight, activation = torch.nn.Parameter(torch.randn(4, 4)), torch.randn(4, 4)
    assert pack(weight) is weight and unpack(weight) is weight
    device, host = pack(activation)
    assert host.data_ptr() != activation.data_ptr() and torch.equal(unpack((device, host)), activation)

    kinds = []   # (saved a parameter, kept it as it is) for every tensor the layers save

    def counting(pin):
        inner = pack_of(pin)

        def spy(t):
            out = inner(t)
            kinds.append((isinstance(t, torch.nn.Parameter), out is t))
            return out
        return spy
    pack_of = offload._pack
    monkeypatch.setattr(offload, "_pack", counting)
    pf = plan_file(Choice(), world=1)
    plain, moved = (Transformer(pf.model, pf.train.attention_kernel) for _ in range(2))
    for model in (plain, moved):
        model.init_weights(7)
    offload.apply_activation_offload(moved, pin=False)
    x = torch.randint(0, pf.model.vocab_size, (2, pf.train.seq_len))
    for model in (plain, moved):
        model(x).float().mean().backward()
    assert kinds and all(is_param == kept for is_param, kept in kinds)
    assert sum(not is_param for is_param, _ in kinds) >= pf.model.num_layers   # each layer's activations
    for (name, a), b in zip(plain.named_parameters(), moved.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("choice,world,sizes", [
    (Choice(zero_stage=1), 2, (1, 3)),
    (Choice(zero_stage=3), 2, (3, 1)),
    (Choice(tp=2, zero_stage=2), 4, (1, 3)),
], ids=["zero1", "zero3", "tp2_zero2"])
def test_uneven_batch_shares_train_as_one_process(choice, world, sizes):
    """Replicas on device groups with their own micro-batch sizes (costmodel.groups): each takes
    its share of the global batch and weights its loss by it, so the gradient average is the
    whole batch's (two micro-batches each: under ZeRO-3 every one gathers weights)."""
    pf = plan_file(choice, world=world)
    group = DeviceGroup(device=pf.cluster.device, num_nodes=1)
    cluster = mixed_cluster([group, group], world // 2)
    plan = dc_replace(pf.plan, micro_batch_size=max(sizes), micro_batch_sizes=sizes, num_micro_batches=2)
    pf = dc_replace(pf, plan=plan, cluster=cluster)
    assert not check_structure(pf.model, pf.train, cluster, plan)
    assert replica_samples(plan, cluster) == [2 * s for s in sizes]
    assert_parity(pf)
