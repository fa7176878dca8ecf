"""Activations one layer (and the embedding and head) keeps per micro-batch, tensor by tensor.

Activations follow Korthikanti et al. 2022 (arXiv 2205.05198) Sec. 4: per layer, per micro-batch
s·b·h·(34 + 5·a·s/h) bytes for a GPT layer with t = 1, s·b·h·(10 + 24/t + 5·a·s/(h·t)) with tensor
parallelism, s·b·h·(34/t + 5·a·s/(h·t)) with sequence parallelism, the 5·a·s/h term gone under
selective recomputation and 2·s·b·h (/t with SP) under full recomputation. `layer_activation_bytes`
re-derives those terms tensor by tensor so they hold for GQA (smaller K, V), SwiGLU (four f-wide
tensors instead of two), no dropout (Llama), fp32 activations, and flash attention (no s x s
tensors; the softmax statistics instead); how many SwiGLU tensors are saved is a framework trait.
Tests check the published coefficients.
"""
from __future__ import annotations

from costmodel import selective_ops
from costmodel.deepseek import dense_layer_model
from costmodel.frameworks import RUNTIME, FrameworkTraits, shared_expert_split
from costmodel.kernels import cp_chunk_scores, expert_rows, moe_tokens
from costmodel.params import ceil_div, dense_layers_held
from costmodel.plan import Plan, Recompute
from costmodel.specs import Arch, AttentionKernel, ModelSpec, NormKind, PositionKind, TrainSpec


def _cp_cpu_mask_elements(train: TrainSpec, plan: Plan, traits: FrameworkTraits) -> float:
    """torch's CPU flash kernel takes a chunk's bottom-right causal mask materialised (c x keys
    before the chunk's end, in the compute dtype) and keeps it for backward; CUDA's kernels take
    the causal offset instead. Per layer, for the CP rank with the most: chunks r and 2cp-1-r
    of c = s/2cp tokens need c·(r+1)c + c·(2cp-r)c elements, c²(2cp+1) for any r > 0 (rank 0's
    first chunk is plain causal). Not per sample or head: one mask broadcast over both."""
    if plan.cp == 1 or not (traits.cp_all_gather_kv and traits.cpu_kernels):
        return 0.0
    return cp_chunk_scores(train.seq_len, plan.cp)


def _moe_saved_bytes(model: ModelSpec, train: TrainSpec, tokens: int, ep: int, traits: FrameworkTraits,
                     etp: int = 1, shared_split: int = 1, input_bytes: int | None = None,
                     act_recomputed: bool = False) -> float:
    """What runtime.moe keeps for backward in one layer (measured per tensor by
    tests/runtime/test_activation_memory.py): the router's fp32 probabilities, the chosen experts
    (int64) and their fp32 weights (and their sum where renormalised); per routed slot (tokens·k)
    the expert output before and after weighting, its weight, its token's index and its sort
    index (where the weight multiplies inside the experts' activation, costmodel.frameworks
    `moe_probs_in_activation`: its fp32 weight and int32 row-map entry only); per row the device's experts take (tokens·k, times the imbalance under expert
    parallelism: costmodel.kernels.expert_rows) its input and the expert's SwiGLU tensors, and
    under expert parallelism its two reorder indices; the shared expert's SwiGLU tensors, and
    with a gate its output and the gate's value. (Its input is the MLP input
    `layer_activation_bytes` counts already.) Under expert TP (Plan.etp) the rows are those
    gathered over the etp ranks, each with 1/etp of the expert's width. A shared expert split over
    the `shared_split` ranks of the TP group (frameworks `shared_expert_tp`) keeps its SwiGLU
    tensors over their shards gathered at 1/shared_split of its width (as much where it divides),
    its gate on the rank's shard. input_bytes: bytes per element of what the experts' projections
    keep of their inputs (the rows and the SwiGLU product): the compute dtype's, or float8's where
    the framework keeps float8 inputs (_linear_input_bytes); the shared expert then keeps its own
    float8 copy of the MLP input as well. act_recomputed: the experts' activation re-run in backward
    (Megatron-Core's `moe_act`), their SwiGLU product (fc2's input) not kept."""
    a, h, k, e = train.compute_dtype.num_bytes, model.hidden_size, model.experts_per_token, model.num_experts
    x = a if input_bytes is None else input_bytes
    router = tokens * (4 * e + 8 * k + 4 * k + (4 if model.moe_norm_topk_prob else 0))
    per_slot = 4 + 4 if traits.moe_probs_in_activation else a * (2 * h + 1) + 16
    swiglu = (traits.swiglu_saved_tensors - 1) * a + x   # the product is the down projection's input
    routed = swiglu - (x if act_recomputed else 0)
    per_row = etp * (x * h + routed * model.moe_ffn_hidden_size // etp + (16 if ep * etp > 1 else 0))
    fs = model.shared_expert_ffn_hidden_size
    shared = tokens * (shared_split * swiglu * ceil_div(fs, shared_split)
                       + (a * (h + 1) if model.shared_expert_gate else 0) + (x * h if fs and x != a else 0))
    return router + tokens * k * per_slot + expert_rows(model, train, tokens, ep) * per_row + shared


def _linear_input_bytes(train: TrainSpec, plan: Plan, traits: FrameworkTraits) -> int:
    """Bytes per element of what a linear projection keeps of its input for its weight gradient:
    the compute dtype's, or one where float8 linears keep their float8 input (frameworks
    `float8_saved_inputs`)."""
    return 1 if plan.fp8_linears and traits.float8_saved_inputs else train.compute_dtype.num_bytes


def layer_activation_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, mode: Recompute,
                           traits: FrameworkTraits = RUNTIME) -> float:
    """Bytes one layer keeps for backward, for one micro-batch, on one device. Under selective
    recomputation the framework's modules (frameworks `selective_modules`) keep their inputs only,
    or torchtitan's per-op policy keeps what costmodel.selective_ops says."""
    a = train.compute_dtype.num_bytes
    selective = traits.selective_modules if mode is Recompute.SELECTIVE else ()
    lin = _linear_input_bytes(train, plan, traits)
    t, sp = plan.tp, plan.tp if plan.sequence_parallel else 1
    b, s = plan.micro_batch_size, train.seq_len // plan.cp
    tokens, h, kv, f = b * s, model.hidden_size, model.kv_hidden_size, model.ffn_hidden_size
    q = model.q_hidden_size
    # dropout masks: 1 byte on CUDA, the compute dtype on CPU (costmodel.frameworks.cpu_kernels)
    drop = (a if traits.cpu_kernels else 1) if model.dropout else 0
    if mode is Recompute.FULL:
        return a * tokens * h / sp  # the layer input only
    # 2 norm inputs (and, CPU RMSNorm, their normalised copies) and 2 dropout masks on sequence
    # shards; the attention and MLP inputs whole where TP keeps them gathered (frameworks). CPU's
    # composite RMSNorm computes in fp32 and keeps both tensors in fp32 whatever the compute
    # dtype (measured: bf16 layers kept 20 % more than a count in bf16)
    cpu_rms = model.norm_kind is NormKind.RMSNORM and traits.cpu_kernels
    # a parallel residual's two norms read one tensor, the layer input (kept once)
    norm_inputs = 1 if model.parallel_residual else 2
    norms = norm_inputs * 4 + model.layer_norms * 4 if cpu_rms else norm_inputs * a
    # a mixture of experts takes this rank's sequence shard as it is (runtime.parallel), unless
    # its shared expert is split over TP, which gathers its input as a dense MLP does; one norm
    # shared by both branches gives them one input, unless each block gathers its own (SP)
    split_shared = traits.shared_expert_tp and model.shared_expert_ffn_hidden_size > 0
    mlp_input_split = t if model.is_moe and not split_shared else proj_input_split(plan, traits)
    # the projections' inputs: float8 where the framework keeps float8 (not a mixture's, whose
    # router takes the 16-bit input)
    mlp_lin = a if model.is_moe else lin
    mlp_input = 0.0 if model.shared_norm and not _gathers_per_block(plan, traits) else mlp_lin * tokens * h / mlp_input_split
    attn_input = lin * tokens * h / proj_input_split(plan, traits)
    if "layernorm" in selective:   # the norms apart from a linear: a latent attention's, a mixture's
        attn_input, mlp_input = (0.0 if model.is_mla else attn_input), (0.0 if model.is_moe else mlp_input)
    replicated = tokens * h * (norms + 2 * drop) / sp + attn_input + mlp_input
    up_proj = "mla_up_proj" in selective
    qkv = ((mla_saved_bytes(model, train, plan, traits, up_proj) if model.is_mla else a * tokens * (q + 2 * kv) / t)
           + cp_gathered_kv_bytes(model, train, plan, traits))
    if model.arch is Arch.GPT and model.position_kind is PositionKind.ROPE:
        # a fused QKV (GPT-NeoX): attention keeps the rotated Q and K, and V, a view, keeps the
        # whole fused output alive beside them (measured: test_activation_memory's neox cases)
        qkv += a * tokens * (q + kv) / t
    if model.qk_norm:   # Qwen3's per-head norms keep Q and K as projected (CPU's composite RMSNorm: both in fp32)
        qkv += tokens * (q + kv) * (2 * 4 if cpu_rms else a) / t
    if model.position_kind is PositionKind.ROPE:   # RoPE's cos and sin, for Q and for K (any batch)
        qkv += 4 * a * s * model.rotary_dims
    # the attention's output, kept by the attention for its backward and by the output projection
    # as its input: one tensor, and a float8 copy beside it where the projection keeps float8
    out_proj_input = (a + (lin if lin != a else 0)) * tokens * model.attention_output_size / t
    # SwiGLU in eager torch saves gate, up, silu(gate) and the product; a fused kernel keeps the
    # 2f-wide first projection and the product (costmodel.frameworks); the product (GeLU: its
    # output) is the down projection's input
    expert_lin = lin if traits.float8_experts else a
    mlp = (_moe_saved_bytes(model, train, moe_tokens(tokens, t), plan.ep, traits, plan.etp,
                            shared_expert_split(t, traits.shared_expert_tp), expert_lin, "moe_act" in selective)
           if model.is_moe else
           ((traits.swiglu_saved_tensors if model.ffn_kind.gated else 2) - 1 + lin / a) * a * tokens * f / t)
    if "mlp" in selective and not model.is_moe:   # the MLP keeps its input (mlp_input) only
        mlp = 0.0
    if "core_attn" in selective:
        core = 0.0
    elif train.attention_kernel is AttentionKernel.FLASH and not (drop and traits.cpu_kernels):
        core = 4.0 * b * (model.num_heads // t) * s  # fp32 log-sum-exp per query row
        if plan.cp > 1 and traits.cp_all_gather_kv:
            # one kernel per chunk, each keeping its output; the projection keeps their
            # concatenation (without CP it keeps the kernel's output itself)
            core += out_proj_input + a * _cp_cpu_mask_elements(train, plan, traits)
    else:  # softmax output (+ dropout mask and output), over local queries x all keys
        core = b * (model.num_heads / t) * s * train.seq_len * (a + (drop + a if drop else 0))
    if mode is Recompute.SELECTIVE and traits.selective_op_policy:   # torchtitan's per-op policy
        return selective_ops.saved_bytes(model, train, plan) + (mlp if model.is_moe else 0.0)
    return replicated + qkv + out_proj_input + mlp + core


def mla_saved_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, traits: FrameworkTraits,
                    up_proj_recomputed: bool = False) -> float:
    """What non-absorbed multi-head latent attention keeps for backward in one micro-batch besides
    its input, the output projection's input and RoPE's tables (DeepSeek-V2 Sec. 2.1.2;
    runtime.latent_attention, measured per tensor by tests/runtime/test_activation_memory.py),
    tensor by tensor:
    - the down-projections' outputs, their RMSNorms' inputs: the query latent (q_lora_rank; none
      without query compression) and the key/value latent with the RoPE key beside it, one tensor;
      on this rank's sequence shard under SP. torch's CPU RMSNorm is composite (frameworks
      `cpu_kernels`): it keeps its input upcast to fp32 (in fp32 the same tensor, RoPE key and
      all) and the normalised latent in fp32;
    - the normed latents, the up-projections' inputs, whole on every TP rank (gathered under SP);
    - per TP rank's heads, attention's inputs: Q and K of no-RoPE + RoPE size and V of
      v_head_dim. A kernel of one head size (torch's SDPA flash kernels; not the vendor's cuDNN
      attention, frameworks `vendor_attention`) takes V zero-padded to the Q/K size and keeps its
      padded output apart from the output projection's input (under CP the caller counts each
      chunk's output at V's size: the padding's excess here).
    The RoPE key before rotation is not kept (RoPE's backward needs only its cos and sin).
    up_proj_recomputed (Megatron-Core's `mla_up_proj`): the up-projections and RoPE re-run in
    backward, keeping their inputs, the latents (under SP gathered whole, in place of the normed
    ones; else the down-projections' outputs): the heads' Q, K and V and the normed latents freed."""
    a, t = train.compute_dtype.num_bytes, plan.tp
    tokens = plan.micro_batch_size * train.seq_len // plan.cp
    shard = tokens / t if plan.sequence_parallel else tokens
    q, kv, rope = model.q_lora_rank, model.kv_lora_rank, model.qk_rope_head_dim
    if traits.cpu_kernels:
        down = 4 * shard * (q + kv + (rope if a == 4 else 0)) + 4 * shard * (q + kv)
    else:
        down = a * shard * (q + kv + rope)
    heads, qk, v = model.num_heads / t, model.head_dim, model.value_head_dim
    flash = train.attention_kernel is AttentionKernel.FLASH
    padded = flash and not traits.vendor_attention and v != qk
    out = (qk if plan.cp == 1 else qk - v) if padded else 0
    if up_proj_recomputed:   # the padded kernel's output, the attention core's, stays
        return down + (a * tokens * (q + kv) if plan.sequence_parallel else 0.0) + a * tokens * heads * out
    return down + a * tokens * ((q + kv) + heads * (2 * qk + (qk if padded else v) + out))


def cp_gathered_kv_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, traits: FrameworkTraits = RUNTIME) -> float:
    """What one layer's attention keeps, per micro-batch, of the K and V gathered from the other
    CP ranks (all-gathered CP, costmodel.frameworks `cp_all_gather_kv`; a ring keeps none)."""
    if plan.cp == 1 or not traits.cp_all_gather_kv:
        return 0.0
    others = train.seq_len - train.seq_len // plan.cp
    return train.compute_dtype.num_bytes * plan.micro_batch_size * others * 2 * model.kv_hidden_size / plan.tp


def _gathers_per_block(plan: Plan, traits: FrameworkTraits) -> bool:
    """Under SP each block all-gathers its own input, and a framework that keeps the gathered
    input keeps one per block."""
    return plan.tp > 1 and plan.sequence_parallel and traits.tp_keeps_gathered_input


def proj_input_split(plan: Plan, traits: FrameworkTraits) -> int:
    """Over how many ranks the saved input of a column-parallel projection is split: the
    sequence shards under SP, unless the framework keeps the gathered input (frameworks)."""
    return plan.tp if plan.sequence_parallel and not traits.tp_keeps_gathered_input else 1


def edge_bytes_per_micro_batch(model: ModelSpec, train: TrainSpec, plan: Plan, first: bool,
                               last: bool, traits: FrameworkTraits = RUNTIME, dense: int | None = None) -> float:
    """Per micro-batch, what the embedding keeps on the first stage, the head and the loss on the
    last, and what the dense first layers the stage or rank holds (`dense`; by default all of them
    on the first) and the MTP modules add (deepseek_edge_bytes)."""
    a, b, s = train.compute_dtype.num_bytes, plan.micro_batch_size, train.seq_len // plan.cp
    sp = plan.tp if plan.sequence_parallel else 1
    tokens = b * s
    total = 0.0
    if first:
        total += tokens * model.hidden_size * (a + model.dropout) / sp
    if last:
        total += logits_held_bytes(model, train, plan, traits) + a * tokens * model.hidden_size * (1 + 1 / sp)
    return total + deepseek_edge_bytes(model, train, plan, first, last, traits, dense)


def deepseek_edge_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, first: bool, last: bool,
                        traits: FrameworkTraits = RUNTIME, dense: int | None = None) -> float:
    """Per micro-batch, `dense` of the dense first layers (by default all of them, on the first
    rank: costmodel.params.dense_layers_on_rank) against as many expert layers, in the plan's
    recompute mode (taken to cover them where the plan recomputes); and on the last rank each MTP
    module's layer (an expert layer), its own logits as the loss keeps them and the rest of the
    module (_mtp_own_bytes)."""
    total = 0.0
    dense = dense_layers_held(model.first_k_dense, first, dense)
    if dense:
        dense_layer = layer_activation_bytes(dense_layer_model(model), train, plan, plan.recompute, traits)
        total += dense * (dense_layer - layer_activation_bytes(model, train, plan, plan.recompute, traits))
    if last and model.mtp_depth:
        total += model.mtp_depth * (layer_activation_bytes(model, train, plan, plan.recompute, traits)
                                    + _mtp_own_bytes(model, train, plan, traits)
                                    + logits_held_bytes(model, train, plan, traits))
    return total


def _mtp_own_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, traits: FrameworkTraits) -> float:
    """Per micro-batch, what one MTP module keeps besides its layer and logits (runtime.mtp, as
    Megatron-Core's): the 2h-wide concatenation its column-parallel projection keeps (whole per TP
    rank), the shared head's input (whole: gathered under SP, else the module's last norm's output)
    and its three norms' inputs on sequence shards. The previous depth's hidden state, which one of
    them reads, is without SP the tensor the head before keeps already. CPU's composite RMSNorm
    keeps its input upcast to fp32 and its normalised copy (frameworks.cpu_kernels): an upcast
    bf16 input is a tensor of its own. Measured per tensor by tests/runtime/test_mtp.py."""
    a = train.compute_dtype.num_bytes
    sp = plan.tp if plan.sequence_parallel else 1
    cpu_rms = model.norm_kind is NormKind.RMSNORM and traits.cpu_kernels
    norm_input, norm_copy = (4, 4) if cpu_rms else (a, 0)
    shared_hidden = sp == 1 and norm_input == a
    norms = 2 * (norm_input + norm_copy) + norm_copy + (0 if shared_hidden else norm_input)
    return local_tokens(train, plan) * model.hidden_size * (norms / sp + 3 * a)


def local_tokens(train: TrainSpec, plan: Plan) -> int:
    """Tokens of one micro-batch on one device: its sequences, each cut into cp pieces."""
    return plan.micro_batch_size * (train.seq_len // plan.cp)


def _logits_elems(model: ModelSpec, train: TrainSpec, plan: Plan, traits: FrameworkTraits = RUNTIME) -> float:
    """Logits of one micro-batch on one device: its vocabulary shard, or the whole vocabulary
    where the framework gathers them before the loss (frameworks.vocab_parallel_loss)."""
    return local_tokens(train, plan) * loss_vocab(model, plan, traits)


def loss_vocab(model: ModelSpec, plan: Plan, traits: FrameworkTraits = RUNTIME) -> int:
    """The vocabulary one device's loss runs over."""
    return ceil_div(model.vocab_size, plan.tp) if traits.vocab_parallel_loss else model.vocab_size


def logits_held_bytes(model: ModelSpec, train: TrainSpec, plan: Plan,
                      traits: FrameworkTraits = RUNTIME) -> float:
    """What the loss keeps of one micro-batch's logits until its backward: the fp32 log-probs
    cross entropy saves (4 bytes whatever the compute dtype: the loss runs in fp32), and, under
    a pipeline that keeps its last stage's output for the backward call (torch pipelining,
    DeepSpeed's engine: frameworks `pipeline_output_kept`), that output in the compute dtype.
    Otherwise the 16-bit logits die once upcast (Megatron's last stage returns the loss). A fused
    loss (frameworks `fused_cross_entropy`) keeps the logits themselves, that same output, and a
    log-sum-exp per row."""
    a = train.compute_dtype.num_bytes
    if traits.fused_cross_entropy:
        return _logits_elems(model, train, plan, traits) * a + 4 * local_tokens(train, plan)
    kept_output = a if plan.pp > 1 and traits.pipeline_output_kept else 0
    return _logits_elems(model, train, plan, traits) * (4 + kept_output)


def backward_working_bytes(model: ModelSpec, train: TrainSpec, plan: Plan, last: bool,
                           traits: FrameworkTraits = RUNTIME, rebuilt_bytes: float = 0.0) -> float:
    """Transient bytes of the backward pass beyond what the forward kept: a layer's input
    gradients of its widest block (SwiGLU: gate, up and product gradients, f wide; attention:
    dQ, dK, dV and FlashAttention-2's fp32 dQ accumulator) plus its largest weight gradient in
    the compute dtype before it is added to the fp32 main gradient (none where the weight-gradient
    GEMM adds into that gradient itself: frameworks `fused_grad_accumulation`); on the last stage the
    loss's gradient (fp32 then cast back) over the logits, if larger. One backward runs at a
    time, so a rank adds this once. The loss's backward runs before any layer is rebuilt: on a
    rank whose caller counts a rebuilt layer's `rebuilt_bytes` beside this, the loss's gradient
    needs only what exceeds them (benchmarks/gpu_check.py's runs with full recomputation on an
    H200 peak at the larger of the two, not their sum)."""
    a, t = train.compute_dtype.num_bytes, plan.tp
    tokens = local_tokens(train, plan)
    h, kv, f = model.hidden_size, model.kv_hidden_size, model.ffn_hidden_size
    mlp_weight = a * h * f / t
    if model.is_moe:   # one expert's backward at a time; it may have got every token of the shard
        f = max(model.moe_ffn_hidden_size, model.shared_expert_ffn_hidden_size)
        # routed experts whole on every TP rank, the shared one split where the framework splits it
        shared = ceil_div(model.shared_expert_ffn_hidden_size, shared_expert_split(t, traits.shared_expert_tp))
        mlp_weight = a * h * max(model.moe_ffn_hidden_size, shared)
    mlp = (traits.swiglu_saved_tensors - 1 if model.ffn_kind.gated else 2) * a * tokens * f / t
    q = model.q_hidden_size
    attention = a * tokens * (q + 2 * kv) / t + 4 * tokens * q / t
    widest_weight = 0.0 if traits.fused_grad_accumulation else max(mlp_weight, a * h * (q + 2 * kv) / t)
    layer = max(mlp, attention) + widest_weight
    head = _logits_elems(model, train, plan, traits) * _loss_grad_bytes(a, plan, traits) if last else 0.0
    head = max(head - rebuilt_bytes, 0.0)
    # offloaded activations: the layer whose saved tensors are back on the device for its backward
    back = layer_activation_bytes(model, train, plan, Recompute.NONE, traits) if plan.offload_activations else 0.0
    return max(layer, head) + back


def _loss_grad_bytes(compute_bytes: int, plan: Plan, traits: FrameworkTraits) -> int:
    """Bytes per logit the loss's backward holds beyond its saved log-probs: the cast alone for
    a loss that writes the gradient over its saved softmax, the compute dtype for a fused one,
    torch's DTensor loss parallel's three fp32 tensors under TP (frameworks
    `dtensor_loss_parallel`), else torch's cross entropy's."""
    if traits.loss_grad_in_place or traits.fused_cross_entropy:
        return compute_bytes
    if traits.dtensor_loss_parallel and plan.tp > 1:
        return 3 * 4
    return _unfused_loss_grad_bytes(compute_bytes)


def _unfused_loss_grad_bytes(compute_bytes: int) -> int:
    """Bytes per logit torch's cross entropy holds beyond its saved log-probs while its backward
    runs: NLL's zero-filled fp32 gradient and log-softmax's new fp32 gradient side by side, then
    the latter beside its cast to the compute dtype (`python benchmarks/gemm_shapes.py --kind
    loss` measures it: on an H200, 16 bytes a logit with the measurement's own bf16 logits and
    their gradient)."""
    return max(4 + 4, 4 + compute_bytes)
