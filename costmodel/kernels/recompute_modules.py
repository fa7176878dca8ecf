"""What selective recomputation re-runs in backward, module by module, as Megatron-Core's
`--recompute-modules` names them (costmodel.frameworks `selective_modules`; TransformerConfig
at Megatron-LM d98e8a64): each module keeps its inputs and re-runs its forward once its output's
gradient arrives. The memory each frees: costmodel.memory.activations.layer_activation_bytes."""
from __future__ import annotations

from costmodel.hardware import DeviceProfile
from costmodel.kernels.elementwise import gelu_s
from costmodel.kernels.gemm import _local_shape, _projection_s, expert_rows, linear_tokens, moe_tokens
from costmodel.kernels.roofline import KernelShape, KernelTimes, memory_bound_s
from costmodel.layout import recomputed_linears
from costmodel.selective_modules import OP_POLICY, SELECTIVE_MODULES
from costmodel.specs import ModelSpec, PositionKind, TrainSpec


def selective_recompute_s(model: ModelSpec, train: TrainSpec, shape: KernelShape, dev: DeviceProfile,
                          modules: tuple[str, ...], layer: KernelTimes, fused_casts: bool) -> float:
    """A layer's forward work its selective recomputation re-runs, per micro-batch on one device:
    the sum over `modules` of module_forward_s (core_attn: the attention core, `layer`'s)."""
    return sum(module_forward_s(model, train, shape, dev, name, layer, fused_casts) for name in modules)


def module_forward_s(model: ModelSpec, train: TrainSpec, shape: KernelShape, dev: DeviceProfile, name: str,
                     layer: KernelTimes, fused_casts: bool) -> float:
    """One module's forward, where the layer has it (Megatron-Core skips a module a layer lacks):
    - core_attn: the attention core;
    - mla_up_proj: the query and key/value up-projections, and RoPE with the concatenations (a
      pass reading and writing Q and K);
    - mlp: a dense layer's MLP projections and activation (a mixture's MLP is not one);
    - moe_act: the experts' SwiGLU over the device's routed rows (reads the 2f-wide fc1 output,
      writes f);
    - layernorm: the norms Transformer Engine keeps apart from a linear, a latent attention's
      input norm and a mixture's pre-MLP norm (each reads and writes the rank's hidden states);
    - op_policy: torchtitan's per-op policy, every second projection and the elementwise ops
      (costmodel.selective_ops)."""
    a, tp = train.compute_dtype.num_bytes, shape.tp
    tokens = shape.micro_batch_size * train.seq_len // shape.cp
    if name == "core_attn":
        return layer.attention_forward_s
    if name == OP_POLICY:
        return (_linears_forward_s(model, train, shape, dev, tokens, fused_casts, name)
                + _op_policy_elementwise_s(model, train, shape, dev, tokens))
    if name == "mla_up_proj":
        if not model.is_mla:
            return 0.0
        gemms = _linears_forward_s(model, train, shape, dev, tokens, fused_casts, name)
        return gemms + memory_bound_s(2 * 2 * a * tokens * model.num_heads * model.head_dim / tp, dev, 2)
    if name == "mlp":
        if model.is_moe:
            return 0.0
        activation = _swiglu_s(model, train, shape, dev, tokens) if model.ffn_kind.gated \
            else gelu_s(model, shape, tokens, dev)[0]
        return _linears_forward_s(model, train, shape, dev, tokens, fused_casts, name) + activation
    if name == "moe_act":
        if not model.is_moe:
            return 0.0
        # under expert TP etp times the rows, each 1/etp of the width
        rows = expert_rows(model, train, moe_tokens(tokens, tp), shape.ep)
        return memory_bound_s(3 * a * rows * model.moe_ffn_hidden_size, dev, 1)
    if name == "layernorm":
        norms = int(model.is_mla) + int(model.is_moe)
        shard = tokens / tp if shape.sequence_parallel else tokens
        return norms * memory_bound_s(2 * a * shard * model.hidden_size, dev, 1)
    raise ValueError(f"selective recomputation of module {name!r}: not one of {SELECTIVE_MODULES}")


def _swiglu_s(model: ModelSpec, train: TrainSpec, shape: KernelShape, dev: DeviceProfile, tokens: int) -> float:
    """A dense MLP's SwiGLU product: reads the two f-wide projections, writes one; one kernel."""
    return memory_bound_s(3 * train.compute_dtype.num_bytes * tokens * model.ffn_hidden_size / shape.tp, dev, 1)


def _op_policy_elementwise_s(model: ModelSpec, train: TrainSpec, shape: KernelShape, dev: DeviceProfile,
                             tokens: int) -> float:
    """The memory-bound ops torchtitan's per-op policy re-runs (costmodel.selective_ops): the two
    norms (each reads and writes the rank's hidden states), RoPE on Q and K and a dense MLP's
    SwiGLU product; one kernel each."""
    a, tp = train.compute_dtype.num_bytes, shape.tp
    shard = tokens / tp if shape.sequence_parallel else tokens
    norms = 2 * memory_bound_s(2 * a * shard * model.hidden_size, dev, 1)
    rope = (memory_bound_s(2 * a * tokens * (model.q_hidden_size + model.kv_hidden_size) / tp, dev, 1)
            if model.position_kind is PositionKind.ROPE else 0.0)
    swiglu = _swiglu_s(model, train, shape, dev, tokens) if model.ffn_kind.gated and not model.is_moe else 0.0
    return norms + rope + swiglu


def _linears_forward_s(model: ModelSpec, train: TrainSpec, shape: KernelShape, dev: DeviceProfile, tokens: int,
                       fused_casts: bool, module: str) -> float:
    """Forward GEMMs of the projections `module` re-runs (layout.recomputed_linears), as the
    layer prices them."""
    total = 0.0
    for lin in recomputed_linears(model, module):
        k, n = _local_shape(lin, shape.tp)
        m = linear_tokens(lin, tokens, shape.tp, shape.sequence_parallel)
        total += _projection_s(m, k, n, dev, train, shape.fp8_linears, fused_casts)[0]
    return total
