"""A layer's, the LM head's and the embedding's kernel times per micro-batch, cached on the
plan fields they depend on."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache, wraps

from costmodel.hardware import DeviceProfile
from costmodel.kernels.attention import _attention_core_s
from costmodel.kernels.elementwise import (
    CPU_ELEMENT_BYTES,
    _cpu_rms_norm,
    _elementwise_s,
    cross_entropy_s,
    dropout_s,
    gelu_s,
    rank_hidden_elements,
)
from costmodel.kernels.gemm import _linears_s, final_linear_forward_s, gemm_s, linear_shapes
from costmodel.kernels.roofline import KernelShape, KernelTimes, memory_bound_s
from costmodel.params import ceil_div
from costmodel.plan import Plan
from costmodel.specs import ModelSpec, NormKind, TrainSpec


def _cached_on(key_of):
    """Called with a Plan and any profile; cached on `key_of(plan)`, the plan fields the kernel
    times depend on, and on the profile as the plan's compute dtype sees it (the search asks for
    the same shapes across many candidates). On a GPU, the host's and the device's times
    combined (_host_or_device) inside the cache: a hit costs one lookup, as on a CPU."""
    def decorate(fn):
        @lru_cache(maxsize=4096)
        def cached(model: ModelSpec, train: TrainSpec, key: "KernelKey", dev: DeviceProfile, *how) -> KernelTimes:
            times = fn(model, train, key, dev, *how)
            if dev.kind == "cpu" or dev.efficiency.kernel_overhead_s <= 0:
                return times
            return _host_or_device(times, fn(model, train, key, _without_kernel_overhead(dev), *how))

        @wraps(fn)
        def by_plan(model: ModelSpec, train: TrainSpec, plan: Plan, dev: DeviceProfile, *how) -> KernelTimes:
            return cached(model, train, key_of(plan), dev.for_dtype(train.compute_dtype), *how)
        return by_plan
    return decorate


def _host_or_device(both: KernelTimes, device: KernelTimes) -> KernelTimes:
    """A GPU runs its kernels while the host issues the next ones: each pass of a layer takes
    the longer of the device's work and the host's (kernels x the per-kernel cost), not their
    sum. On a CPU both are the same cores, and the sum stands. On one H100 a 0.85B model's step
    took 266 ms at 8K tokens and 276 ms at 16K, the host's floor, and 474 ms at 32K, the device's
    work, where a sum would grow with every token (`python benchmarks/gpu_check.py --replay
    benchmarks/results/gpu-check-h100-* --profile benchmarks/results/gpu-check-h100-*/run2/gpu.toml`
    prints these runs: mbs1_none_s2048, mbs1_none_s4096, mbs2_none_s4096 in run1/)."""
    def longer(name: str) -> float:
        gpu = getattr(device, name)
        return max(gpu, getattr(both, name) - gpu)
    return KernelTimes(forward_s=longer("forward_s"), backward_input_s=longer("backward_input_s"),
                       backward_weight_s=longer("backward_weight_s"),
                       attention_forward_s=longer("attention_forward_s"),
                       recompute_forward_s=longer("recompute_forward_s"))


@lru_cache(maxsize=64)
def _without_kernel_overhead(dev: DeviceProfile) -> DeviceProfile:
    return dev.with_efficiency(kernel_overhead_s=0.0)


@dataclass(frozen=True, slots=True)
class KernelKey:
    """The plan fields kernel times depend on: the search shares them across many candidates
    (and costmodel.rank_time.parts keys its kernel parts by them)."""

    tp: int
    cp: int
    ep: int
    etp: int
    sequence_parallel: bool
    micro_batch_size: int
    fp8_linears: bool

    @classmethod
    def of(cls, plan: Plan) -> "KernelKey":
        return cls(plan.tp, plan.cp, plan.ep, plan.etp, plan.sequence_parallel, plan.micro_batch_size,
                   plan.fp8_linears)

    @classmethod
    def edge_of(cls, plan: Plan) -> "KernelKey":
        """The fields the embedding and the LM head read: tp (the vocabulary shard), cp and the
        micro-batch (their tokens). Neither routes experts or runs in float8, and both are
        priced over the micro-batch's tokens with SP or without; keyed on these alone, one
        search prices them once per shape, not once per expert layout."""
        return cls(plan.tp, plan.cp, 1, 1, False, plan.micro_batch_size, False)


_per_kernel_shape = _cached_on(KernelKey.of)
_per_edge_shape = _cached_on(KernelKey.edge_of)


@_per_kernel_shape
def layer_kernel_times(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile,
                       cp_ring: bool, fused_casts: bool = False, cpu_kernels: bool = False,
                       eager: bool = False, early_stop: bool = False, compiled: bool = False,
                       padded_values: bool = False, grouped_experts: bool = False,
                       shared_expert_tp: bool = False, composite_norm: bool = False,
                       fused_projections: bool = False, qkv_bias_in_gemm: bool = False,
                       fp32_norms: bool = False) -> KernelTimes:
    """cp_ring: context parallelism as a ring of partial kernels (else all-gathered K/V,
    costmodel.frameworks `cp_all_gather_kv`); fused_casts: float8 casts as compiled or
    Transformer Engine kernels run them (`float8_casts_fused`); cpu_kernels: the runtime's eager
    layer on torch's CPU kernels (`cpu_kernels`), eager: on a GPU's (`eager_layer`); either way
    its memory-bound work is counted op by op. early_stop: a full recomputation stops before the
    layer's last projection (the caller's decision: the framework's `recompute_early_stop` where
    costmodel.flops.stops_before_final_linear lets it; final_linear_forward_s). compiled: the
    layer as torch.compile runs it (`compiled_layer`): its memory-bound work fused, on any device.
    padded_values: latent attention's values zero-padded to the query/key head size for a kernel
    of one head size (not the vendor's attention: runtime.latent_attention). grouped_experts: a
    device's experts in grouped GEMMs (`grouped_expert_gemm`). shared_expert_tp: a shared expert
    split over the TP group (`shared_expert_tp`). composite_norm: an eager GPU layer's RMSNorm op
    by op (frameworks.composite_rms_norm). fused_projections: an eager layer's QKV and gate/up each
    one projection (`llama_ops_eager`: no autograd sums of their shared input). qkv_bias_in_gemm:
    the QKV projection's bias gradient inside its weight-gradient GEMM (`qkv_bias_grad_in_gemm`).
    fp32_norms: an eager layer's norms on fp32 copies of their inputs, re-run in backward
    (`norm_fp32_recomputed`)."""
    tokens = plan.micro_batch_size * train.seq_len // plan.cp
    fwd, bwd_in, bwd_w = _linears_s(model, train, plan, dev, tokens, fused_casts, grouped_experts, shared_expert_tp)
    attn_fwd, attn_bwd = _attention_core_s(model, train, plan, dev, cp_ring, cpu_kernels, padded_values)
    elementwise, elementwise_bwd = _elementwise_s(model, train, plan, dev, tokens, cpu_kernels and not compiled,
                                                  eager and not compiled, composite_norm and not compiled,
                                                  fused_projections, qkv_bias_in_gemm, fp32_norms)
    # the two branches' dropout (runtime.model: after attention and after the MLP)
    dropped = 2 * rank_hidden_elements(model, plan, tokens) if model.dropout else 0
    gelu_fwd, gelu_bwd = gelu_s(model, plan, tokens, dev)
    forward = fwd + attn_fwd + elementwise + dropout_s(dropped, dev) + gelu_fwd
    skipped = final_linear_forward_s(model, train, plan, dev, tokens) if early_stop else 0.0
    return KernelTimes(forward_s=forward, backward_input_s=bwd_in + attn_bwd + elementwise_bwd + gelu_bwd,
                       backward_weight_s=bwd_w, attention_forward_s=attn_fwd,
                       recompute_forward_s=forward - skipped)


LAYER_KINDS = ("gemm", "sdpa", "memory")   # layer_parts_s's kinds, as runtime.layer_ops times them


def layer_parts_s(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile) -> dict[str, float]:
    """A layer's forward and backward on a CPU's eager kernels (layer_kernel_times with
    cpu_kernels) priced at the profile's curves alone, by the kind of kernel runtime.layer_ops
    times: its GEMMs at the GEMM curve ("gemm"), its SDPA calls at their measured points
    ("sdpa"), its memory-bound kernels at the memory curve ("memory"); no efficiency factor, no
    per-kernel cost. What the factors scale, so a measured layer's seconds per kind over these
    are its kinds' in-training shares of their curves (planner.measure.probes.layer_factors). A GeLU's
    or dropout's measured per-element cost is in no kind: the probes' layer has neither."""
    dev = dev.for_dtype(train.compute_dtype)
    bare = replace(dev, efficiency=replace(dev.efficiency, gemm=1.0, memory=1.0, kernel_overhead_s=0.0))
    tokens = plan.micro_batch_size * train.seq_len // plan.cp
    fwd, bwd_in, bwd_w = _linears_s(model, train, plan, bare, tokens, False)
    attn_fwd, attn_bwd = _attention_core_s(model, train, plan, bare, False, True)
    elementwise, elementwise_bwd = _elementwise_s(model, train, plan, bare, tokens, True, False)
    return {"gemm": fwd + bwd_in + bwd_w, "sdpa": attn_fwd + attn_bwd, "memory": elementwise + elementwise_bwd}


@_per_edge_shape
def head_kernel_times(model: ModelSpec, train: TrainSpec, plan: KernelShape, dev: DeviceProfile,
                      cpu_kernels: bool = False, fused_loss: bool = False, composite_norm: bool = False) -> KernelTimes:
    """Final norm, output projection (vocab-parallel) and cross entropy (fp32 softmax, or one
    fused kernel: frameworks `fused_cross_entropy`); cpu_kernels: the norm as torch's CPU
    composite runs it (layer_kernel_times); composite_norm: a GPU's RMSNorm op by op
    (frameworks.composite_rms_norm), at the compute dtype's width."""
    tokens = plan.micro_batch_size * train.seq_len // plan.cp
    vocab = ceil_div(model.vocab_size, plan.tp)
    proj_f, proj_b, proj_w = (gemm_s(*shape, dev, train) for shape in linear_shapes(tokens, model.hidden_size, vocab))
    a = train.compute_dtype.num_bytes
    loss = cross_entropy_s(tokens, vocab, train, dev, fused_loss)
    elems = tokens * model.hidden_size
    if (cpu_kernels or composite_norm) and model.norm_kind is NormKind.RMSNORM:
        (nf, kf), (nb, kb) = _cpu_rms_norm(CPU_ELEMENT_BYTES if cpu_kernels else a, 1 if a < 4 else 0)
        norm, norm_bwd = memory_bound_s(nf * elems, dev, kf), memory_bound_s(nb * elems, dev, kb)
    else:
        norm = memory_bound_s(2 * a * elems, dev, 1)
        norm_bwd = 2 * norm
    return KernelTimes(forward_s=proj_f + loss + norm, backward_input_s=proj_b + loss + norm_bwd,
                       backward_weight_s=proj_w, attention_forward_s=0.0, recompute_forward_s=0.0)


@_per_edge_shape
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
