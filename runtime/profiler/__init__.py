"""Measure the machine this runs on: what `planner profile` writes into a device profile.

- GEMM throughput over the shapes transformer layers use (tokens x hidden x {hidden, 3 hidden,
  4 hidden}) and square ones, per dtype: a curve of achieved FLOP/s against FLOPs per call.
- Memory-bound kernels (elementwise add, RMS norm, softmax) over sizes, as one mix per size:
  achieved bytes/s (read + write) against bytes moved per kernel.
- Attention (torch's scaled_dot_product_attention, causal) at a few sizes: on a GPU as the
  fraction of the GEMM rate it reaches; on a CPU timed outright, forward and backward, without
  dropout and with it (torch's math path there).
- Per-operator overhead: a one-element add, the floor under every small kernel.
- An AdamW step as the runtime takes one, per parameter; torch's dropout, per element (a CPU
  draws its random numbers in software: ~40x an add), and on a CPU its GeLU (transcendental
  work, ~10x an add).
- Collectives among N local ranks (gloo on CPU, NCCL on GPU): all-reduce, all-gather,
  reduce-scatter and send/recv over message sizes, fitted to the alpha-beta ring model of
  costmodel.comm (latency per step, bandwidth per rank per direction).
- On a CPU, one probe layer's forward and backward with each kernel timed where it runs
  (runtime.layer_ops): how fast each kind of kernel goes inside a training step.
- Training steps of small probe plans (`probe_rank`): what a step adds to the kernels above.
Each figure is the best of a few repetitions after a warm-up (the achievable rate, as a
training step that repeats the same kernels sees it); on a CPU, the best of two passes where
the budget leaves time for the second, after the probes (second_pass_rank: a shared machine
slows for seconds at a time).

`timing` times kernels and holds the budget, `curves`, `attention` and `per_param` measure,
`ranks` runs them in order on each rank.

Every curve obeys a `Budget`: sizes grow only while the next point's expected time (from the
rate just measured) stays under the per-point budget and the phase's share of the total, so a
dtype the hardware does not accelerate (bf16 on a CPU without AMX: ~1 GFLOP/s) stops at small
sizes instead of taking minutes. All ranks stop together (`_agree`).
"""
from runtime.profiler.attention import (
    CPU_SDPA_SHAPES,
    GPU_ATTENTION_SHAPES,
    SDPA_ALWAYS_SEQ,
    attention_efficiency,
    backward_s,
    sdpa_curves,
    sdpa_gemm_ratio,
)
from runtime.profiler.curves import (
    GEMM_MAX_FLOPS,
    GPU_GEMM_MAX_FLOPS,
    GPU_LAYER_HIDDEN,
    GPU_LAYER_TOKENS,
    GPU_MEMORY_ELEMS,
    GPU_SQUARE,
    LAYER_HIDDEN,
    LAYER_TOKENS,
    MEMORY_ELEMS,
    SQUARE,
    Curve,
    gemm_curve,
    gemm_point,
    gemm_shapes,
    memory_curve,
    memory_points,
    op_overhead_s,
)
from runtime.profiler.per_param import (
    DROPOUT_ELEMENTS,
    FSDP_HIDDEN,
    FSDP_LAYERS,
    FSDP_ROUNDS,
    FSDP_TOKENS,
    GPU_OPTIMIZER_PARAMS,
    GPU_OPTIMIZER_TENSORS,
    OPTIMIZER_ALLOCATIONS,
    OPTIMIZER_PARAMS,
    OPTIMIZER_TENSORS,
    dropout_s_per_element,
    fsdp_round,
    fsdp_stack,
    fsdp_sync_s_per_param,
    gelu_s_per_element,
    grad_accumulate_s_per_param,
    optimizer_s_per_param,
    per_unit_costs,
    persisting_params,
)
from runtime.profiler.ranks import (
    COLLECTIVE_BYTES,
    SECOND_PASS_SLACK,
    best_of,
    best_pass,
    collective_worker,
    faster_layer_ops,
    layer_ops,
    measure_rank,
    probe_rank,
    second_pass,
    second_pass_rank,
    sorted_gemm,
)
from runtime.profiler.timing import (
    ACCELERATED_CHECK_FLOPS,
    ACCELERATED_RATIO,
    BUDGETS,
    CALLS_PER_POINT,
    CURVE_PHASES,
    DTYPES,
    GPU_BATCH_S,
    MAX_BATCH,
    PHASE_SHARES,
    PROBE_STEPS,
    PROBE_WARMUP,
    Budget,
    best_s,
)

__all__ = [
    "ACCELERATED_CHECK_FLOPS", "ACCELERATED_RATIO", "BUDGETS", "Budget", "CALLS_PER_POINT", "COLLECTIVE_BYTES",
    "CPU_SDPA_SHAPES", "CURVE_PHASES", "Curve", "DROPOUT_ELEMENTS", "DTYPES", "FSDP_HIDDEN", "FSDP_LAYERS",
    "FSDP_ROUNDS", "FSDP_TOKENS", "GEMM_MAX_FLOPS", "GPU_ATTENTION_SHAPES", "GPU_BATCH_S", "GPU_GEMM_MAX_FLOPS",
    "GPU_LAYER_HIDDEN", "GPU_LAYER_TOKENS", "GPU_MEMORY_ELEMS", "GPU_OPTIMIZER_PARAMS", "GPU_OPTIMIZER_TENSORS",
    "GPU_SQUARE", "LAYER_HIDDEN", "LAYER_TOKENS", "MAX_BATCH", "MEMORY_ELEMS", "OPTIMIZER_ALLOCATIONS",
    "OPTIMIZER_PARAMS", "OPTIMIZER_TENSORS", "PHASE_SHARES", "PROBE_STEPS", "PROBE_WARMUP", "SDPA_ALWAYS_SEQ",
    "SECOND_PASS_SLACK", "SQUARE", "attention_efficiency", "backward_s", "best_of", "best_pass", "best_s",
    "collective_worker", "dropout_s_per_element", "faster_layer_ops", "fsdp_round", "fsdp_stack",
    "fsdp_sync_s_per_param", "gelu_s_per_element", "gemm_curve", "gemm_point", "gemm_shapes",
    "grad_accumulate_s_per_param", "layer_ops", "measure_rank", "memory_curve", "memory_points", "op_overhead_s",
    "optimizer_s_per_param", "per_unit_costs", "persisting_params", "probe_rank", "sdpa_curves",
    "sdpa_gemm_ratio", "second_pass", "second_pass_rank", "sorted_gemm"]
