"""The attention core: flash kernels on GPUs, torch's SDPA as measured on CPUs, context
parallelism's chunked calls."""
from __future__ import annotations

import math
from bisect import bisect_left
from functools import lru_cache

from costmodel.hardware import DeviceProfile
from costmodel.kernels.elementwise import dropout_s
from costmodel.kernels.gemm import grouped_gemm_s
from costmodel.kernels.roofline import KernelShape, compute_bound_s, interpolate, memory_bound_s
from costmodel.specs import AttentionKernel, ModelSpec, TrainSpec

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


def flash_tile_efficiency(seq_len: int) -> float:
    """A causal flash kernel's useful share of its tile work at this sequence length (n tiles of
    FLASH_TILE): query tile i computes i + 1 key tiles, the diagonal one half masked, plus its
    fixed cost c (FLASH_TILE_COST_TOKENS / FLASH_TILE), so n²/2 useful of n(n+1)/2 + n·c:
    n / (n + 1 + 2c). 0.77 at 2k, 0.87 at 4k, 0.98 at 32k. Context parallelism that gathers the
    keys keeps the whole sequence's (each rank's queries see as many keys on average); a ring
    runs one kernel per hop over s/cp keys, each paying the tile cost: s/cp's."""
    return seq_len / (seq_len + FLASH_TILE + 2 * FLASH_TILE_COST_TOKENS)


def _attention_core_s(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile,
                      cp_ring: bool, cpu_kernels: bool = False, padded_values: bool = False) -> tuple[float, float]:
    """(forward, backward) of scores, softmax and weighted sum for local heads and queries
    (context parallelism: against the keys before them; a ring merges partial outputs). On a GPU
    the profile's attention efficiency is a long sequence's forward, times the tile efficiency at
    this one (flash_tile_efficiency); the backward runs at attention_backward_ratio of that. On a
    CPU whose profile timed SDPA (planner profile), torch's SDPA as the runtime calls it is priced
    at those times (_measured_sdpa_s); without them a CPU's flash kernel is priced at the
    profile's attention ratio to its GEMM curve. `padded_values`: values as wide as queries and
    keys (latent attention's, padded: runtime.latent_attention)."""
    b, heads, d = plan.micro_batch_size, model.num_heads // plan.tp, _head_dim(model, padded_values)
    s_q, s_k, a = train.seq_len // plan.cp, train.seq_len, train.compute_dtype.num_bytes
    flops = 4.0 * b * heads * s_q * s_k * d
    flash = train.attention_kernel is AttentionKernel.FLASH
    if flash and cpu_kernels and dev.sdpa_curve(train.compute_dtype, model.dropout, False):
        return _measured_sdpa_s(model, train, plan, dev, cp_ring, padded_values)
    # torch's CPU SDPA with dropout leaves the flash kernel for the math path (costmodel.frameworks
    # `cpu_kernels`; costmodel.memory keeps its scores alike)
    math_path = model.dropout and cpu_kernels
    if flash and not math_path:
        tiled = s_k // plan.cp if cp_ring else s_k
        eff = dev.efficiency.attention * (flash_tile_efficiency(tiled) if dev.kind == "gpu" else 1.0)
        fwd = compute_bound_s(flops * CAUSAL_FRACTION, a * 4 * b * heads * s_q * d, dev, train, eff)
        bwd = compute_bound_s(flops * CAUSAL_FRACTION * FLASH_BACKWARD_FACTOR, a * 8 * b * heads * s_q * d,
                              dev, train, eff * dev.efficiency.attention_backward_ratio)
        merge = _ring_merge_s(plan, b * heads * s_q * d, dev) if cp_ring else 0.0
        return fwd + merge, bwd + 2 * merge   # a GPU's flash kernel draws any dropout inside it
    scores = b * heads * s_q * s_k
    if dev.kind == "gpu" and not cpu_kernels and not dev.gemm_curve(train.compute_dtype):
        matmuls_fwd, matmuls_bwd = _batched_products_s(b * heads, s_q, s_k, int(d), dev, train)
    else:
        matmuls_fwd = compute_bound_s(flops, a * (2 * scores + 4 * b * heads * s_q * d), dev, train,
                                      dev.efficiency.gemm, 2)
        matmuls_bwd = 2 * matmuls_fwd
    drop = 1 if model.dropout else 0
    softmax_fwd = memory_bound_s(scores * (2 * a + drop * (2 * a + 1)), dev, 1 + drop)
    softmax_bwd = memory_bound_s(scores * (3 * a + drop * (2 * a + 1)), dev, 1 + drop)
    # the mask over the scores the runtime computes: with CP, each chunk against the keys before it
    dropped = b * heads * rank_scores(train, plan, cp_ring)
    return matmuls_fwd + softmax_fwd + dropout_s(drop * dropped, dev), matmuls_bwd + softmax_bwd


def _batched_products_s(heads: int, s_q: int, s_k: int, d: int, dev: DeviceProfile,
                        train: TrainSpec) -> tuple[float, float]:
    """(forward, backward) of eager attention's products on a GPU, each one strided-batched GEMM
    over the heads (torch.baddbmm / bmm, as Megatron's unfused path calls them): forward the
    scores Q·Kᵀ, which reduce over only the head dim, and P·V; backward dP = dO·Vᵀ (again over the
    head dim), dV = Pᵀ·dO, dQ = dS·K and dK = dSᵀ·Q. A reduction as short as a head (64-128) pays
    the tile's fixed cost nearly as often as its multiply-adds (gemm.tile_efficiency), so these
    products run well under the rate of a layer's projections."""
    over_head = grouped_gemm_s(heads, s_q, d, s_k, dev, train)      # Q·Kᵀ and dO·Vᵀ
    over_keys = grouped_gemm_s(heads, s_q, s_k, d, dev, train)      # P·V and dS·K
    over_queries = grouped_gemm_s(heads, s_k, s_q, d, dev, train)   # Pᵀ·dO and dSᵀ·Q
    return over_head + over_keys, over_head + over_keys + 2 * over_queries


def sdpa_head_s(points: tuple[tuple[float, float, float], ...], seq_len: float, head_dim: int) -> float:
    """Seconds of one head's causal SDPA call over `seq_len` queries and keys, from a CPU
    profile's measured points (sequence, head dim, seconds per head: runtime.profiler.sdpa_curves).
    A call's time is its heads' (batch x heads) times this: one thread runs them one by one.
    Per query-key pair the time falls with the sequence (the kernel's per-block and per-row work
    amortised) and rises with the head dim less than in proportion (`planner profile` times each
    sequence at several head dims: runtime.profiler.CPU_SDPA_SHAPES).
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


def _head_dim(model: ModelSpec, padded_values: bool) -> float:
    """The head size the attention core's two products see on average (ModelSpec.attention_head_dim),
    or the query/key size where the values are padded to it."""
    return model.head_dim if padded_values else model.attention_head_dim


def _measured_sdpa_s(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile,
                     cp_ring: bool, padded_values: bool = False) -> tuple[float, float]:
    """(forward, backward) of the attention core on a CPU, at the profile's measured SDPA times
    for this dtype and dropout (with dropout the math path, whose draw over the scores is in the
    measurement), at each call's sequence and head dim (sdpa_head_s), plus training's per-kernel
    cost (the only fitted figure here; the compute factor does not move it). Context
    parallelism's calls are its chunks' rectangles under a lower-right mask (cp_chunk_scores, two
    calls a rank), priced as the causal square of as many query-key pairs, though a masked call
    computes every pair: its time can exceed its pairs' share of the square's, which this prices
    on the fast side."""
    b, heads, d = plan.micro_batch_size, model.num_heads // plan.tp, _head_dim(model, padded_values)
    calls = plan.cp if cp_ring else (1 if plan.cp == 1 else 2)
    square = math.sqrt(rank_scores(train, plan, cp_ring) / calls)   # the causal call of as many pairs
    kernels = calls * (SDPA_MATH_KERNELS if model.dropout else 1)
    overhead = kernels * dev.efficiency.kernel_overhead_s

    def timed(backward: bool) -> float:
        points = dev.sdpa_curve(train.compute_dtype, model.dropout, backward)
        return calls * b * heads * sdpa_head_s(points, square, d) + overhead
    merge = _ring_merge_s(plan, b * heads * (train.seq_len // plan.cp) * d, dev) if cp_ring else 0.0
    return timed(False) + merge, timed(True) + 2 * merge


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
