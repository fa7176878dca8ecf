"""Memory-bound kernels: norms, activations, rotary embedding, dropout, residual adds and the
loss, as fused (GPU frameworks) or eager (the runtime on a CPU) kernels."""
from __future__ import annotations

from costmodel.hardware import DeviceProfile
from costmodel.kernels.gemm import _moe_routing_bytes, linear_tokens, moe_tokens
from costmodel.kernels.roofline import KernelShape, memory_bound_s
from costmodel.layout import Style, dense_blocks
from costmodel.specs import DType, FfnKind, ModelSpec, NormKind, PositionKind, TrainSpec


def dropout_s(elements: float, dev: DeviceProfile) -> float:
    """Torch's dropout over `elements` activations at the profile's measured rate
    (`dropout_s_per_element`: F.dropout on a CPU, drawing each random number in software, then
    scaling and multiplying; 0 where a profile has none, as datasheets, and on a GPU, whose
    dropout draws inside the multiply's kernel). The memory-bound counts keep the multiply's
    bytes as well, a few percent of this rate counted twice. Pricing those bytes alone put a
    GPT-style model's plans (dropout on both branches of each layer, on the attention
    probabilities and on the embeddings) 18-35 % too fast on a CPU."""
    return elements * dev.dropout_s_per_element


# the GeLU each MLP kind runs (runtime.model), by torch's name for its approximation
GELU_OF = {FfnKind.GELU: "tanh", FfnKind.GEGLU: "tanh", FfnKind.GELU_ERF: "none"}


def gelu_s(model: ModelSpec, plan: KernelShape, tokens: int, dev: DeviceProfile) -> tuple[float, float]:
    """(forward, backward) of the MLP's GeLU over a layer's `tokens` on one TP rank, at the
    profile's measured rate (`gelu_s_per_element`: a CPU, whose GeLU is bound by its tanh or
    erf, about ten times an add's time an element; none where a profile has none, as datasheets
    and GPUs, whose GeLU is memory-bound). The memory-bound count keeps its bytes too, about a
    tenth of this counted twice; those bytes alone would price a CPU's GeLU several times too
    cheap."""
    rates = {k: (f, b) for k, f, b in dev.gelu_s_per_element}
    if model.ffn_kind not in GELU_OF or GELU_OF[model.ffn_kind] not in rates:
        return 0.0, 0.0
    forward, backward = rates[GELU_OF[model.ffn_kind]]
    elements = tokens * _mlp_width(model) / plan.tp
    return elements * forward, elements * backward


def rank_hidden_elements(model: ModelSpec, plan: KernelShape, tokens: int) -> float:
    """A layer's hidden states on one TP rank, what its norms, residual adds and dropouts run
    over: every token's without sequence parallelism (each TP rank repeats them), its 1/tp shard
    with it."""
    return tokens * model.hidden_size / (plan.tp if plan.sequence_parallel else 1)


def bias_grad_traffic(model: ModelSpec, plan: KernelShape, tokens: int, a: int,
                      qkv_in_gemm: bool = False) -> tuple[float, int]:
    """(bytes, kernels) of the dense projections' bias gradients in backward, each a reduction
    reading the rows of its output gradient this rank holds: autograd's sum where the bias is added
    outside the GEMM (torch's linear backward, Megatron's bias-GeLU and bias-dropout-add fusions,
    megatron/core/fusions). A column-parallel projection's gradient is every token's (gathered
    under SP) over its 1/tp of the outputs; a row-parallel one's is the rank's sequence shard under
    SP, every token without, over all outputs. `qkv_in_gemm` (frameworks `qkv_bias_grad_in_gemm`):
    the attention's input projections compute theirs in the weight-gradient GEMM, at no cost of
    their own. A mixture's experts are not counted."""
    out, kernels = 0.0, 0
    for block in dense_blocks(model):
        for lin in block.linears:
            if not lin.bias or (qkv_in_gemm and block.name == "attention" and lin.style is not Style.ROWWISE):
                continue
            if lin.style is Style.ROWWISE:
                rows, width = tokens // (plan.tp if plan.sequence_parallel else 1), lin.out_features
            elif lin.style is Style.COLWISE:
                rows, width = tokens, -(-lin.out_features // plan.tp)
            else:
                rows, width = linear_tokens(lin, tokens, plan.tp, plan.sequence_parallel), lin.out_features
            out, kernels = out + a * rows * width, kernels + 1
    return out, kernels


def _fused_elementwise(model: ModelSpec, train: TrainSpec, plan: KernelShape,
                       tokens: int, qkv_bias_in_gemm: bool = False) -> tuple[float, int, float, int]:
    """(forward bytes, kernels, backward bytes, kernels) of a layer's memory-bound work as fused
    kernels run it (Megatron-Core and Transformer Engine, compiled code), each kernel's bytes
    read + written, its backward counted as its own kernel reads and writes:
    - a norm reads and writes the hidden states (2a); backward reads the input and the output
      gradient and writes the input gradient (3a), a second kernel finishing the weight's
      partial sums;
    - each branch's end adds the residual (read two, write one: 3a), with dropout fused into it
      (Megatron's bias-dropout-add: one kernel writing a byte mask); backward the residual stream
      carries the gradient through, the branch's input gradient is summed into it (3a), and
      under dropout the branch's gradient is masked (read gradient and mask, write: 2a + 1);
    - the activation function reads its inputs and writes one output (SwiGLU 3a per element
      of the MLP's width, GeLU 2a); backward reads the output gradient and the inputs and
      writes their gradients (5a, 3a);
    - RoPE and the Q/K norms as a rotation (2a each way) and a norm;
    - a mixture's routing (costmodel.kernels.gemm._moe_routing_bytes) backward at twice its
      forward: the permutations' gradients, the probabilities' gradient re-reading the routed
      outputs and the router's backward (counted at once its forward, the published Qwen3 MoE
      runs are priced 12-25 % too fast);
    - the biases' gradients (bias_grad_traffic; `qkv_bias_in_gemm`: its qkv_in_gemm).
    Without sequence parallelism every TP rank repeats the norms, adds and dropouts on all
    tokens."""
    a, t = train.compute_dtype.num_bytes, plan.tp
    rep = rank_hidden_elements(model, plan, tokens)
    drop = 1 if model.dropout else 0
    norms = model.layer_norms
    fwd = rep * (norms * 2 * a + 2 * (3 * a + drop))
    bwd = rep * (norms * 3 * a + 2 * 3 * a + drop * 2 * (2 * a + 1))
    fwd_k, bwd_k = norms + 2, 2 * norms + 2 + 2 * drop
    width = tokens * _mlp_width(model) / t
    fwd_act, bwd_act = (3, 5) if model.ffn_kind.gated else (2, 3)
    fwd, bwd, fwd_k, bwd_k = fwd + fwd_act * a * width, bwd + bwd_act * a * width, fwd_k + 1, bwd_k + 1
    routing_bytes, routing_kernels = _moe_routing_bytes(model, train, moe_tokens(tokens, t), plan.ep, plan.etp)
    fwd, bwd, fwd_k, bwd_k = fwd + routing_bytes, bwd + 2 * routing_bytes, fwd_k + routing_kernels, bwd_k + 2 * routing_kernels
    if model.qk_norm:   # Qwen3's RMSNorm over each head's queries and keys
        qk = tokens * (model.q_hidden_size + model.kv_hidden_size) / t
        fwd, bwd, fwd_k, bwd_k = fwd + 2 * a * qk, bwd + 3 * a * qk, fwd_k + 2, bwd_k + 4
    if model.position_kind is PositionKind.ROPE:   # on the rotated share of each head's dimensions
        rotated = 2 * a * tokens * _rotated(model) / t
        fwd, bwd, fwd_k, bwd_k = fwd + rotated, bwd + rotated, fwd_k + 1, bwd_k + 1
    bias_bytes, bias_kernels = bias_grad_traffic(model, plan, tokens, a, qkv_bias_in_gemm)
    return fwd, fwd_k, bwd + bias_bytes, bwd_k + bias_kernels


def _mlp_width(model: ModelSpec) -> int:
    """The activation function's width: the MLP's, or each routed expert's and the shared one's."""
    return (model.experts_per_token * model.moe_ffn_hidden_size + model.shared_expert_ffn_hidden_size
            if model.is_moe else model.ffn_hidden_size)


def _rotated(model: ModelSpec) -> float:
    """Elements of one token's queries and keys that RoPE rotates (MLA: each head's query RoPE
    part and the one RoPE key all heads share)."""
    if model.is_mla:
        return (model.num_heads + 1) * model.qk_rope_head_dim
    return (model.q_hidden_size + model.kv_hidden_size) * model.rotary_fraction


# Torch's CPU kernels as the runtime's eager layer calls them (costmodel.frameworks `cpu_kernels`),
# counted op by op with a dispatch mode (tests/runtime/test_elementwise_traffic.py): (bytes per
# element read + written, kernels), forward and backward; `casts` 1 for a 16-bit compute dtype.
# RMSNorm is composite in fp32: cast up (a + 4), pow, mean, add eps, rsqrt, times 1/rms, times the
# weight, cast back (a + 4); backward 14 fp32 kernels (two row sums, pow, div), both casts and
# the weight gradient's.
def _cpu_rms_norm(a: int, casts: int) -> tuple[tuple[float, int], tuple[float, int]]:
    return (28 + casts * 2 * (a + 4), 6 + 2 * casts), (96 + casts * 2 * (a + 4), 14 + 3 * casts)


# RoPE per rotated tensor (rotate-half form, runtime.model.rope): neg of a half, cat, two
# products and their sum (10a); backward two products, two slice-backwards, neg, two adds (14a).
# Its cos / sin tables are rebuilt per call: 8 tiny kernels, two casts more in 16 bits.
CPU_ROPE_FWD, CPU_ROPE_BWD = (10, 5), (14, 7)


CPU_ROPE_TABLE_KERNELS = 8


# Torch's CPU kernels widen 16-bit elements to fp32 in registers: an element costs about what an
# fp32 one does, not half of it, so elements are counted at fp32's width on the fp32-measured
# memory curve.
CPU_ELEMENT_BYTES = 4


# RMSNorm on CUDA (torch's fused kernels, `_fused_rms_norm`): forward reads and writes the
# activations once; backward reads input and output gradient and writes the input gradient, and
# a second kernel reads both again for the weight's gradient (torch.profiler on an H100:
# `python benchmarks/gpu_trace.py PLAN.json`).
def _cuda_rms_norm(a: int) -> tuple[tuple[float, int], tuple[float, int]]:
    return (2 * a, 1), (5 * a, 2)


def fp32_norm_recompute_traffic(a: int) -> tuple[tuple[float, int], tuple[float, int]]:
    """((forward bytes, kernels), (backward bytes, kernels)) per hidden element that one RMSNorm
    adds where its input is cast to fp32 first and the cast and norm are checkpointed
    (frameworks `norm_fp32_recomputed`), over the fused norm of `a`-byte elements
    (_cuda_rms_norm). Forward: the cast (read a, write 4) and the norm reading fp32 (4 - a
    more). Backward: the cast and the norm re-run (a + 4 each), the norm's two backward kernels
    reading the fp32 input and writing an fp32 gradient (3 x (4 - a) more), and the cast's
    gradient back to the compute dtype (read 4, write a): 8 bytes and one kernel forward, 24
    bytes and three kernels backward, whatever a."""
    return ((a + 4) + (4 - a), 1), ((a + 4) + (4 + a) + 3 * (4 - a) + (4 + a), 3)


def eager_elementwise_traffic(model: ModelSpec, train: TrainSpec, plan: KernelShape, tokens: int,
                              a: int = CPU_ELEMENT_BYTES, cpu: bool = True, composite_norm: bool = False,
                              fused_projections: bool = False, fp32_norms: bool = False) -> tuple[float, int, float, int]:
    """(forward bytes, kernels, backward bytes, kernels) of a layer's memory-bound work as torch's
    eager kernels run the runtime's layer (costmodel.frameworks `eager_layer`): RMSNorm (composite
    in fp32 on a CPU, fused on a GPU), RoPE and SwiGLU op by op, and the gradient sums autograd
    adds where one input feeds several projections. Parts the count does not cover (LayerNorm,
    dropout, GeLU, Q/K norms, routing) keep the fused count, their backward twice their forward.
    `a`: bytes per compute-dtype element (a CPU's pricing counts every element at fp32's width,
    CPU_ELEMENT_BYTES; the test counts the real bytes). composite_norm: a GPU layer's RMSNorm op
    by op as the CPU's (frameworks.composite_rms_norm). fused_projections: the framework runs the
    projections that share an input as one (Megatron's fused QKV and gate/up: frameworks
    `llama_ops_eager`), so autograd adds no gradients of that input. fp32_norms: each RMSNorm's
    input cast to fp32 and norm and cast re-run in backward, with the residual add checkpointed
    beside the second (frameworks `norm_fp32_recomputed`: fp32_norm_recompute_traffic)."""
    t, c = plan.tp, 1 if train.compute_dtype.num_bytes < 4 else 0
    rep = rank_hidden_elements(model, plan, tokens)
    fwd_b = bwd_b = 0.0
    fwd_k = bwd_k = 0
    if model.norm_kind is NormKind.RMSNORM:
        (nf, kf), (nb, kb) = _cpu_rms_norm(a, c) if cpu or composite_norm else _cuda_rms_norm(a)
        fwd_b, fwd_k, bwd_b, bwd_k = model.layer_norms * nf * rep, model.layer_norms * kf, \
            model.layer_norms * nb * rep, model.layer_norms * kb
        if fp32_norms:
            (ef, ekf), (eb, ekb) = fp32_norm_recompute_traffic(a)
            fwd_b, fwd_k = fwd_b + model.layer_norms * ef * rep, fwd_k + model.layer_norms * ekf
            bwd_b, bwd_k = bwd_b + (model.layer_norms * eb + 3 * a) * rep, bwd_k + model.layer_norms * ekb + 1
    else:
        fwd_b, fwd_k = model.layer_norms * 2 * a * rep, model.layer_norms
        bwd_b, bwd_k = 2 * fwd_b, 2 * fwd_k
    # residual adds, and backward the sums over projections that share an input (q/k/v, gate/up)
    shared = 0 if fused_projections else sum(
        sum(1 for lin in b.linears if lin.style is not Style.ROWWISE and lin.in_features == model.hidden_size) - 1
        for b in dense_blocks(model))
    fwd_b, fwd_k = fwd_b + 2 * 3 * a * rep, fwd_k + 2
    bwd_b, bwd_k = bwd_b + (2 + shared) * 3 * a * rep, bwd_k + 2 + shared
    width = tokens * _mlp_width(model) / t
    if model.ffn_kind.gated and not model.is_moe:   # silu, times up; backward two products, silu_backward
        fwd_b, fwd_k, bwd_b, bwd_k = fwd_b + 5 * a * width, fwd_k + 2, bwd_b + 9 * a * width, bwd_k + 3
    else:
        acts = 3 if model.ffn_kind.gated else 2
        fwd_b, fwd_k, bwd_b, bwd_k = fwd_b + acts * a * width, fwd_k + 1, bwd_b + 2 * acts * a * width, bwd_k + 2
    if model.position_kind is PositionKind.ROPE:
        rotated = tokens * _rotated(model) / t
        fwd_b += CPU_ROPE_FWD[0] * a * rotated
        fwd_k += 2 * (CPU_ROPE_FWD[1] + CPU_ROPE_TABLE_KERNELS + 2 * c)
        bwd_b, bwd_k = bwd_b + CPU_ROPE_BWD[0] * a * rotated, bwd_k + 2 * CPU_ROPE_BWD[1]
    drop = 1 if model.dropout else 0
    rest = rep * drop * 2 * (2 * a + 1)
    rest_k = 2 * drop
    if model.qk_norm:
        rest, rest_k = rest + 2 * a * tokens * (model.q_hidden_size + model.kv_hidden_size) / t, rest_k + 2
    routing_bytes, routing_kernels = _moe_routing_bytes(model, train, moe_tokens(tokens, t), plan.ep, plan.etp)
    rest, rest_k = rest + routing_bytes, rest_k + routing_kernels
    bias_bytes, bias_kernels = bias_grad_traffic(model, plan, tokens, a)
    return fwd_b + rest, fwd_k + rest_k, bwd_b + 2 * rest + bias_bytes, bwd_k + 2 * rest_k + bias_kernels


def _elementwise_s(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile, tokens: int,
                   cpu_kernels: bool, eager: bool, composite_norm: bool = False,
                   fused_projections: bool = False, qkv_bias_in_gemm: bool = False,
                   fp32_norms: bool = False) -> tuple[float, float]:
    """(forward, backward) of a layer's memory-bound work: counted op by op where eager kernels
    run it (torch's CPU kernels, cpu_kernels; a GPU's eager layer, its RMSNorm fused or, with
    composite_norm, op by op; fused_projections and fp32_norms: eager_elementwise_traffic's), else
    as fused kernels; `qkv_bias_in_gemm`: bias_grad_traffic's qkv_in_gemm for the fused ones."""
    if cpu_kernels or eager:
        fwd_b, fwd_k, bwd_b, bwd_k = eager_elementwise_traffic(
            model, train, plan, tokens, CPU_ELEMENT_BYTES if cpu_kernels else train.compute_dtype.num_bytes,
            cpu=cpu_kernels, composite_norm=composite_norm, fused_projections=fused_projections,
            fp32_norms=fp32_norms and not cpu_kernels)
        return memory_bound_s(fwd_b, dev, fwd_k), memory_bound_s(bwd_b, dev, bwd_k)
    fwd_b, fwd_k, bwd_b, bwd_k = _fused_elementwise(model, train, plan, tokens, qkv_bias_in_gemm)
    return memory_bound_s(fwd_b, dev, fwd_k), memory_bound_s(bwd_b, dev, bwd_k)


# The fp32 loss's passes over its logits, bytes an element (a row of a large vocabulary does not
# stay on chip between passes): forward, torch's log-softmax reads the row for its max, again for
# its sum of exponentials, a third time to write the result (3 x 4 + 4); backward, the NLL
# gradient's zero-filled fp32 tensor (4), then log-softmax's backward reads the gradient for its
# sum, the gradient and the output again, and writes (3 x 4 + 4). Megatron's vocab-parallel loss
# moves about as much in other kernels (max, subtract, exp, sum and divide in place; the
# gradient scaled in place). On an H200, 8192 x 131,072 logits from bf16 take 15.35 ms forward and
# backward, which these 48 bytes an element with the casts at 3.4 TB/s account for
# (`python benchmarks/gemm_shapes.py --kind loss` measures it, `--replay` prices it).
SOFTMAX_FWD_BYTES, SOFTMAX_BWD_BYTES = 16, 20


def cross_entropy_s(tokens: int, vocab: int, train: TrainSpec, dev: DeviceProfile, fused: bool = False) -> float:
    """The loss over `vocab` logits per token, forward or backward (their mean): the cast from a
    16-bit compute dtype to fp32 and back (read a, write 4 bytes; none in fp32, where `.float()`
    is the tensor itself), then the fp32 log-softmax and its gradient (SOFTMAX_FWD_BYTES and
    SOFTMAX_BWD_BYTES; two kernels forward, three backward). The softmax runs fp32 kernels
    whatever the compute dtype (fp32's per-kernel cost), and both are vectorised kernels of the
    kind a measured memory curve times, so they are priced at the curve itself: the probes'
    fitted memory factor (a small fraction of the curve on a CPU) also carries what a step spends
    between kernels, and would price a large vocabulary's loss several times too slow. fused
    (frameworks `fused_cross_entropy`): one kernel over the logits in the compute dtype, forward
    reading them, backward reading them and writing the gradient."""
    a = train.compute_dtype.num_bytes
    if fused:
        return memory_bound_s(tokens * vocab * 1.5 * a, dev.for_dtype(train.compute_dtype), 1, native=True)
    elements = tokens * vocab
    fp32 = dev.for_dtype(DType.FP32)
    softmax = (memory_bound_s(elements * SOFTMAX_FWD_BYTES, fp32, 2, native=True)
               + memory_bound_s(elements * SOFTMAX_BWD_BYTES, fp32, 3, native=True)) / 2
    if a >= 4:
        return softmax
    return softmax + memory_bound_s(elements * (a + 4), dev.for_dtype(train.compute_dtype), 1, native=True)
