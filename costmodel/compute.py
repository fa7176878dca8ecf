"""Compute time of one layer (and of the embedding, LM head, optimizer) on one device.

Each kernel is priced by the roofline (Williams et al. 2009): the larger of FLOPs over the
achievable FLOP/s and bytes over the achievable memory bandwidth, plus a fixed per-kernel cost
(launch and wave tail), which is what makes small GEMMs and many small kernels inefficient.
Achievable rates are datasheet peak x the profile's fitted efficiencies, or, where the profile
was measured (`planner profile`), the measured rate at that size: FLOP/s interpolated by FLOPs
per GEMM call, bytes/s by bytes per memory-bound kernel (log-linear between measured sizes,
flat beyond them), times the same efficiencies (1 unless calibrated). Measured rates include the
bare call's cost; a measured profile's kernel overhead is what training adds per kernel (autograd,
module calls, hooks), 0 until `planner calibrate` fits it.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, replace
from functools import lru_cache, wraps

from costmodel.cluster import ClusterSpec, DeviceProfile
from costmodel.flops import final_linear
from costmodel.layout import Linear, Style, dense_blocks
from costmodel.params import ceil_div
from costmodel.plan import Plan
from typing import Protocol
from costmodel.specs import AttentionKernel, DType, FfnKind, ModelSpec, NormKind, Optimizer, PositionKind, TrainSpec

class KernelShape(Protocol):
    """What kernel times depend on (a Plan has these, and so does the search's cache key)."""

    tp: int
    cp: int
    ep: int
    sequence_parallel: bool
    micro_batch_size: int
    fp8_linears: bool


FLASH_BACKWARD_FACTOR = 2.5  # FlashAttention-2 (Dao 2023): 5 matmuls backward vs 2 forward
CAUSAL_FRACTION = 0.5        # a causal flash kernel skips the masked upper triangle
# A flash kernel walks each 128-row query tile along the key tiles; each query tile also pays a
# fixed cost (load Q, rescale, write O) worth FLASH_TILE_COST_TOKENS key columns. Fitted to the
# forward TFLOP/s of FlashAttention-2 (c = 1.90 tiles) and FlashAttention-3 (1.83) over sequence
# lengths 512-16k on an H100 at head dim 128 and batch x seq fixed (pytorch/benchmark ff65cb67,
# D60117034): each within 1 % at its own cost; at the shared 1.9 tiles FA2 within 1 % and FA3 2 %
# (tests/costmodel/test_attention_tiles.py), e.g. FA2 329 TFLOP/s at 512, 458 at 4k, 477 at 16k.
FLASH_TILE = 128
FLASH_TILE_COST_TOKENS = 1.9 * FLASH_TILE


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelTimes:
    """Seconds for one micro-batch through one layer on one device (no communication)."""

    forward_s: float
    backward_input_s: float   # dX (and everything without weights, e.g. attention core)
    backward_weight_s: float  # dW of the projections
    attention_forward_s: float  # the part selective recomputation re-runs
    # what a full recomputation re-runs: the forward, less what torch's early stop skips
    # (`final_linear_forward_s`) where the framework stops early; the forward elsewhere
    recompute_forward_s: float

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s


def roofline_s(flops: float, num_bytes: float, dev: DeviceProfile, peak: float, eff: float,
               num_kernels: int = 1) -> float:
    return (max(flops / (peak * eff), num_bytes / (dev.memory_bandwidth_bytes_per_s * dev.efficiency.memory))
            + num_kernels * dev.efficiency.kernel_overhead_s)


def interpolate(curve: tuple[tuple[float, float], ...], x: float) -> float:
    """Log-linear in x between measured points, the end values beyond them."""
    if x <= curve[0][0]:
        return curve[0][1]
    if x >= curve[-1][0]:
        return curve[-1][1]
    i = bisect_left(curve, (x, -math.inf))
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 0.0
    return y0 + w * (y1 - y0)


def memory_bound_s(num_bytes: float, dev: DeviceProfile, num_kernels: int, native: bool = False) -> float:
    """native: vectorised kernels of the kind a measured memory curve times (softmax, RMS norm,
    add: runtime.profiler.memory_points), priced at the curve itself; the fitted memory factor
    is what a training step's other memory-bound work adds to it. Without a curve every kernel
    gets the profile's share of the bandwidth."""
    if dev.memory_curve and num_bytes > 0:
        per_kernel = num_bytes / num_kernels
        factor = 1.0 if native else dev.efficiency.memory
        return num_kernels * (per_kernel / (interpolate(dev.memory_curve, per_kernel) * factor)
                              + dev.efficiency.kernel_overhead_s)
    return roofline_s(0.0, num_bytes, dev, 1.0, 1.0, num_kernels)


def compute_bound_s(flops: float, num_bytes: float, dev: DeviceProfile, train: TrainSpec, eff: float,
                    num_kernels: int = 1) -> float:
    """A GEMM-like kernel: the measured rate at its size when profiled, else the roofline."""
    curve = dev.gemm_curve(train.compute_dtype)
    if curve:
        per_kernel = flops / num_kernels
        return num_kernels * (per_kernel / (interpolate(curve, per_kernel) * eff)
                              + dev.efficiency.kernel_overhead_s)
    return roofline_s(flops, num_bytes, dev, dev.peak_for(train.compute_dtype), eff, num_kernels)


GEMM_TILE = 128  # output tile edge of the large cuBLAS/CUTLASS tensor-core kernels (128x128, 128x256)


def wave_efficiency(m: int, n: int, num_sms: int) -> float:
    """Wave quantisation (NVIDIA, "Matrix Multiplication Background User's Guide"): the output
    is cut into tiles, one per SM at a time; a last partial wave leaves SMs idle. 1 for a
    device with no SM count (measured curves already include it)."""
    if num_sms <= 0:
        return 1.0
    tiles = -(-m // GEMM_TILE) * -(-n // GEMM_TILE)
    waves = -(-tiles // num_sms)
    return tiles / (waves * num_sms)


def gemm_s(m: int, k: int, n: int, dev: DeviceProfile, train: TrainSpec) -> float:
    dev = dev.for_dtype(train.compute_dtype)
    a = train.compute_dtype.num_bytes
    eff = dev.efficiency.gemm * (1.0 if dev.gemm_curve(train.compute_dtype) else wave_efficiency(m, n, dev.num_sms))
    return compute_bound_s(2.0 * m * k * n, a * (m * k + k * n + m * n), dev, train, eff)


# A float8 cast of a bf16 tensor (costmodel.frameworks `float8_casts_fused`): (bytes moved per
# element, full-tensor kernels). torchao 0.18 eager: abs (2 + 2), max (2), to fp32 (2 + 4), times
# the scale (4 + 4), clamp (4 + 4), to float8 (4 + 1); fused: the amax read and the scaled cast.
FP8_CAST_EAGER = (33, 6)
FP8_CAST_FUSED = (5, 2)
FP8_MIN_DIM = 16   # torch._scaled_mm needs both GEMM dimensions of the weight divisible by 16


def fp8_gemm_s(m: int, k: int, n: int, dev: DeviceProfile) -> float:
    """A float8 GEMM (torch._scaled_mm): the fp8 peak at the device's GEMM efficiency and wave
    quantisation (no float8 GEMM was measured; the bf16 fraction is assumed to carry over),
    1-byte operands, a bf16 result."""
    eff = dev.efficiency.gemm * wave_efficiency(m, n, dev.num_sms)
    return roofline_s(2.0 * m * k * n, m * k + k * n + 2 * m * n, dev, dev.peak_for("fp8"), eff)


def _cast_s(elements: int, dev: DeviceProfile, fused: bool) -> float:
    per_element, kernels = FP8_CAST_FUSED if fused else FP8_CAST_EAGER
    return memory_bound_s(per_element * elements, dev, kernels)


def float8_linear(k: int, n: int) -> bool:
    """torchao converts a linear only when its weight's dimensions allow a float8 GEMM."""
    return k % FP8_MIN_DIM == 0 and n % FP8_MIN_DIM == 0


def _local_shape(lin: Linear, tp: int) -> tuple[int, int]:
    """(k, n) of a projection's GEMM on one TP rank: a column-parallel one splits its outputs,
    a row-parallel one its inputs (costmodel.layout)."""
    if lin.style is Style.COLWISE:
        return lin.in_features, ceil_div(lin.out_features, tp)
    return ceil_div(lin.in_features, tp), lin.out_features


def _linears_s(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile, tokens: int,
               fused_casts: bool) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of the layer's GEMMs. Float8 linears
    (plan.fp8_linears) run each GEMM at the fp8 rate and pay their operands' casts: input and
    weight forward; output gradient and weight for the input gradient; output gradient and input
    for the weight gradient, where eager torchao casts again (fused: the forward's are reused)."""
    moe = _moe_gemms_s(model, train, dev, moe_tokens(tokens, plan.tp), plan.ep)
    fwd = bwd_in = bwd_w = moe
    for block in dense_blocks(model):
        for lin in block.linears:
            k, n = _local_shape(lin, plan.tp)
            if not (plan.fp8_linears and float8_linear(k, n)):
                t = gemm_s(tokens, k, n, dev, train)
                fwd, bwd_in, bwd_w = fwd + t, bwd_in + t, bwd_w + t
                continue
            g = fp8_gemm_s(tokens, k, n, dev)
            x, w, dy = (_cast_s(e, dev, fused_casts) for e in (tokens * k, k * n, tokens * n))
            fwd += g + x + w
            bwd_in += g + dy + (0.0 if fused_casts else w)
            bwd_w += g + (0.0 if fused_casts else dy + x)
    return fwd, bwd_in, bwd_w


def final_linear_forward_s(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile,
                           tokens: int) -> float:
    """The forward GEMM of the layer's last projection (row-parallel: its input split over TP),
    which a recomputation that stops early skips (costmodel.flops.stops_before_final_linear);
    the residual add it also skips (one memory-bound kernel) is left in the price."""
    return gemm_s(tokens, *_local_shape(final_linear(model), plan.tp), dev, train)


def flash_tile_efficiency(seq_len: int) -> float:
    """A causal flash kernel's useful share of its tile work at this sequence length (n tiles of
    FLASH_TILE): query tile i computes i + 1 key tiles, the diagonal one half masked, plus its
    fixed cost c (FLASH_TILE_COST_TOKENS / FLASH_TILE), so n²/2 useful of n(n+1)/2 + n·c:
    n / (n + 1 + 2c). 0.77 at 2k, 0.87 at 4k, 0.98 at 32k. Context parallelism that gathers the
    keys keeps the whole sequence's (each rank's queries see as many keys on average); a ring
    runs one kernel per hop over s/cp keys, each paying the tile cost: s/cp's."""
    return seq_len / (seq_len + FLASH_TILE + 2 * FLASH_TILE_COST_TOKENS)


def _attention_core_s(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile,
                      cp_ring: bool, cpu_kernels: bool = False) -> tuple[float, float]:
    """(forward, backward) of scores, softmax and weighted sum for local heads and queries
    (context parallelism: against the keys before them; a ring merges partial outputs). On a GPU
    the profile's attention efficiency is a long sequence's, times the tile efficiency at this
    one (flash_tile_efficiency). On a CPU whose profile timed SDPA (planner profile), torch's
    SDPA as the runtime calls it is priced at those times (_measured_sdpa_s); without them a CPU's
    flash kernel is priced at the profile's attention ratio to its GEMM curve."""
    b, heads, d = plan.micro_batch_size, model.num_heads // plan.tp, model.head_dim
    s_q, s_k, a = train.seq_len // plan.cp, train.seq_len, train.compute_dtype.num_bytes
    flops = 4.0 * b * heads * s_q * s_k * d
    flash = train.attention_kernel is AttentionKernel.FLASH
    if flash and cpu_kernels and dev.sdpa_curve(train.compute_dtype, model.dropout, False):
        return _measured_sdpa_s(model, train, plan, dev, cp_ring)
    # torch's CPU SDPA with dropout leaves the flash kernel for the math path (costmodel.frameworks
    # `cpu_kernels`; costmodel.memory keeps its scores alike)
    math_path = model.dropout and cpu_kernels
    if flash and not math_path:
        tiled = s_k // plan.cp if cp_ring else s_k
        eff = dev.efficiency.attention * (flash_tile_efficiency(tiled) if dev.kind == "gpu" else 1.0)
        fwd = compute_bound_s(flops * CAUSAL_FRACTION, a * 4 * b * heads * s_q * d, dev, train, eff)
        bwd = compute_bound_s(flops * CAUSAL_FRACTION * FLASH_BACKWARD_FACTOR, a * 8 * b * heads * s_q * d,
                              dev, train, eff)
        merge = _ring_merge_s(plan, b * heads * s_q * d, dev) if cp_ring else 0.0
        return fwd + merge, bwd + 2 * merge   # a GPU's flash kernel draws any dropout inside it
    scores = b * heads * s_q * s_k
    matmuls = compute_bound_s(flops, a * (2 * scores + 4 * b * heads * s_q * d), dev, train,
                              dev.efficiency.gemm, 2)
    drop = 1 if model.dropout else 0
    softmax_fwd = memory_bound_s(scores * (2 * a + drop * (2 * a + 1)), dev, 1 + drop)
    softmax_bwd = memory_bound_s(scores * (3 * a + drop * (2 * a + 1)), dev, 1 + drop)
    # the mask over the scores the runtime computes: with CP, each chunk against the keys before it
    dropped = b * heads * rank_scores(train, plan, cp_ring)
    return matmuls + softmax_fwd + dropout_s(drop * dropped, dev), 2 * matmuls + softmax_bwd


def sdpa_head_s(points: tuple[tuple[float, float, float], ...], seq_len: float, head_dim: int) -> float:
    """Seconds of one head's causal SDPA call over `seq_len` queries and keys, from a CPU
    profile's measured points (sequence, head dim, seconds per head: runtime.profiler.sdpa_curves).
    A call's time is its heads' (batch x heads) times this: one thread runs them one by one.
    Per query-key pair the time falls with the sequence (the kernel's per-block and per-row work
    amortised) and rises with the head dim less than in proportion: bf16's backward at seq 128
    took 26-29 ns a pair at head dim 16 and 30-32 at 64, fp32's 4.7-5.4 and 12.7-14.3, and at seq
    512 bf16's 4.9 and 9.6 (one thread, 2-core EPYC, 2026-11-27 23:08: `python
    benchmarks/cpu_kernels.py --only 8`).
    So a sequence's per-pair time is read along its measured head dims (_per_pair_at), then
    log-linear in the sequence between measured ones, the longest's beyond it, and below the
    shortest that one's whole call (its time there is mostly the call's own cost)."""
    per_pair = _per_pair_by_seq(points, head_dim)
    shortest = per_pair[0][0]
    if seq_len < shortest:
        return per_pair[0][1] * shortest * shortest
    return interpolate(per_pair, seq_len) * seq_len * seq_len


@lru_cache(maxsize=256)
def _per_pair_by_seq(points: tuple[tuple[float, float, float], ...], head_dim: int) -> tuple[tuple[float, float], ...]:
    """(sequence, seconds per pair at `head_dim`), sorted: a search prices the same few shapes often."""
    by_seq: dict[float, list[tuple[float, float]]] = {}
    for s, d, t in points:
        by_seq.setdefault(s, []).append((d, t / (s * s)))
    return tuple((s, _per_pair_at(sorted(dims), head_dim)) for s, dims in sorted(by_seq.items()))


def _per_pair_at(dims: list[tuple[float, float]], head_dim: float) -> float:
    """One sequence's per-pair time at `head_dim` from its (head dim, per pair) points, sorted:
    linear between measured dims; beyond the largest along the last two (no less than the
    largest's); below the smallest along the first two, never under the smallest's time in
    proportion to the dim. One dim measured (a version-2 profile): in proportion."""
    d0, p0 = dims[0]
    if len(dims) == 1 or head_dim <= d0:
        proportional = p0 * head_dim / d0
        if len(dims) == 1:
            return proportional
        (d1, p1) = dims[1]
        return max(p0 + (head_dim - d0) * (p1 - p0) / (d1 - d0), proportional)
    i = min(bisect_left([d for d, _ in dims], head_dim), len(dims) - 1)
    (da, pa), (db, pb) = dims[i - 1], dims[i]
    line = pa + (head_dim - da) * (pb - pa) / (db - da)
    return line if head_dim <= db else max(line, pb)


# A CPU SDPA call with dropout runs torch's math path: the scale, the scores, the mask, the
# softmax, the dropout and the weighted sum, each an autograd node that training's per-kernel cost
# applies to; without, one flash call.
SDPA_MATH_KERNELS = 6


def _measured_sdpa_s(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile,
                     cp_ring: bool) -> tuple[float, float]:
    """(forward, backward) of the attention core on a CPU, at the profile's measured SDPA times
    for this dtype and dropout (with dropout the math path, whose draw over the scores is in the
    measurement), at each call's sequence and head dim (sdpa_head_s), plus training's per-kernel
    cost (the only fitted figure here; the compute factor does not move it). Context
    parallelism's calls are its chunks' rectangles under a lower-right mask (cp_chunk_scores, two
    calls a rank), priced as the causal square of as many query-key pairs, though a masked call
    computes every pair: measured, each rank's two calls at cp 2, seq 256, took 0.31-0.54 of the
    causal square's time without dropout (bf16's backward the most) and 0.21-0.42 with, against
    0.31 of its pairs (one thread, fp32 and bf16, 2-core EPYC, 2026-11-27 15:18: `python
    benchmarks/cpu_kernels.py --only 6`)."""
    b, heads, d = plan.micro_batch_size, model.num_heads // plan.tp, model.head_dim
    calls = plan.cp if cp_ring else (1 if plan.cp == 1 else 2)
    square = math.sqrt(rank_scores(train, plan, cp_ring) / calls)   # the causal call of as many pairs
    kernels = calls * (SDPA_MATH_KERNELS if model.dropout else 1)
    overhead = kernels * dev.efficiency.kernel_overhead_s

    def timed(backward: bool) -> float:
        points = dev.sdpa_curve(train.compute_dtype, model.dropout, backward)
        return calls * b * heads * sdpa_head_s(points, square, d) + overhead
    merge = _ring_merge_s(plan, b * heads * (train.seq_len // plan.cp) * d, dev) if cp_ring else 0.0
    return timed(False) + merge, timed(True) + 2 * merge


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
    erf, tanh's 1.7-2.0 ns an element forward and 2.1-2.3 backward against an add's 0.14-0.2;
    none where a profile has none, as datasheets and GPUs, whose GeLU is memory-bound). The memory-bound count keeps its
    bytes too, about a tenth of this counted twice; priced as those bytes alone, a GeLU MLP's
    activation was 5-10x too cheap on a CPU (`python benchmarks/cpu_kernels.py --only 5`)."""
    rates = {k: (f, b) for k, f, b in dev.gelu_s_per_element}
    if model.ffn_kind not in GELU_OF or GELU_OF[model.ffn_kind] not in rates:
        return 0.0, 0.0
    forward, backward = rates[GELU_OF[model.ffn_kind]]
    elements = tokens * _mlp_width(model) / plan.tp
    return elements * forward, elements * backward


def rank_scores(train: TrainSpec, plan: KernelShape, cp_ring: bool) -> float:
    """Query-key pairs one head of one sample computes on the busiest rank: a ring's cp hops of
    s/cp queries against s/cp keys, else the load-balanced chunks against the keys before them."""
    return train.seq_len * train.seq_len / plan.cp if cp_ring else cp_chunk_scores(train.seq_len, plan.cp)


def cp_chunk_scores(seq_len: int, cp: int) -> float:
    """Scores one head of one sample computes on the busiest rank of load-balanced context
    parallelism (runtime.context_parallel): chunks r and 2cp-1-r of c = s/2cp queries, each against
    the keys up to its end, c·(r+1)c + c·(2cp-r)c = c²(2cp+1) for any r > 0. s² without CP."""
    if cp == 1:
        return float(seq_len * seq_len)
    c = seq_len / (2 * cp)
    return c * c * (2 * cp + 1)


def _ring_merge_s(plan: KernelShape, output_elems: int, dev: DeviceProfile) -> float:
    """Context parallelism runs attention as cp partial kernels, one per ring hop (Liu et al.
    2023), and folds each partial output into the running one with its softmax statistics: a
    memory-bound pass over the fp32 output (read both, write one) and one more kernel per hop."""
    hops = plan.cp - 1
    return hops * memory_bound_s(3 * 4 * output_elems, dev, 2) if hops else 0.0


def moe_tokens(tokens: int, tp: int) -> int:
    """Tokens a device's mixture of experts routes, of the `tokens` its layer sees: under tensor
    parallelism (with sequence parallelism: check.moe_tp_problem) the mixture is whole on each
    TP rank and routes that rank's sequence shard (runtime.parallel)."""
    return tokens // tp


def expert_rows(model: ModelSpec, train: TrainSpec, tokens: int, ep: int) -> float:
    """Routed rows the busiest device's experts take in one layer, from `tokens` tokens on each
    device: tokens·k on average (each device sends its tokens·k rows over the EP group and gets
    as many back), times the stated imbalance under expert parallelism (on one device the
    balance changes the GEMMs' sizes, not their sum)."""
    return tokens * model.experts_per_token * (train.expert_load_imbalance if ep > 1 else 1.0)


def _moe_gemms_s(model: ModelSpec, train: TrainSpec, dev: DeviceProfile, tokens: int, ep: int) -> float:
    """A mixture's GEMMs as runtime.moe runs them (never split over TP): the router, then for
    each of the device's num_experts/ep experts three GEMMs over the rows routed to it, and the
    shared expert with its gate."""
    if not model.is_moe:
        return 0.0
    h, f, fs = model.hidden_size, model.moe_ffn_hidden_size, model.shared_expert_ffn_hidden_size
    local = model.num_experts // ep
    rows = max(1, round(expert_rows(model, train, tokens, ep) / local))
    total = gemm_s(tokens, h, model.num_experts, dev, train)
    total += local * (2 * gemm_s(rows, h, f, dev, train) + gemm_s(rows, f, h, dev, train))
    if fs:
        total += 2 * gemm_s(tokens, h, fs, dev, train) + gemm_s(tokens, fs, h, dev, train)
    if model.shared_expert_gate:
        total += gemm_s(tokens, h, 1, dev, train)
    return total


def _moe_routing_bytes(model: ModelSpec, train: TrainSpec, tokens: int, ep: int) -> tuple[float, int]:
    """(bytes, kernels) of a mixture's memory-bound work: the fp32 softmax and top-k over the
    router logits; the gather of the routed rows in expert order, the weighting and the
    scatter-add of their outputs (each a read and a write of k·tokens·h); under expert
    parallelism also the received rows' reorder by local expert and back; per local expert
    the gather and scatter of its rows."""
    if not model.is_moe:
        return 0.0, 0
    a, routed = train.compute_dtype.num_bytes, tokens * model.experts_per_token
    num_bytes = 3 * 4 * tokens * model.num_experts + 3 * 2 * a * routed * model.hidden_size
    kernels = 3 + 4 * (model.num_experts // ep)
    if ep > 1:
        num_bytes += 2 * 2 * a * expert_rows(model, train, tokens, ep) * model.hidden_size
        kernels += 2
    return num_bytes, kernels


def _elementwise_forward_s(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile,
                           tokens: int) -> float:
    """Norms, residual adds, dropout, activation function and RoPE: bytes read + written, as
    fused kernels run them (Megatron-Core, Transformer Engine, compiled code).
    Without sequence parallelism every TP rank repeats the norms/adds/dropout on all tokens."""
    num_bytes, kernels = _fused_elementwise(model, train, plan, tokens)
    return memory_bound_s(num_bytes, dev, kernels)


def rank_hidden_elements(model: ModelSpec, plan: KernelShape, tokens: int) -> float:
    """A layer's hidden states on one TP rank, what its norms, residual adds and dropouts run
    over: every token's without sequence parallelism (each TP rank repeats them), its 1/tp shard
    with it."""
    return tokens * model.hidden_size / (plan.tp if plan.sequence_parallel else 1)


def _fused_elementwise(model: ModelSpec, train: TrainSpec, plan: KernelShape, tokens: int) -> tuple[float, int]:
    a, t = train.compute_dtype.num_bytes, plan.tp
    rep = rank_hidden_elements(model, plan, tokens)
    drop = 1 if model.dropout else 0
    num_bytes = rep * (model.layer_norms * 2 * a + 2 * 3 * a + drop * 2 * (2 * a + 1))
    acts = 3 if model.ffn_kind.gated else 2
    num_bytes += acts * a * tokens * _mlp_width(model) / t
    routing_bytes, routing_kernels = _moe_routing_bytes(model, train, moe_tokens(tokens, t), plan.ep)
    num_bytes += routing_bytes
    kernels = 5 + 2 * drop + routing_kernels
    if model.qk_norm:   # Qwen3's RMSNorm over each head's queries and keys
        num_bytes += 2 * a * tokens * (model.q_hidden_size + model.kv_hidden_size) / t
        kernels += 2
    if model.position_kind is PositionKind.ROPE:   # on the rotated share of each head's dimensions
        num_bytes += 2 * a * tokens * _rotated(model) / t
        kernels += 1
    return num_bytes, kernels


def _mlp_width(model: ModelSpec) -> int:
    """The activation function's width: the MLP's, or each routed expert's and the shared one's."""
    return (model.experts_per_token * model.moe_ffn_hidden_size + model.shared_expert_ffn_hidden_size
            if model.is_moe else model.ffn_hidden_size)


def _rotated(model: ModelSpec) -> float:
    """Elements of one token's queries and keys that RoPE rotates."""
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
# Torch's CPU kernels widen 16-bit elements to fp32 in registers: an element costs what an fp32
# one does (bf16 multiplies and SiLUs over 98K-1.5M elements take 0.7-1.5x the fp32 ones' time on
# a 2-core EPYC: `python benchmarks/cpu_kernels.py`), so elements are counted at fp32's width on
# the fp32-measured memory curve.
CPU_ELEMENT_BYTES = 4


# RMSNorm on CUDA (torch's fused kernels, `_fused_rms_norm`): forward reads and writes the
# activations once; backward reads input and output gradient and writes the input gradient, and
# a second kernel reads both again for the weight's gradient (profiled on an H100, 2026-11-26).
def _cuda_rms_norm(a: int) -> tuple[tuple[float, int], tuple[float, int]]:
    return (2 * a, 1), (5 * a, 2)


def eager_elementwise_traffic(model: ModelSpec, train: TrainSpec, plan: KernelShape, tokens: int,
                              a: int = CPU_ELEMENT_BYTES, cpu: bool = True) -> tuple[float, int, float, int]:
    """(forward bytes, kernels, backward bytes, kernels) of a layer's memory-bound work as torch's
    eager kernels run the runtime's layer (costmodel.frameworks `eager_layer`): RMSNorm (composite
    in fp32 on a CPU, fused on a GPU), RoPE and SwiGLU op by op, and the gradient sums autograd
    adds where one input feeds several projections. Parts the count does not cover (LayerNorm,
    dropout, GeLU, Q/K norms, routing) keep the fused count, their backward twice their forward.
    `a`: bytes per compute-dtype element (a CPU's pricing counts every element at fp32's width,
    CPU_ELEMENT_BYTES; the test counts the real bytes)."""
    t, c = plan.tp, 1 if train.compute_dtype.num_bytes < 4 else 0
    rep = rank_hidden_elements(model, plan, tokens)
    fwd_b = bwd_b = 0.0
    fwd_k = bwd_k = 0
    if model.norm_kind is NormKind.RMSNORM:
        (nf, kf), (nb, kb) = _cpu_rms_norm(a, c) if cpu else _cuda_rms_norm(a)
        fwd_b, fwd_k, bwd_b, bwd_k = model.layer_norms * nf * rep, model.layer_norms * kf, \
            model.layer_norms * nb * rep, model.layer_norms * kb
    else:
        fwd_b, fwd_k = model.layer_norms * 2 * a * rep, model.layer_norms
        bwd_b, bwd_k = 2 * fwd_b, 2 * fwd_k
    # residual adds, and backward the sums over projections that share an input (q/k/v, gate/up)
    shared = sum(sum(1 for lin in b.linears if lin.style is Style.COLWISE) - 1 for b in dense_blocks(model))
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
    routing_bytes, routing_kernels = _moe_routing_bytes(model, train, moe_tokens(tokens, t), plan.ep)
    rest, rest_k = rest + routing_bytes, rest_k + routing_kernels
    return fwd_b + rest, fwd_k + rest_k, bwd_b + 2 * rest, bwd_k + 2 * rest_k


def _per_kernel_shape(fn):
    """Called with a Plan and any profile; cached on the plan fields kernel times depend on and
    on the profile as the plan's compute dtype sees it (the search asks for the same shapes
    across many candidates). On a GPU, the host's and the device's times combined
    (_host_or_device) inside the cache: a hit costs one lookup, as on a CPU."""
    @lru_cache(maxsize=4096)
    def cached(model: ModelSpec, train: TrainSpec, key: "_KernelKey", dev: DeviceProfile, *how) -> KernelTimes:
        times = fn(model, train, key, dev, *how)
        if dev.kind == "cpu" or dev.efficiency.kernel_overhead_s <= 0:
            return times
        return _host_or_device(times, fn(model, train, key, _without_kernel_overhead(dev), *how))

    @wraps(fn)
    def by_plan(model: ModelSpec, train: TrainSpec, plan: Plan, dev: DeviceProfile, *how) -> KernelTimes:
        return cached(model, train, _KernelKey.of(plan), dev.for_dtype(train.compute_dtype), *how)
    return by_plan


def _host_or_device(both: KernelTimes, device: KernelTimes) -> KernelTimes:
    """A GPU runs its kernels while the host issues the next ones: each pass of a layer takes
    the longer of the device's work and the host's (kernels x the per-kernel cost), not their
    sum. On a CPU both are the same cores, and the sum stands. Measured on one H100
    (`python benchmarks/gpu_check.py`, 2026-11-26): a 0.85B model's step took 266 ms at 8K
    tokens and 276 ms at 16K, the host's floor, and 474 ms at 32K, the device's work; the sum
    had predicted 599, 839 and 1,253 ms."""
    def longer(name: str) -> float:
        gpu = getattr(device, name)
        return max(gpu, getattr(both, name) - gpu)
    return KernelTimes(forward_s=longer("forward_s"), backward_input_s=longer("backward_input_s"),
                       backward_weight_s=longer("backward_weight_s"),
                       attention_forward_s=longer("attention_forward_s"),
                       recompute_forward_s=longer("recompute_forward_s"))


@lru_cache(maxsize=64)
def _without_kernel_overhead(dev: DeviceProfile) -> DeviceProfile:
    return replace(dev, efficiency=replace(dev.efficiency, kernel_overhead_s=0.0),
                   dtype_efficiency=tuple((d, replace(e, kernel_overhead_s=0.0)) for d, e in dev.dtype_efficiency))


@dataclass(frozen=True, slots=True)
class _KernelKey:
    """The plan fields kernel times depend on: the search shares them across many candidates."""

    tp: int
    cp: int
    ep: int
    sequence_parallel: bool
    micro_batch_size: int
    fp8_linears: bool

    @classmethod
    def of(cls, plan: Plan) -> "_KernelKey":
        return cls(plan.tp, plan.cp, plan.ep, plan.sequence_parallel, plan.micro_batch_size, plan.fp8_linears)


@_per_kernel_shape
def layer_kernel_times(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile,
                       cp_ring: bool, fused_casts: bool = False, cpu_kernels: bool = False,
                       eager: bool = False, early_stop: bool = False) -> KernelTimes:
    """cp_ring: context parallelism as a ring of partial kernels (else all-gathered K/V,
    costmodel.frameworks `cp_all_gather_kv`); fused_casts: float8 casts as compiled or
    Transformer Engine kernels run them (`float8_casts_fused`); cpu_kernels: the runtime's eager
    layer on torch's CPU kernels (`cpu_kernels`), eager: on a GPU's (`eager_layer`); either way
    its memory-bound work is counted op by op. early_stop: a full recomputation stops before the
    layer's last projection (the caller's decision: the framework's `recompute_early_stop` where
    costmodel.flops.stops_before_final_linear lets it; final_linear_forward_s)."""
    tokens = plan.micro_batch_size * train.seq_len // plan.cp
    fwd, bwd_in, bwd_w = _linears_s(model, train, plan, dev, tokens, fused_casts)
    attn_fwd, attn_bwd = _attention_core_s(model, train, plan, dev, cp_ring, cpu_kernels)
    elementwise, elementwise_bwd = _elementwise_s(model, train, plan, dev, tokens, cpu_kernels, eager)
    # the two branches' dropout (runtime.model: after attention and after the MLP)
    dropped = 2 * rank_hidden_elements(model, plan, tokens) if model.dropout else 0
    gelu_fwd, gelu_bwd = gelu_s(model, plan, tokens, dev)
    forward = fwd + attn_fwd + elementwise + dropout_s(dropped, dev) + gelu_fwd
    skipped = final_linear_forward_s(model, train, plan, dev, tokens) if early_stop else 0.0
    return KernelTimes(forward_s=forward, backward_input_s=bwd_in + attn_bwd + elementwise_bwd + gelu_bwd,
                       backward_weight_s=bwd_w, attention_forward_s=attn_fwd,
                       recompute_forward_s=forward - skipped)


def _elementwise_s(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile, tokens: int,
                   cpu_kernels: bool, eager: bool) -> tuple[float, float]:
    """(forward, backward) of a layer's memory-bound work: counted op by op where eager kernels
    run it (torch's CPU kernels, cpu_kernels; a GPU's eager layer), else as fused kernels."""
    if cpu_kernels or eager:
        fwd_b, fwd_k, bwd_b, bwd_k = eager_elementwise_traffic(
            model, train, plan, tokens, CPU_ELEMENT_BYTES if cpu_kernels else train.compute_dtype.num_bytes,
            cpu=cpu_kernels)
        return memory_bound_s(fwd_b, dev, fwd_k), memory_bound_s(bwd_b, dev, bwd_k)
    forward = _elementwise_forward_s(model, train, plan, dev, tokens)
    return forward, 2 * forward


LAYER_KINDS = ("gemm", "sdpa", "memory")   # layer_parts_s's kinds, as runtime.layer_ops times them


def layer_parts_s(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile) -> dict[str, float]:
    """A layer's forward and backward on a CPU's eager kernels (layer_kernel_times with
    cpu_kernels) priced at the profile's curves alone, by the kind of kernel runtime.layer_ops
    times: its GEMMs at the GEMM curve ("gemm"), its SDPA calls at their measured points
    ("sdpa"), its memory-bound kernels at the memory curve ("memory"); no efficiency factor, no
    per-kernel cost. What the factors scale, so a measured layer's seconds per kind over these
    are its kinds' in-training shares of their curves (planner.probes.layer_factors). A GeLU's
    or dropout's measured per-element cost is in no kind: the probes' layer has neither."""
    dev = dev.for_dtype(train.compute_dtype)
    bare = replace(dev, efficiency=replace(dev.efficiency, gemm=1.0, memory=1.0, kernel_overhead_s=0.0))
    tokens = plan.micro_batch_size * train.seq_len // plan.cp
    fwd, bwd_in, bwd_w = _linears_s(model, train, plan, bare, tokens, False)
    attn_fwd, attn_bwd = _attention_core_s(model, train, plan, bare, False, True)
    elementwise, elementwise_bwd = _elementwise_s(model, train, plan, bare, tokens, True, False)
    return {"gemm": fwd + bwd_in + bwd_w, "sdpa": attn_fwd + attn_bwd, "memory": elementwise + elementwise_bwd}


@_per_kernel_shape
def head_kernel_times(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile,
                      cpu_kernels: bool = False) -> KernelTimes:
    """Final norm, output projection (vocab-parallel) and cross entropy (fp32 softmax);
    cpu_kernels: the norm as torch's CPU composite runs it (layer_kernel_times)."""
    tokens = plan.micro_batch_size * train.seq_len // plan.cp
    vocab = ceil_div(model.vocab_size, plan.tp)
    proj = gemm_s(tokens, model.hidden_size, vocab, dev, train)
    a = train.compute_dtype.num_bytes
    loss = cross_entropy_s(tokens, vocab, train, dev)
    elems = tokens * model.hidden_size
    if cpu_kernels and model.norm_kind is NormKind.RMSNORM:
        (nf, kf), (nb, kb) = _cpu_rms_norm(CPU_ELEMENT_BYTES, 1 if a < 4 else 0)
        norm, norm_bwd = memory_bound_s(nf * elems, dev, kf), memory_bound_s(nb * elems, dev, kb)
    else:
        norm = memory_bound_s(2 * a * elems, dev, 1)
        norm_bwd = 2 * norm
    return KernelTimes(forward_s=proj + loss + norm, backward_input_s=proj + loss + norm_bwd,
                       backward_weight_s=proj, attention_forward_s=0.0, recompute_forward_s=0.0)


def cross_entropy_s(tokens: int, vocab: int, train: TrainSpec, dev: DeviceProfile) -> float:
    """The loss over `vocab` logits per token, forward or backward (their mean): the cast from a
    16-bit compute dtype to fp32 and back (read a, write 4 bytes; none in fp32, where `.float()`
    is the tensor itself), then the fp32 log-softmax and its gradient (12 bytes, two kernels).
    The softmax runs fp32 kernels whatever the compute dtype (fp32's per-kernel cost), and both
    are vectorised kernels of the kind a measured memory curve times, so they are priced at the
    curve itself: the probes' fitted memory factor (0.05-0.2 of the curve on a CPU) had priced the
    closed loop's 6,000-word loss at 11-18 ms a micro-batch against 3-4 ms measured
    (`python benchmarks/cpu_kernels.py`)."""
    a = train.compute_dtype.num_bytes
    softmax = memory_bound_s(tokens * vocab * 3 * 4, dev.for_dtype(DType.FP32), 2, native=True)
    if a >= 4:
        return softmax
    return softmax + memory_bound_s(tokens * vocab * (a + 4), dev.for_dtype(train.compute_dtype), 1, native=True)


@_per_kernel_shape
def embedding_kernel_times(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile) -> KernelTimes:
    """Lookup (a gather) forward, scatter-add of the gradient backward: memory-bound. torch's
    embedding backward (`embedding_dense_backward`, as nn.Embedding and the vocab-parallel one
    run it) first zero-fills a dense gradient of the rank's whole vocabulary shard, every
    micro-batch, however few tokens it saw: on a small model that table, not the tokens, is
    the backward's traffic."""
    tokens = plan.micro_batch_size * train.seq_len // plan.cp
    num_bytes = 2 * train.compute_dtype.num_bytes * tokens * model.hidden_size
    fwd = memory_bound_s(num_bytes, dev, 1)
    table_s = memory_bound_s(train.compute_dtype.num_bytes * ceil_div(model.vocab_size, plan.tp) * model.hidden_size,
                             dev, 1)
    # the embeddings' dropout (runtime.model) on every token: GPT, the only family with dropout,
    # adds learned positions first, and sequence parallelism shards the sum after its dropout
    # (runtime.parallel); a family that sharded before it would drop 1/tp of these
    dropout_fwd_s = dropout_s(tokens * model.hidden_size if model.dropout else 0, dev)
    return KernelTimes(forward_s=fwd + dropout_fwd_s, backward_input_s=0.0, backward_weight_s=2 * fwd + table_s,
                       attention_forward_s=0.0, recompute_forward_s=0.0)


def host_optimizer_step_s(num_params: float, train: TrainSpec, cluster: ClusterSpec) -> float:
    """The optimizer step of offloaded states on the host (Plan.offload_optimizer), as the
    runtime runs it: torch's fused CPU AdamW over the fp32 shard reads master, moments and
    gradient and writes master and moments (no 16-bit copy: FSDP2 casts on the next gather, no
    clip). Memory-bound on the host's DRAM, which every device of the node shares: they step at
    once. (`python benchmarks/host_adamw.py`, 2026-11-25, 2 threads of a 2-core EPYC: fused
    AdamW 0.25-0.41 ns per parameter, 69-112 GB/s at this count; foreach 2.3-7.0 ns, which is why
    offload uses the fused one.)"""
    states = 3 * 4 if train.optimizer is Optimizer.ADAMW else 4
    per_param = 2 * states + 4
    return num_params * per_param / cluster.host_stream_bytes_per_s("an offloaded optimizer step")


def step_host_s(train: TrainSpec, dev: DeviceProfile) -> float:
    """The step's own host work, once per step (Efficiency.step_overhead_s), fitted by the probes:
    on an H100 at the fit's 1 us floor in fp32 and 4.4 ms in bf16 (`python benchmarks/gpu_check.py
    --replay benchmarks/results/gpu-check-h100-2026-11-26 --profile
    benchmarks/results/gpu-check-h100-2026-11-26/run2/gpu.toml`), 2.7-25 ms on a 2-core CPU (the
    closed-loop runs N-Q in the README); folded until then
    into the per-kernel cost, which priced a 0.85B model's host-bound GPU steps 14-29 % too slow."""
    return dev.for_dtype(train.compute_dtype).efficiency.step_overhead_s


def gradient_add_s(num_params: float, incoming: DType, accumulator: DType, num_tensors: float,
                   dev: DeviceProfile) -> float:
    """One micro-batch's gradients of `num_params` parameters in `num_tensors` tensors added in
    place into the step's (one kernel per tensor): at the profile's measured rate where the
    accumulator is fp32 and the new gradients' dtype was measured, else as traffic (read both,
    write the sum) at the profile's bandwidth. Affine in both counts (the search's rank shapes
    rely on it), hence the bandwidth rather than the memory-bound curve at a size per tensor."""
    rate = dev.grad_accumulate_rate(incoming)
    if rate and accumulator is DType.FP32:
        return num_params * rate + _launches_s(num_tensors, dev)
    return _traffic_s(num_params * (incoming.num_bytes + 2 * accumulator.num_bytes), num_tensors, dev)


def gradient_cast_s(num_params: float, incoming: DType, accumulator: DType, num_tensors: float,
                    dev: DeviceProfile) -> float:
    """The first micro-batch's 16-bit gradients cast into a new fp32 accumulator (FSDP2's
    `unsharded_accumulated_grad`): read one, write the other, at the profile's bandwidth."""
    return _traffic_s(num_params * (incoming.num_bytes + accumulator.num_bytes), num_tensors, dev)


# FSDP2's own passes over a unit's parameters where its group has one rank, bytes per parameter
# by the compute dtype's width w: the reduce copies the gradients into its fp32 flat buffer and
# out into the fp32 sharded gradients (read and write each: 16); the gather casts the fp32 shard
# into the all-gather's input (4 + w; no cast in fp32) and, with no all-gather on one rank, copies
# it into the output the parameters view (2w) (torch 2.13's _fsdp_param_group)
FSDP_SYNC_BYTES = {"reduce": lambda w: 16, "gather": lambda w: 2 * w + (4 + w if w < 4 else 0)}


def fsdp_sync_s(kind: str, num_params: float, compute: DType, num_tensors: float, dev: DeviceProfile) -> float:
    """One FSDP2 reduce or gather ("reduce", "gather") of `num_params` parameters on a one-rank
    group (costmodel.frameworks `one_replica_fsdp`): at the profile's measured rate
    (`fsdp_sync_s_per_param`, runtime.profiler.fsdp_sync_s_per_param), else as its copies' traffic
    (FSDP_SYNC_BYTES) at the profile's bandwidth. On a 2-core Zen 5 EPYC the measured bf16 reduce
    ran 0.7-0.9 ns a parameter and the gather 0.35-0.5 (`python benchmarks/fsdp_sync_cost.py`,
    2026-11-28), where their 16 and 10 bytes at the profile's 32 GB/s come to 0.5 and 0.3: the
    traffic alone prices them fast."""
    rate = dev.fsdp_sync_rate(kind, compute)
    if rate is not None:
        return num_params * rate
    return _traffic_s(num_params * FSDP_SYNC_BYTES[kind](compute.num_bytes), num_tensors, dev)


def _traffic_s(num_bytes: float, num_tensors: float, dev: DeviceProfile) -> float:
    """Bytes at the profile's bandwidth (roofline_s), the tensors' launches apart (_launches_s)."""
    return roofline_s(0.0, num_bytes, dev, 1.0, 1.0, num_kernels=0) + _launches_s(num_tensors, dev)


def _launches_s(num_tensors: float, dev: DeviceProfile) -> float:
    """The per-kernel cost of one small kernel per tensor. On a GPU the host queues them during
    the backward pass while the device still computes, so they hide (as _host_or_device's
    longer of the two would have it); on a CPU the same cores run both."""
    return num_tensors * dev.efficiency.kernel_overhead_s if dev.kind == "cpu" else 0.0


def optimizer_step_s(num_params: float, train: TrainSpec, dev: DeviceProfile) -> float:
    """AdamW over the local (ZeRO-sharded) parameters: read master, moments and gradient, write
    master, moments and the 16-bit copy, plus one gradient read for the global-norm clip."""
    if dev.optimizer_s_per_param and train.optimizer is Optimizer.ADAMW:
        # measured on this machine as the runtime steps it (runtime.profiler): the memory-bound
        # curve's large kernels pay for fresh outputs (page faults on a CPU: 4-7x slower there)
        return num_params * dev.optimizer_s_per_param
    dev = dev.for_dtype(train.compute_dtype)
    g = train.grad_dtype.num_bytes
    states = 3 * 4 if train.optimizer is Optimizer.ADAMW else 4
    per_param = 2 * states + 2 * g + (train.compute_dtype.num_bytes if train.master_weights_fp32 else 0)
    return memory_bound_s(num_params * per_param, dev, 4)
