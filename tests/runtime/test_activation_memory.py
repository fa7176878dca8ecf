"""What the runtime keeps for backward, tensor by tensor, equals what the cost model counts.

Each rank runs one forward of its stage under `saved_tensors_hooks` and sums the distinct storages
autograd saves (parameters excluded), per layer and for the loss. Compared with
`layer_activation_bytes` and `logits_held_bytes` under the cluster's traits (our runtime on CPU):
SP keeps the projections' inputs as sequence shards (runtime.sequence_parallel, as Megatron-LM),
the loss runs over the whole vocabulary on every TP rank, and CPU RMSNorm keeps its normalised
input. The extras the model leaves out are small
(RoPE tables, 1/rms and log-sum-exp rows): 3 % at most here.
"""
from __future__ import annotations

import dataclasses
import statistics

import pytest
import torch
from parity import plan_file

from costmodel.deepseek import dense_layer_model
from costmodel.memory import layer_activation_bytes, logits_held_bytes
from costmodel.plan import Recompute
from costmodel.registry import resolve_model
from costmodel.specs import DType, FfnKind, PositionKind, RouterScoring
from planner.space import Choice
from runtime.fork import run_forked
from runtime.job import build_job, cross_entropy
from runtime.parallel import local_tensor

LLAMA = dict(model="debug-small")
# DeepSeek's mechanisms but the MTP module: latent attention, a dense first layer, sigmoid routing
MLA = dict(model="debug-mla", mtp_depth=0)
MLA_DENSE = dict(MLA, num_experts=0, experts_per_token=0, moe_ffn_hidden_size=0, shared_expert_ffn_hidden_size=0,
                 first_k_dense=0, router_scoring=RouterScoring.SOFTMAX, num_expert_groups=1, topk_groups=1,
                 routed_scaling_factor=1.0)
GPT = dict(model="debug-tiny-gpt", dropout=True)
# GPT-NeoX's mechanisms: the norms read the same layer input (parallel residual), RoPE on a quarter
NEOX = dict(model="debug-tiny-gpt", dropout=False, position_kind=PositionKind.ROPE, parallel_residual=True,
            rotary_fraction=0.25, ffn_kind=FfnKind.GELU_ERF, tied_embeddings=False)
FALCON = dict(model="debug-tiny-gpt", dropout=False, position_kind=PositionKind.ROPE, parallel_residual=True,
              shared_norm=True, bias=False, num_kv_heads=2, ffn_kind=FfnKind.GELU_ERF)


def _plain(t: torch.Tensor) -> torch.Tensor:
    while type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        t = t._local_tensor if hasattr(t, "_local_tensor") else t.elem
    return t


def _storage_key(t: torch.Tensor):
    st = _plain(t).untyped_storage()
    try:
        return st.data_ptr(), st.nbytes()
    except RuntimeError:   # a storage FSDP2 has freed (resized to zero)
        return None, 0


def _saved_bytes(pf) -> dict[str, int]:
    """{layer index, 'head' or 'loss': bytes autograd saved there} for this rank's stage."""
    job = build_job(pf, torch.device("cpu"), seed=0)
    module = job.modules[0]
    where, seen = ["embed"], {}

    def pack(t):
        key, _ = _storage_key(t)
        if key is not None:
            seen.setdefault(key, (where[0], _plain(t).untyped_storage()))
        return t

    for name, layer in module.layers.items():
        layer.register_forward_pre_hook(lambda m, a, n=name: where.__setitem__(0, n))
    if module.norm is not None:
        module.norm.register_forward_pre_hook(lambda m, a: where.__setitem__(0, "head"))
    b, s = pf.plan.micro_batch_size, pf.train.seq_len
    x = job.local_tokens(torch.randint(0, pf.model.vocab_size, (b, s), generator=torch.Generator().manual_seed(0)))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
        where[0] = "loss"
        cross_entropy(local_tensor(out), x)
    # weights are not activations: FSDP2's gathered copies are the module's parameters now, or
    # (ZeRO-3) freed after the forward, their storages resized to zero until backward gathers again
    weights = {_storage_key(local_tensor(p))[0] for p in module.parameters()}
    totals: dict[str, int] = {}
    for key, (place, storage) in seen.items():
        if key not in weights:
            totals[place] = totals.get(place, 0) + storage.nbytes()
    return totals


MBS = 4   # RoPE's tables (per layer, not per sample) stay under 1 % of a layer
CASES = {
    "single": (Choice(micro_batch_size=MBS), 1, LLAMA),
    "single_bf16": (Choice(micro_batch_size=MBS), 1, dict(LLAMA, compute_dtype=DType.BF16)),
    "tp2": (Choice(tp=2, sequence_parallel=False, micro_batch_size=MBS), 2, LLAMA),
    "tp2_sp": (Choice(tp=2, micro_batch_size=MBS), 2, LLAMA),
    "tp2_sp_selective": (Choice(tp=2, recompute=Recompute.SELECTIVE, micro_batch_size=MBS), 2, LLAMA),
    "gpt_tp2_sp_dropout": (Choice(tp=2, micro_batch_size=MBS), 2, GPT),
    # context parallelism keeps the gathered K/V (and, on CPU, each chunk's causal mask)
    "cp2": (Choice(cp=2, micro_batch_size=MBS), 2, LLAMA),
    "cp4": (Choice(cp=4, micro_batch_size=MBS), 4, LLAMA),
    "cp2_tp2_sp": (Choice(cp=2, tp=2, micro_batch_size=MBS), 4, LLAMA),
    # a mixture of experts (runtime.moe): routed rows, the shared expert and its gate
    "moe": (Choice(micro_batch_size=MBS), 1, dict(model="debug-moe")),
    "moe_dp2": (Choice(zero_stage=1, micro_batch_size=MBS), 2, dict(model="debug-moe")),
    "moe_ep2": (Choice(ep=2, zero_stage=1, micro_batch_size=MBS), 2, dict(model="debug-moe")),
    "moe_cp2": (Choice(cp=2, micro_batch_size=MBS), 2, dict(model="debug-moe")),
    # under TP+SP the mixture is whole on each TP rank and routes that rank's sequence shard
    "moe_tp2_sp": (Choice(tp=2, micro_batch_size=MBS), 2, dict(model="debug-moe")),
    "moe_ep2_cp2": (Choice(ep=2, cp=2, zero_stage=1, micro_batch_size=MBS), 4, dict(model="debug-moe")),
    "moe_ep2_tp2_sp": (Choice(ep=2, tp=2, zero_stage=1, micro_batch_size=MBS), 4, dict(model="debug-moe")),
    # EP folded over the TP ranks (dp 1): each TP rank routes its sequence shard to the other's experts
    "moe_tp2_ep2_sp_folded": (Choice(ep=2, tp=2, zero_stage=1, micro_batch_size=MBS), 2, dict(model="debug-moe")),
    # heads sized apart from the model's width (queries twice as wide as the model)
    "head_dim": (Choice(micro_batch_size=MBS), 1, dict(LLAMA, explicit_head_dim=64)),
    "head_dim_tp2_sp": (Choice(tp=2, micro_batch_size=MBS), 2, dict(LLAMA, explicit_head_dim=64)),
    # Qwen3's per-head Q/K norms (and heads sized apart)
    "qwen3": (Choice(micro_batch_size=MBS), 1, dict(LLAMA, qk_norm=True, explicit_head_dim=64)),
    "qwen3_tp2_sp": (Choice(tp=2, micro_batch_size=MBS), 2, dict(LLAMA, qk_norm=True, explicit_head_dim=64)),
    "neox": (Choice(micro_batch_size=MBS), 1, NEOX),
    # Falcon's: one norm feeding both parallel branches (their inputs one tensor, but under SP
    # each block gathers its own), no biases, grouped KV
    "falcon": (Choice(micro_batch_size=MBS), 1, FALCON),
    "falcon_tp2": (Choice(tp=2, sequence_parallel=False, micro_batch_size=MBS), 2, FALCON),
    "falcon_tp2_sp": (Choice(tp=2, micro_batch_size=MBS), 2, FALCON),
    "neox_tp2_sp": (Choice(tp=2, micro_batch_size=MBS), 2, NEOX),
    # latent attention (runtime.latent_attention): the latents, V padded to the Q/K head size for
    # the flash kernel; under TP+SP the down-projections on the shard, the latents gathered; the
    # query uncompressed under TP without SP (the dense first layer priced as dense_layer_model's)
    "mla": (Choice(micro_batch_size=MBS), 1, MLA),
    "mla_tp2_sp": (Choice(tp=2, micro_batch_size=MBS), 2, MLA),
    "mla_q_whole_tp2": (Choice(tp=2, sequence_parallel=False, micro_batch_size=MBS), 2, dict(MLA_DENSE, q_lora_rank=0)),
    # Gemma's mechanisms: GeGLU, the (1 + w) norm in fp32, scaled embeddings
    "gemma_style": (Choice(micro_batch_size=MBS), 1, dict(model="debug-small", ffn_kind=FfnKind.GEGLU,
                                                           scale_embeddings=True, norm_unit_offset=True)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_saved_activations_match_the_model(name):
    choice, world, model = CASES[name]
    seq_len = min(256, resolve_model(model["model"]).max_position_embeddings)
    pf = plan_file(choice, world=world, seq_len=seq_len,
                   global_batch=MBS * world // (choice.tp * choice.cp), **model)
    ranks = run_forked(world, _saved_bytes, pf)
    # the rank that keeps the most (CP ranks differ by their masks), as the model prices a stage;
    # under expert parallelism the ranks' mean, which is the model at balance (it is affine in
    # the rows a rank's experts take, and their mean over the EP group is the balanced share)
    pick = max if pf.plan.ep == 1 else statistics.fmean
    measured = {place: pick(r[place] for r in ranks) for place in ranks[0]}
    if pf.plan.ep > 1:
        pf = dataclasses.replace(pf, train=dataclasses.replace(pf.train, expert_load_imbalance=1.0))
    traits = pf.cluster.framework
    for layer in range(pf.model.num_layers):
        built = dense_layer_model(pf.model) if layer < pf.model.first_k_dense else pf.model
        per_layer = layer_activation_bytes(built, pf.train, pf.plan, pf.plan.recompute, traits)
        assert measured[str(layer)] == pytest.approx(per_layer, rel=0.03), f"layer {layer}"
    assert measured["loss"] == pytest.approx(logits_held_bytes(pf.model, pf.train, pf.plan, traits), rel=0.03)


def korthikanti_layer_bytes(*, s: int, b: int, h: int, kv: int, f: int, heads: int, t: int, a: int,
                            gated: bool, flash: bool, dropout_mask_bytes: int, selective: bool) -> float:
    """Korthikanti et al. 2022 (arXiv 2205.05198) Sec. 4.1's count of one layer's saved
    activations, term by term, for the mechanisms given; with t-way TP + SP every term is /t (the
    inputs of the QKV and first MLP projections kept as the sequence shard, Sec. 4.2.2).
    Attention: the QKV projection's input a·sbh; Q (a·sbh) and K and V (a·sb·kv each: GQA's K and
    V have kv = kv_heads·head_dim features; kv = h for multi-head attention); the output
    projection's input a·sbh and its dropout mask. The core: eager, the softmax output a·as²b, its
    dropout mask and the dropped probabilities (5as²b at a = 2 and 1-byte masks); flash keeps
    no s x s tensor, only its output (the output projection's input, counted) and its fp32
    log-sum-exp, 4·b·heads·s; selective recomputation keeps none of the core.
    MLP: its input a·sbh, then GeLU (f = 4h): the first projection's output (GeLU's input) and
    GeLU's output (the second projection's input), a·sbf each, and the dropout mask; SwiGLU (three
    f-wide matrices: gate, up, down): the gate and up projections' outputs, silu(gate) and the
    product (the down projection's input), a·sbf each.
    Norms: both inputs, a·sbh each."""
    mask = dropout_mask_bytes * s * b * h
    attention = a * s * b * (3 * h + 2 * kv) + mask
    if selective:
        core = 0.0
    elif flash:
        core = 4.0 * b * heads * s
    else:
        core = (2 * a + dropout_mask_bytes) * heads * s * s * b
    mlp = a * s * b * h + (4 if gated else 2) * a * s * b * f + mask
    return (attention + core + mlp + 2 * a * s * b * h) / t


def test_the_count_is_korthikantis_for_a_gpt_layer():
    """GPT's mechanisms (LayerNorm, multi-head attention, GeLU with f = 4h, 16-bit activations,
    1-byte dropout masks, eager attention): sbh(34 + 5as/h), sbh·34 with selective recomputation."""
    s, b, h, heads = 2048, 1, 12288, 96
    gpt = dict(s=s, b=b, h=h, kv=h, f=4 * h, heads=heads, t=1, a=2, gated=False, flash=False, dropout_mask_bytes=1)
    assert korthikanti_layer_bytes(**gpt, selective=False) == s * b * h * (34 + 5 * heads * s / h)
    assert korthikanti_layer_bytes(**gpt, selective=True) == s * b * h * 34


@pytest.mark.parametrize("recompute", [Recompute.NONE, Recompute.SELECTIVE])
def test_a_llama_layer_under_tp_sp_keeps_what_megatron_counts(recompute):
    """A Llama-style layer (GQA: 8 query and 4 KV heads; SwiGLU; RoPE; RMSNorm; no dropout; flash
    attention; fp32) under TP2 + SP keeps, per layer, Korthikanti et al.'s count for those
    mechanisms within 10 %, and the cost model's within 3 %. The count is Megatron's plus the one
    term of torch's CPU kernels: composite RMSNorm keeps its normalised input in fp32 besides its
    input, 4·sbh/t per norm (CUDA's fused kernel keeps 1/rms instead; costmodel.frameworks
    `cpu_kernels`); without it the layer keeps 12 % more than the count here. RoPE's cos/sin tables
    (per layer, not per sample) are the rest: 1 % at micro-batch 4."""
    pf = plan_file(Choice(tp=2, recompute=recompute, micro_batch_size=MBS), world=2, seq_len=256,
                   global_batch=MBS, **LLAMA)
    m, t, s, b = pf.model, pf.plan.tp, pf.train.seq_len, MBS
    assert m.num_kv_heads < m.num_heads and m.ffn_kind is FfnKind.SWIGLU and m.position_kind is PositionKind.ROPE
    a = pf.train.compute_dtype.num_bytes
    megatron = korthikanti_layer_bytes(s=s, b=b, h=m.hidden_size, kv=m.kv_hidden_size, f=m.ffn_hidden_size,
                                       heads=m.num_heads, t=t, a=a, gated=True, flash=True, dropout_mask_bytes=0,
                                       selective=recompute is Recompute.SELECTIVE)
    cpu_norms = 2 * 4 * s * b * m.hidden_size / t
    measured = max(r[str(layer)] for r in run_forked(2, _saved_bytes, pf) for layer in range(m.num_layers))
    assert measured == pytest.approx(megatron + cpu_norms, rel=0.10)
    priced = layer_activation_bytes(m, pf.train, pf.plan, recompute, pf.cluster.framework)
    assert measured == pytest.approx(priced, rel=0.03)
