"""GEMMs: the projections of a layer, the experts of a mixture-of-experts layer (and the
bytes their routing moves) and the LM head, in bf16/fp32 and float8."""
from __future__ import annotations

from functools import lru_cache

from costmodel.flops import final_linear
from costmodel.frameworks import shared_expert_split
from costmodel.hardware import DeviceProfile
from costmodel.kernels.roofline import KernelShape, compute_bound_s, memory_bound_s, roofline_s
from costmodel.layout import Linear, Style, dense_blocks
from costmodel.params import ceil_div
from costmodel.specs import ModelSpec, TrainSpec


def _wave_fill(tiles: int, num_sms: int) -> float:
    """The share of the SMs' waves `tiles` output tiles keep busy."""
    return tiles / (-(-tiles // num_sms) * num_sms)


def tile_efficiency(m: int, k: int, n: int, dev: DeviceProfile, groups: int = 1) -> float:
    """The share of the long-K rate an m x n output over a reduction of k reaches: wave
    quantisation (NVIDIA, "Matrix Multiplication Background User's Guide": the output is cut
    into dev.gemm_tile-square tiles, one per SM at a time, and a last partial wave leaves SMs idle) over the output
    tiles of all `groups` (none on a device without an SM count: measured curves include it), times K / (K + the tile's fixed
    prologue and epilogue, dev.gemm_tile_setup_k), which is why a GEMM with short K is slower
    per FLOP than one with long K (benchmarks/gemm_shapes.py measures both)."""
    tile = dev.gemm_tile
    wave = _wave_fill(groups * -(-m // tile) * -(-n // tile), dev.num_sms) if dev.num_sms > 0 else 1.0
    return wave * k / (k + dev.gemm_tile_setup_k)


def gemm_s(m: int, k: int, n: int, dev: DeviceProfile, train: TrainSpec) -> float:
    """An m x n output reducing over k, in the compute dtype."""
    dev = dev.for_dtype(train.compute_dtype)
    a = train.compute_dtype.num_bytes
    eff = dev.efficiency.gemm * (1.0 if dev.gemm_curve(train.compute_dtype) else tile_efficiency(m, k, n, dev))
    return compute_bound_s(2.0 * m * k * n, a * (m * k + k * n + m * n), dev, train, eff)


def linear_shapes(m: int, k: int, n: int) -> tuple[tuple[int, int, int], ...]:
    """(output rows, reduction, output columns) of a linear's three GEMMs over m rows of k
    features into n: the forward X·Wᵀ, the input gradient dY·W (reduces n) and the weight
    gradient dYᵀ·X (reduces the m rows)."""
    return (m, k, n), (m, n, k), (n, m, k)


# A float8 cast of a bf16 tensor (costmodel.frameworks `float8_casts_fused`): (bytes moved per
# element, full-tensor kernels). torchao 0.18 eager: abs (2 + 2), max (2), to fp32 (2 + 4), times
# the scale (4 + 4), clamp (4 + 4), to float8 (4 + 1); fused: the amax read and the scaled cast.
FP8_CAST_EAGER = (33, 6)


FP8_CAST_FUSED = (5, 2)


FP8_MIN_DIM = 16   # torch._scaled_mm needs both GEMM dimensions of the weight divisible by 16


def fp8_gemm_s(m: int, k: int, n: int, dev: DeviceProfile, groups: int = 1) -> float:
    """A float8 GEMM (torch._scaled_mm, Transformer Engine's fp8 GEMM): the fp8 peak at the
    device's GEMM efficiency and wave quantisation (no profile measures a float8 GEMM; the bf16
    fraction is assumed to carry over), 1-byte operands, a bf16 result. `groups` GEMMs of one
    shape in one grouped kernel (Transformer Engine's GroupedLinear in float8) share the SMs'
    waves as grouped_gemm_s's do."""
    eff = dev.efficiency.gemm * tile_efficiency(m, k, n, dev, groups)
    return roofline_s(2.0 * groups * m * k * n, groups * (m * k + k * n + 2 * m * n), dev, dev.peak_for("fp8"), eff)


def _cast_s(elements: int, dev: DeviceProfile, fused: bool) -> float:
    per_element, kernels = FP8_CAST_FUSED if fused else FP8_CAST_EAGER
    return memory_bound_s(per_element * elements, dev, kernels)


def fp8_passes_s(m: int, k: int, n: int, dev: DeviceProfile, fused_casts: bool,
                 groups: int = 1) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of a float8 projection (of `groups`
    experts in one grouped kernel): each of its three GEMMs at the fp8 rate (fp8_gemm_s), and its
    operands' casts: input and weight forward; output gradient and weight for the input gradient;
    output gradient and input for the weight gradient, where eager torchao casts again (fused,
    `float8_casts_fused`: the forward's are reused). A grouped projection casts all its groups'
    rows (and weights) in one multi-tensor cast (Transformer Engine's split_quantize)."""
    gf, gb, gw = (fp8_gemm_s(*shape, dev, groups) for shape in linear_shapes(m, k, n))
    x, w, dy = (_cast_s(groups * e, dev, fused_casts) for e in (m * k, k * n, m * n))
    return gf + x + w, gb + dy + (0.0 if fused_casts else w), gw + (0.0 if fused_casts else dy + x)


def float8_linear(k: int, n: int) -> bool:
    """torchao converts a linear only when its weight's dimensions allow a float8 GEMM."""
    return k % FP8_MIN_DIM == 0 and n % FP8_MIN_DIM == 0


def _local_shape(lin: Linear, tp: int) -> tuple[int, int]:
    """(k, n) of a projection's GEMM on one TP rank: a column-parallel one splits its outputs,
    a row-parallel one its inputs (costmodel.layout)."""
    if lin.style is Style.COLWISE:
        return lin.in_features, ceil_div(lin.out_features, tp)
    if lin.style is Style.REPLICATED:
        return lin.in_features, lin.out_features
    return ceil_div(lin.in_features, tp), lin.out_features


def linear_tokens(lin: Linear, tokens: int, tp: int, sequence_parallel: bool) -> int:
    """Tokens a projection's GEMM runs over on one TP rank: a replicated one (MLA's
    down-projections) runs over the rank's sequence shard under SP (its latent is gathered
    after it, Megatron-Core), over every token otherwise (each TP rank repeats it)."""
    return tokens // tp if lin.style is Style.REPLICATED and sequence_parallel else tokens


def _linears_s(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile, tokens: int,
               fused_casts: bool, grouped_experts: bool = False,
               shared_expert_tp: bool = False) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of the layer's GEMMs. Float8 linears
    (plan.fp8_linears) run each GEMM at the fp8 rate with their operands' casts (fp8_passes_s);
    a mixture's experts too (_moe_gemms_s), where check.fp8_problems lets the framework
    (`float8_experts`). `shared_expert_tp`: the framework splits a shared expert over TP."""
    fwd, bwd_in, bwd_w = _moe_gemms_s(model, train, dev, moe_tokens(tokens, plan.tp), plan.ep, grouped_experts,
                                      plan.fp8_linears, fused_casts, plan.etp,
                                      shared_expert_split(plan.tp, shared_expert_tp))
    for block in dense_blocks(model):
        for lin in block.linears:
            k, n = _local_shape(lin, plan.tp)
            f, b, w = _projection_s(linear_tokens(lin, tokens, plan.tp, plan.sequence_parallel), k, n, dev, train,
                                    plan.fp8_linears, fused_casts)
            fwd, bwd_in, bwd_w = fwd + f, bwd_in + b, bwd_w + w
    return fwd, bwd_in, bwd_w


@lru_cache(maxsize=16384)   # the search prices the same projection under many expert and context layouts
def _projection_s(m: int, k: int, n: int, dev: DeviceProfile, train: TrainSpec, fp8: bool, fused_casts: bool,
                  groups: int = 1, grouped: bool = True) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of one projection over m rows (of
    `groups` experts: in one grouped kernel, or one GEMM each where not `grouped`): in float8
    where asked and its weight's shape allows (float8_linear), else three GEMMs in the compute
    dtype."""
    if fp8 and float8_linear(k, n):
        if grouped:
            return fp8_passes_s(m, k, n, dev, fused_casts, groups)
        return tuple(groups * t for t in fp8_passes_s(m, k, n, dev, fused_casts))
    if grouped and groups > 1:
        return tuple(grouped_gemm_s(groups, *shape, dev, train) for shape in linear_shapes(m, k, n))
    return tuple(groups * gemm_s(*shape, dev, train) for shape in linear_shapes(m, k, n))


def final_linear_forward_s(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile,
                           tokens: int) -> float:
    """The forward GEMM of the layer's last projection (row-parallel: its input split over TP),
    which a recomputation that stops early skips (costmodel.flops.stops_before_final_linear);
    the residual add it also skips (one memory-bound kernel) is left in the price."""
    return gemm_s(tokens, *_local_shape(final_linear(model), plan.tp), dev, train)


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


def grouped_gemm_s(groups: int, m: int, k: int, n: int, dev: DeviceProfile, train: TrainSpec) -> float:
    """`groups` GEMMs of one shape in one grouped kernel (cuBLASLt / CUTLASS grouped GEMM, as
    Transformer Engine's GroupedLinear runs a device's experts): every group's output tiles share
    the SMs' waves, so only the last wave of all of them is partial (tile_efficiency over the
    tiles of all groups), where one GEMM per group leaves a partial wave each."""
    dev = dev.for_dtype(train.compute_dtype)
    a = train.compute_dtype.num_bytes
    if dev.gemm_curve(train.compute_dtype) or dev.num_sms <= 0:
        return groups * gemm_s(m, k, n, dev, train)
    eff = dev.efficiency.gemm * tile_efficiency(m, k, n, dev, groups)
    return compute_bound_s(2.0 * groups * m * k * n, groups * a * (m * k + k * n + m * n), dev, train, eff)


@lru_cache(maxsize=4096)   # the same mixture's GEMMs under many dense and context layouts
def _moe_gemms_s(model: ModelSpec, train: TrainSpec, dev: DeviceProfile, tokens: int, ep: int,
                 grouped: bool = False, fp8: bool = False, fused_casts: bool = False,
                 etp: int = 1, shared_split: int = 1) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of a mixture's GEMMs, `tokens` being the
    device's sequence shard (moe_tokens; the routed experts are never split over TP): the
    router, then for each of the device's num_experts/ep experts three projections over
    the rows routed to it, one GEMM each as runtime.moe runs them or, `grouped`
    (costmodel.frameworks `grouped_expert_gemm`), each projection of all local experts in one
    grouped kernel; and the shared expert with its gate. `fp8` (plan.fp8_linears, where the
    framework runs experts in float8: `float8_experts`): the experts' and the shared expert's
    projections in float8 with their casts (_projection_s), as Transformer Engine's
    GroupedLinear and Linear run them inside Megatron-Core's TEGroupedMLP and shared-expert MLP;
    the router (a plain torch linear in Megatron-Core) and the one-output gate stay in the
    compute dtype. Under expert tensor parallelism (Plan.etp) each expert's projections run on
    the rows all-gathered over its etp ranks, etp times as many, at 1/etp of the width (gate and
    up column-parallel, down row-parallel): the same FLOPs in narrower GEMMs. A shared expert the
    framework splits over the `shared_split` ranks of the dense TP group (frameworks
    `shared_expert_tp`) runs over their shards gathered, shared_split times the rows, at
    1/shared_split of its width: the same FLOPs as whole over the shard, in other shapes."""
    if not model.is_moe:
        return 0.0, 0.0, 0.0
    h, f, fs = model.hidden_size, model.moe_ffn_hidden_size // etp, model.shared_expert_ffn_hidden_size
    local = model.num_experts // ep
    rows = max(1, round(etp * expert_rows(model, train, tokens, ep) / local))
    plain = gemm_s(tokens, h, model.num_experts, dev, train)
    if model.shared_expert_gate:
        plain += gemm_s(tokens, h, 1, dev, train)
    # (rows, k, n, experts) of each projection: gate, up, down of the routed and the shared experts
    shapes = [(rows, h, f, local), (rows, h, f, local), (rows, f, h, local)]
    if fs:
        m, fs = tokens * shared_split, ceil_div(fs, shared_split)
        shapes += [(m, h, fs, 1), (m, h, fs, 1), (m, fs, h, 1)]
    parts = [(plain, plain, plain)] + [_projection_s(m, k, n, dev, train, fp8, fused_casts, g, grouped)
                                       for m, k, n, g in shapes]
    fwd, bwd_in, bwd_w = (sum(p) for p in zip(*parts))
    return fwd, bwd_in, bwd_w


def _moe_routing_bytes(model: ModelSpec, train: TrainSpec, tokens: int, ep: int, etp: int = 1) -> tuple[float, int]:
    """(bytes, kernels) of a mixture's memory-bound work: the fp32 softmax and top-k over the
    router logits; the gather of the routed rows in expert order, the weighting and the
    scatter-add of their outputs (each a read and a write of k·tokens·h); under expert
    parallelism (or expert TP) also the received rows' reorder by local expert and back, of the
    rows gathered over the etp ranks; per local expert the gather and scatter of its rows."""
    if not model.is_moe:
        return 0.0, 0
    a, routed = train.compute_dtype.num_bytes, tokens * model.experts_per_token
    num_bytes = 3 * 4 * tokens * model.num_experts + 3 * 2 * a * routed * model.hidden_size
    kernels = 3 + 4 * (model.num_experts // ep)
    if ep * etp > 1:
        num_bytes += 2 * 2 * a * etp * expert_rows(model, train, tokens, ep) * model.hidden_size
        kernels += 2
    return num_bytes, kernels
