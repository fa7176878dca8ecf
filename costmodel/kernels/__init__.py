"""Compute time of one layer (and of the embedding, LM head, optimizer) on one device.

`roofline` prices a kernel, `gemm` the projections and experts, `attention` the attention core,
`elementwise` the memory-bound kernels and the loss, `layer` combines them per layer, head and
embedding (cached on the plan fields they depend on), `optimizer` prices the optimizer step,
gradient accumulation and FSDP2's one-rank copies.
"""
from costmodel.kernels.attention import (
    CAUSAL_FRACTION,
    FLASH_BACKWARD_FACTOR,
    FLASH_TILE,
    FLASH_TILE_COST_TOKENS,
    cp_chunk_scores,
    flash_tile_efficiency,
    rank_scores,
    sdpa_head_s,
)
from costmodel.kernels.elementwise import (
    CPU_ELEMENT_BYTES,
    GELU_OF,
    cross_entropy_s,
    dropout_s,
    eager_elementwise_traffic,
    gelu_s,
    rank_hidden_elements,
)
from costmodel.kernels.gemm import expert_rows, final_linear_forward_s, float8_linear, fp8_gemm_s, gemm_s, moe_tokens
from costmodel.kernels.layer import (
    LAYER_KINDS,
    KernelKey,
    embedding_kernel_times,
    head_kernel_times,
    layer_kernel_times,
    layer_parts_s,
)
from costmodel.kernels.optimizer import (
    FSDP_SYNC_BYTES,
    fsdp_sync_s,
    gradient_add_s,
    gradient_cast_s,
    host_optimizer_step_s,
    optimizer_step_s,
    step_host_s,
)
from costmodel.kernels.roofline import (
    KernelShape,
    KernelTimes,
    compute_bound_s,
    interpolate,
    memory_bound_s,
    roofline_s,
)

__all__ = [
    "CAUSAL_FRACTION", "CPU_ELEMENT_BYTES", "FLASH_BACKWARD_FACTOR", "FLASH_TILE", "FLASH_TILE_COST_TOKENS",
    "FSDP_SYNC_BYTES", "GELU_OF", "LAYER_KINDS", "KernelKey", "KernelShape", "KernelTimes", "compute_bound_s", "cp_chunk_scores",
    "cross_entropy_s", "dropout_s", "eager_elementwise_traffic", "embedding_kernel_times", "expert_rows",
    "final_linear_forward_s", "flash_tile_efficiency", "float8_linear", "fp8_gemm_s", "fsdp_sync_s", "gelu_s",
    "gemm_s", "gradient_add_s", "gradient_cast_s", "head_kernel_times", "host_optimizer_step_s", "interpolate",
    "layer_kernel_times", "layer_parts_s", "memory_bound_s", "moe_tokens", "optimizer_step_s", "rank_hidden_elements",
    "rank_scores", "roofline_s", "sdpa_head_s", "step_host_s"]
