"""GEMMs: the projections of a layer, the experts of a mixture-of-experts layer (and the
bytes their routing moves) and the LM head, in bf16/fp32 and float8."""
from __future__ import annotations

from costmodel.flops import final_linear
from costmodel.hardware import DeviceProfile
from costmodel.kernels.roofline import KernelShape, compute_bound_s, memory_bound_s, roofline_s
from costmodel.layout import Linear, Style, dense_blocks
from costmodel.params import ceil_div
from costmodel.specs import ModelSpec, TrainSpec

GEMM_TILE = 128  # output tile edge of the large cuBLAS/CUTLASS tensor-core kernels (128x128, 128x256)


def wave_efficiency(m: int, n: int, num_sms: int) -> float:
    """Wave quantisation (NVIDIA, "Matrix Multiplication Background User's Guide"): the output
    is cut into tiles, one per SM at a time; a last partial wave leaves SMs idle. 1 for a
    device with no SM count (measured curves already include it)."""
    if num_sms <= 0:
        return 1.0
    return _wave_fill(-(-m // GEMM_TILE) * -(-n // GEMM_TILE), num_sms)


def _wave_fill(tiles: int, num_sms: int) -> float:
    """The share of the SMs' waves `tiles` output tiles keep busy."""
    return tiles / (-(-tiles // num_sms) * num_sms)


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
    quantisation (no profile measures a float8 GEMM; the bf16 fraction is assumed to carry over),
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
    if lin.style is Style.REPLICATED:
        return lin.in_features, lin.out_features
    return ceil_div(lin.in_features, tp), lin.out_features


def linear_tokens(lin: Linear, tokens: int, tp: int, sequence_parallel: bool) -> int:
    """Tokens a projection's GEMM runs over on one TP rank: a replicated one (MLA's
    down-projections) runs over the rank's sequence shard under SP (its latent is gathered
    after it, Megatron-Core), over every token otherwise (each TP rank repeats it)."""
    return tokens // tp if lin.style is Style.REPLICATED and sequence_parallel else tokens


def _linears_s(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile, tokens: int,
               fused_casts: bool, grouped_experts: bool = False) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of the layer's GEMMs. Float8 linears
    (plan.fp8_linears) run each GEMM at the fp8 rate and pay their operands' casts: input and
    weight forward; output gradient and weight for the input gradient; output gradient and input
    for the weight gradient, where eager torchao casts again (fused: the forward's are reused)."""
    moe = _moe_gemms_s(model, train, dev, moe_tokens(tokens, plan.tp), plan.ep, grouped_experts)
    fwd = bwd_in = bwd_w = moe
    for block in dense_blocks(model):
        for lin in block.linears:
            k, n = _local_shape(lin, plan.tp)
            m = linear_tokens(lin, tokens, plan.tp, plan.sequence_parallel)
            if not (plan.fp8_linears and float8_linear(k, n)):
                t = gemm_s(m, k, n, dev, train)
                fwd, bwd_in, bwd_w = fwd + t, bwd_in + t, bwd_w + t
                continue
            g = fp8_gemm_s(m, k, n, dev)
            x, w, dy = (_cast_s(e, dev, fused_casts) for e in (m * k, k * n, m * n))
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
    the SMs' waves, so only the last wave of all of them is partial (wave_efficiency over the
    tiles of all groups), where one GEMM per group leaves a partial wave each."""
    dev = dev.for_dtype(train.compute_dtype)
    a = train.compute_dtype.num_bytes
    if dev.gemm_curve(train.compute_dtype) or dev.num_sms <= 0:
        return groups * gemm_s(m, k, n, dev, train)
    tiles = groups * -(-m // GEMM_TILE) * -(-n // GEMM_TILE)
    eff = dev.efficiency.gemm * _wave_fill(tiles, dev.num_sms)
    return compute_bound_s(2.0 * groups * m * k * n, groups * a * (m * k + k * n + m * n), dev, train, eff)


def _moe_gemms_s(model: ModelSpec, train: TrainSpec, dev: DeviceProfile, tokens: int, ep: int,
                 grouped: bool = False) -> float:
    """A mixture's GEMMs (never split over TP): the router, then for each of the device's
    num_experts/ep experts three GEMMs over the rows routed to it, one GEMM each as runtime.moe
    runs them or, `grouped` (costmodel.frameworks `grouped_expert_gemm`), each projection of all
    local experts in one grouped kernel; and the shared expert with its gate."""
    if not model.is_moe:
        return 0.0
    h, f, fs = model.hidden_size, model.moe_ffn_hidden_size, model.shared_expert_ffn_hidden_size
    local = model.num_experts // ep
    rows = max(1, round(expert_rows(model, train, tokens, ep) / local))
    total = gemm_s(tokens, h, model.num_experts, dev, train)
    if grouped:
        total += 2 * grouped_gemm_s(local, rows, h, f, dev, train) + grouped_gemm_s(local, rows, f, h, dev, train)
    else:
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
