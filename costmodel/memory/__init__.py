"""Memory per device, per pipeline rank: states (`states`), activations per layer (`activations`), and
the rank's peak as a ledger and as affine shapes for the search (`stage`).
"""
from costmodel.memory.activations import (
    backward_working_bytes,
    cp_gathered_kv_bytes,
    edge_bytes_per_micro_batch,
    layer_activation_bytes,
    logits_held_bytes,
    loss_vocab,
)
from costmodel.memory.deferred import edge_weight_grad_output_bytes, weight_grad_input_bytes, weight_grad_output_bytes
from costmodel.memory.stage import (
    AffineBytes,
    StageMemory,
    activation_bytes,
    activation_shape,
    buffer_bytes,
    deferred_weight_passes,
    held_send_bytes,
    host_activation_bytes,
    in_flight_micro_batches,
    micro_batch_activation_bytes,
    overlap_warmup_bytes,
    rebuilt_layer_bytes,
    reserved_bytes,
    send_bytes,
    stage_memory,
    stage_memory_at,
    stage_memory_shapes,
    stage_memory_shapes_by_dense,
    stage_memory_shapes_by_zero,
)
from costmodel.memory.states import (
    ADAM_MOMENT_BYTES,
    expert_state_bytes,
    float8_weight_cache_bytes,
    host_state_bytes,
    keeps_whole_grads_under_pp,
    optimizer_bytes_per_param,
    reduces_every_micro_batch,
    runtime_wraps_in_fsdp,
    state_bytes,
    state_bytes_for,
    state_bytes_from_counts,
    unsharded_between_micro_batches,
)

__all__ = [
    "ADAM_MOMENT_BYTES", "AffineBytes", "StageMemory", "activation_bytes", "activation_shape",
    "backward_working_bytes", "buffer_bytes", "cp_gathered_kv_bytes", "deferred_weight_passes",
    "edge_bytes_per_micro_batch", "edge_weight_grad_output_bytes", "expert_state_bytes", "float8_weight_cache_bytes", "held_send_bytes",
    "host_activation_bytes", "host_state_bytes", "in_flight_micro_batches", "layer_activation_bytes",
    "logits_held_bytes", "loss_vocab", "micro_batch_activation_bytes", "overlap_warmup_bytes", "optimizer_bytes_per_param",
    "rebuilt_layer_bytes", "reduces_every_micro_batch", "reserved_bytes", "runtime_wraps_in_fsdp", "send_bytes", "stage_memory",
    "stage_memory_at",
    "stage_memory_shapes", "stage_memory_shapes_by_dense", "stage_memory_shapes_by_zero", "state_bytes",
    "state_bytes_for",
    "state_bytes_from_counts", "unsharded_between_micro_batches", "keeps_whole_grads_under_pp", "weight_grad_input_bytes",
    "weight_grad_output_bytes"]
