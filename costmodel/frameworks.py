"""Training frameworks as data: what each one overlaps and how it implements ZeRO.

The same plan runs at different speeds under different software. A published run is priced with
the traits of the framework that ran it (`planner validate`); `search` and `predict` price plans
with `RUNTIME`, this project's own executor (`planner run`), unless `--framework` names the
framework that will run them (planner.targets: its space and these traits). A framework name
the table does not know gets `GENERIC` (never an error): the plain assumptions of the cost
model, with nothing hidden that a plain implementation would not hide.

Each trait (a field of FrameworkTraits) is a mechanism with its source, not a per-framework
fudge factor; docs/frameworks.md says what each one does, where the framework does it and what
measured it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from costmodel.selective_modules import DEFAULT_SELECTIVE_MODULES
from costmodel.specs import ModelSpec, NormKind

if TYPE_CHECKING:
    from costmodel.hardware.records import DeviceProfile
    from costmodel.plan import Plan


@dataclass(frozen=True, kw_only=True, slots=True)
class FrameworkTraits:
    name: str
    dp_grad_overlap: bool
    dp_param_overlap: bool
    sharded_grads_under_pp: bool
    zero3_gathers_per_param: bool
    # DeepSpeed's coordinator's stage3_prefetch_bucket_size (elements; None: a whole unit ahead, FSDP's) and
    # stage3_max_live_parameters (costmodel.zero3_coordinator)
    zero3_prefetch_bucket: float | None = None
    zero3_max_live: float = 1e9
    recompute_placement: str = "first"
    dp_collectives_per_layer: bool = False
    fsdp_block_units: bool = False
    swiglu_saved_tensors: int = 4   # eager PyTorch's (EAGER_SWIGLU_SAVED)
    loss_grad_in_place: bool = False
    dtensor_loss_parallel: bool = False
    fused_cross_entropy: bool = False
    fsdp_master_params: bool = False
    vendor_attention: bool = False
    flash_attention_1: bool = False
    # MosaicML's Triton port of FlashAttention (llm-foundry's attn_impl triton, flash_attn_triton.py):
    # the first generation's algorithm at its own speed (FLASH_TRITON_SLOWDOWN)
    flash_attention_triton: bool = False
    tp_keeps_gathered_input: bool = False
    sp_regather_exposed: bool = False
    vocab_parallel_loss: bool = True
    cpu_kernels: bool = False
    eager_layer: bool = False
    eager_rms_norm_composite: bool = False
    # Megatron-LM's own model (megatron/model, transformer_impl 'local'): a Llama-style layer's
    # RMSNorm, RoPE and SwiGLU are torch ops (rms_norm.py's fp32 RMSNorm, rotary_pos_embedding's
    # apply_rotary_pos_emb, ParallelMLP's chunk-silu-multiply), its QKV and gate/up one fused
    # projection each; a GPT layer keeps apex's LayerNorm and the bias-GeLU and bias-dropout-add
    # fusions (eager_layer_ops)
    llama_ops_eager: bool = False
    # Megatron-LM before Megatron-Core could wrap its model in torch's DistributedDataParallel
    # (--DDP-impl torch, ZeRO-0 only) instead of its own DDP, which all-reduces after the backward:
    # torch's all-reduces its buckets during the last micro-batch's backward (the others run under
    # no_sync). A runs-table row states it (dp_overlap = yes at zero_stage 0)
    torch_ddp_option: bool = False
    deferred_w_keeps_graph: bool = False
    pipeline_sends_held: bool = False
    # the pipeline's last stage keeps its output, the logits, for the backward call (torch pipelining
    # and DeepSpeed's pipe engine hold the stage's outputs until its backward); Megatron's schedules
    # get the loss from the model's last stage, and the logits die once the loss has cast them to fp32
    # (costmodel.memory.activations: logits_held_bytes)
    pipeline_output_kept: bool = True
    recv_buffers_kept: bool = False
    cp_all_gather_kv: bool = False
    float8_casts_fused: bool = False
    float8_with_tp: bool = False
    float8_param_gather: bool = False
    float8_experts: bool = False
    float8_saved_inputs: bool = False
    # Transformer Engine keeps each linear's float8 weight (and on Hopper its transpose:
    # `float8_transposed_copy`) from the first micro-batch to the step's last (Megatron-Core passes
    # is_first_microbatch; TE's module/linear.py caches the quantized weight as
    # _fp8_workspaces["weight"]), unless the weights are float8 already (`float8_param_gather`)
    # (costmodel.memory.states: float8_weight_cache_bytes)
    float8_weight_cache: bool = False
    # Transformer Engine keeps a transposed copy of a float8 tensor that GEMMs read both ways where the
    # chip's float8 GEMMs take the TN layout only (Hopper); set from the cluster's device
    # (DeviceProfile.float8_gemm_any_layout, traits_on), not a framework's choice
    float8_transposed_copy: bool = True
    tp_comm_overlap: bool = False
    # the overlap runs on Transformer Engine's userbuffers (Megatron-Core's --tp-comm-overlap), which
    # hold buffers of their own outside torch's allocator (costmodel.memory.reserved_bytes); torch's
    # async TP (a torchtitan row's async_tp) overlaps on symmetric memory without them
    tp_overlap_userbuffers: bool = False
    tp_backward_reduce_scatter_exposed: bool = False
    ep_folds_over_tp: bool = False
    expert_tensor_parallel: bool = False
    recompute_early_stop: bool = False
    fused_grad_accumulation: bool = False
    # Transformer Engine computes the bias gradient of a linear that adds its own bias inside the
    # weight-gradient GEMM (cuBLASLt's BGRADB epilogue; in float8 its cast); in Megatron-Core that is
    # the QKV projection's only: the others return their bias to Megatron's bias-GeLU and
    # bias-dropout-add, whose gradient autograd reduces (costmodel.kernels.elementwise: bias_grad_traffic)
    qkv_bias_grad_in_gemm: bool = False
    # the run captures each whole iteration in a CUDA graph (Megatron-Core's cuda_graph_scope
    # full_iteration, MLPerf's FULL_CUDA_GRAPH): its kernels launch from the graph and the step's
    # host work is the graph's launch, so neither the per-kernel nor the per-step host cost is paid
    # (DeviceProfile.graphed). A runs-table setting (column cuda_graph), never a searched plan's
    iteration_graph: bool = False
    one_replica_fsdp: bool = False
    # FSDP2 copies each all-gather's output into the parameters on the compute stream, exposed
    # (costmodel.kernels.optimizer: COPY_OUT_PASSES); FSDP1 and DeepSpeed gather into the flat
    # buffer the parameters view
    fsdp_copy_out: bool = False
    # FSDP2 reshards the parameters after every backward that reduces its gradients (FSDP2's default,
    # which torchtitan's train loop keeps), so without a pipeline holding them ZeRO-2 gathers them
    # again for each micro-batch's forward; our runtime keeps them gathered until the last one
    # (runtime.train: set_reshard_after_backward)
    reshards_after_backward: bool = False
    compiled_layer: bool = False
    dp_sync_per_chunk: bool = False
    dispatch_per_node: bool = False
    grouped_expert_gemm: bool = False
    mtp_with_cp: bool = False
    moe_probs_in_activation: bool = False
    shared_expert_tp: bool = False
    grads_reduced_after_pipeline: bool = False
    grad_overlap_zero3_only: bool = False
    hybrid_shard: bool = False
    partial_distributed_optimizer: bool = False
    own_pipeline_schedules: bool = True
    empty_end_stages: bool = False
    pipe_engine_sends: bool = False
    # Megatron-LM before Megatron-Core (SC'21 Sec. 4.1, `scatter_gather_tensors_in_pipeline`, on by
    # default): without SP each TP rank sends 1/t of the replicated activation and the receiver
    # all-gathers it; Megatron-Core, torch's pipelining and our runtime send what the stage holds
    pipeline_send_scatter: bool = False
    # Megatron-Core's interleaved schedule with overlap_p2p_comm (Megatron-LM's default under a virtual
    # pipeline, `--no-overlap-p2p-communication` turns it off; NeMo's, Megatron-Bridge's and MLPerf's
    # configs set it) posts a steady-state chunk's sends and receives without waiting; since core_v0.18
    # (#4047, deallocate_pipeline_outputs, which Megatron-LM's training sets) it waits for the activation
    # sends at once, so only the gradient sends run beside the next chunk's compute; the warm-up's and the
    # flush's are waited for (overlap_p2p_comm_warmup_flush is off by default). megatron/core/
    # pipeline_parallel/schedules.py (costmodel.rank_time.layer_comm: send_cost_share)
    steady_sends_overlap: bool = False
    bf16_optimizer_all_reduce: bool = False
    ep_a2a_overlap: bool = False
    selective_modules: tuple[str, ...] = DEFAULT_SELECTIVE_MODULES
    # its selective recomputation is torchtitan's per-op policy, not modules (costmodel.selective_ops)
    selective_op_policy: bool = False
    # InternEvo's hybrid ZeRO-1 (internlm/solver/optimizer/hybrid_zero_optim.py): gradients all-reduced
    # whole over every data-parallel rank, and the updated shards broadcast after the step, one
    # broadcast per ZeRO rank (costmodel.comm: owner_broadcasts_s), not overlapped
    owner_broadcasts: bool = False
    # InternEvo's layer (internlm/model/modeling_internlm.py, dropout_selective_checkpoint on by default
    # without full checkpointing): each RMSNorm's input cast to fp32 first (`norm(residual.float())`), and
    # the dropout, residual add, cast and norm checkpointed, re-run in backward
    # (costmodel.kernels.elementwise: fp32_norm_recompute_traffic)
    norm_fp32_recomputed: bool = False


# Fused kernels for a layer's memory-bound work, so a fused SwiGLU's three saved tensors (gate and up,
# its output for the down projection's weight gradient; silu(gate) recomputed in its backward), not
# eager PyTorch's four. float8 as every framework that publishes float8 runs runs it (Transformer
# Engine, torchao under torch.compile): under TP and in experts, so a row of an unknown framework
# that states either is priced, not refused, and with fused casts (one amax read and one scaled cast,
# not eager torchao's six kernels a cast, 33 bytes an element, every weight again each micro-batch)
GENERIC = FrameworkTraits(name="generic", dp_grad_overlap=True, dp_param_overlap=True,
                          sharded_grads_under_pp=True, zero3_gathers_per_param=False, float8_with_tp=True,
                          float8_experts=True, float8_casts_fused=True, swiglu_saved_tensors=3)

# This project's executor: FSDP2 for every ZeRO stage (bucketed overlap of reduce-scatter and
# prefetched all-gathers, fp32 sharded parameters), DTensor TP without overlap (SP keeping the
# sequence shard, runtime.sequence_parallel; whole logits), eager SwiGLU, torch's cross entropy,
# torch pipelining, float8 linears compiled one by one on CUDA (runtime.float8; see the module
# docstring).
RUNTIME = FrameworkTraits(name="planner", dp_grad_overlap=True, dp_param_overlap=True,
                          sharded_grads_under_pp=False, zero3_gathers_per_param=False,
                          fsdp_master_params=True, sp_regather_exposed=True, vocab_parallel_loss=False,
                          deferred_w_keeps_graph=True, cp_all_gather_kv=True,
                          float8_casts_fused=True, dp_collectives_per_layer=True, eager_layer=True,
                          recompute_early_stop=True, one_replica_fsdp=True, fsdp_copy_out=True, ep_folds_over_tp=True,
                          hybrid_shard=True, own_pipeline_schedules=False)

# f-wide tensors a compiled SwiGLU keeps for backward (`compiled_layer`): eager's four less
# silu(gate), which inductor recomputes
COMPILED_SWIGLU_SAVED = 3
# eager PyTorch's: gate, up, silu(gate), their product
EAGER_SWIGLU_SAVED = 4

# The same executor with its layers compiled (planner run --compile).
COMPILED_RUNTIME = replace(RUNTIME, name="planner-compiled", eager_layer=False, compiled_layer=True,
                           swiglu_saved_tensors=COMPILED_SWIGLU_SAVED)

_MEGATRON = dict(sharded_grads_under_pp=True, zero3_gathers_per_param=False, loss_grad_in_place=True,
                 fused_grad_accumulation=True, recompute_placement="each_chunk", pipeline_output_kept=False)
_FSDP = dict(dp_grad_overlap=True, dp_param_overlap=True, zero3_gathers_per_param=False, hybrid_shard=True,
             fsdp_master_params=True, fsdp_block_units=True)
_DEEPSPEED = dict(dp_grad_overlap=True, dp_param_overlap=False, sharded_grads_under_pp=True,
                  zero3_gathers_per_param=True, grads_reduced_after_pipeline=True, pipe_engine_sends=True,
                  bf16_optimizer_all_reduce=True)

# PyTorch's FSDP1 (FlatParameter units, BACKWARD_PRE prefetch, limit_all_gathers) over an eager model
_FSDP1_EAGER = FrameworkTraits(name="pytorch-fsdp", sharded_grads_under_pp=True, eager_layer=True,
                               eager_rms_norm_composite=True, **_FSDP)

FRAMEWORKS: dict[str, FrameworkTraits] = {t.name: t for t in (
    RUNTIME,
    COMPILED_RUNTIME,
    GENERIC,
    # its own model (megatron/model): fp32 RMSNorm in torch ops (megatron/model/rms_norm.py, NVIDIA/Megatron-LM
    # 20b7a548, 2023-09) unless a row states its fork's fused one (rms_norm = fused)
    FrameworkTraits(name="megatron-lm", dp_grad_overlap=False, dp_param_overlap=False, llama_ops_eager=True,
                    eager_rms_norm_composite=True, torch_ddp_option=True, pipeline_send_scatter=True, **_MEGATRON),
    FrameworkTraits(name="megatron-core", dp_grad_overlap=True, dp_param_overlap=True, tp_comm_overlap=True,
                    tp_overlap_userbuffers=True,
                    swiglu_saved_tensors=3, vendor_attention=True, float8_casts_fused=True, float8_with_tp=True,
                    float8_param_gather=True, float8_experts=True, float8_saved_inputs=True, float8_weight_cache=True,
                    ep_folds_over_tp=True, expert_tensor_parallel=True, dp_sync_per_chunk=True,
                    dispatch_per_node=True, moe_probs_in_activation=True,
                    grouped_expert_gemm=True, mtp_with_cp=True, shared_expert_tp=True,
                    partial_distributed_optimizer=True, empty_end_stages=True, steady_sends_overlap=True,
                    qkv_bias_grad_in_gemm=True, **_MEGATRON),
    # Megatron's layer as Megatron-DeepSpeed keeps it: apex's fused norms, SwiGLU and RoPE in torch ops
    FrameworkTraits(name="megatron-deepspeed", **{**_DEEPSPEED, "loss_grad_in_place": True,
                                                   "grad_overlap_zero3_only": True, "eager_layer": True}),
    # a Hugging Face-style model under DeepSpeed's engine: every op eager, RMSNorm op by op in fp32
    FrameworkTraits(name="deepspeed", eager_layer=True, eager_rms_norm_composite=True, **_DEEPSPEED),
    FrameworkTraits(name="composer-fsdp", sharded_grads_under_pp=True, flash_attention_triton=True,
                    fused_cross_entropy=True, **_FSDP),
    _FSDP1_EAGER,
    # IBM's foundation-model-stack: FSDP1 over its eager Llama
    replace(_FSDP1_EAGER, name="fms-fsdp"),
    # compiled, as its presets (compile = true) and published runs run it; a row stating compiled = no
    # runs eager (planner.measure.row_traits)
    FrameworkTraits(name="torchtitan", sharded_grads_under_pp=False, tp_keeps_gathered_input=True,
                    compiled_layer=True, swiglu_saved_tensors=COMPILED_SWIGLU_SAVED,
                    recv_buffers_kept=True, pipeline_sends_held=True, tp_backward_reduce_scatter_exposed=True,
                    dtensor_loss_parallel=True,
                    cp_all_gather_kv=True, float8_casts_fused=True, float8_with_tp=True,
                    deferred_w_keeps_graph=True, shared_expert_tp=True, eager_rms_norm_composite=True,
                    ep_folds_over_tp=True, recompute_placement="every_nth", own_pipeline_schedules=False,
                    selective_op_policy=True, fsdp_copy_out=True, reshards_after_backward=True, **_FSDP),
    # InternEvo (InternLM's training framework): its own layer with apex's fused RMSNorm, FlashAttention's
    # fused QKV projection, rotary kernel and cross entropy, the SwiGLU in torch ops (internlm/model/linear.py
    # FeedForward: F.silu(w1(x)) * w2(x)), each norm's input cast to fp32 and the norms re-run in backward
    # (`norm_fp32_recomputed`); ZeRO-1 over all or part of the
    # data-parallel ranks (`zero1`: partial_distributed_optimizer) with the owner broadcasts above. Its
    # gradients are reduced during the last micro-batch's backward only (skip_grad_reduce before it)
    FrameworkTraits(name="internevo", dp_grad_overlap=True, dp_param_overlap=False, sharded_grads_under_pp=True,
                    zero3_gathers_per_param=False, fused_cross_entropy=True, partial_distributed_optimizer=True,
                    owner_broadcasts=True, eager_layer=True, norm_fp32_recomputed=True),
)}


def shards_in_part(traits: FrameworkTraits, zero_stage: int) -> bool:
    """Whether the framework shards ZeRO's states over part of the data-parallel ranks at this
    stage: hybrid sharding (`hybrid_shard`) at any, Megatron's optimizer instances at ZeRO-1."""
    return traits.hybrid_shard or (traits.partial_distributed_optimizer and zero_stage == 1)


def composite_rms_norm(traits: FrameworkTraits) -> bool:
    """Whether RMSNorm's time is torch's ops in fp32 rather than one fused kernel's: torch's CPU
    kernels (`cpu_kernels`), or an eager GPU layer whose framework writes RMSNorm op by op
    (`eager_rms_norm_composite`, `llama_ops_eager`); a compiled layer's is fused."""
    eager = traits.eager_layer or traits.llama_ops_eager
    return traits.cpu_kernels or (traits.eager_rms_norm_composite and eager and not traits.compiled_layer)


def eager_layer_ops(traits: FrameworkTraits, model: ModelSpec) -> bool:
    """Whether a layer's memory-bound work runs as separate eager kernels (its time counted op by
    op: costmodel.kernels.elementwise.eager_elementwise_traffic): an eager layer (`eager_layer`), or
    a Llama-style layer (RMSNorm) under a framework that writes those pieces in torch ops
    (`llama_ops_eager`)."""
    return traits.eager_layer or (traits.llama_ops_eager and model.norm_kind is NormKind.RMSNORM)


def tp_comm_overlaps(traits: FrameworkTraits, device_overlaps: bool, tp: int, sequence_parallel: bool,
                     *, tp_within_node: bool) -> bool:
    """Whether the framework overlaps a plan's tensor-parallel collectives with its GEMMs on this
    device (`tp_comm_overlap`, and the device profile's `tp_comm_gemm_overlap`): only a TP group
    within one node's NVLink domain (`tp_within_node`)."""
    return traits.tp_comm_overlap and device_overlaps and sequence_parallel and tp > 1 and tp_within_node


def tp_in_one_node(tp: int, devices_per_node: int) -> bool:
    """Whether a TP group (innermost in every rank order a TP-overlapping framework runs) lies
    within one node: whole groups of tp fill each node."""
    return tp <= devices_per_node and devices_per_node % tp == 0


def tp_comm_exposed_shares(traits: FrameworkTraits, device_overlaps: bool, tp: int,
                           sequence_parallel: bool, *, tp_within_node: bool) -> tuple[float, float]:
    """The (forward, backward) shares of a layer's tensor-parallel collectives left exposed:
    one ring step of tp where the framework overlaps them (tp_comm_hidden_share), and in
    backward half of them whole where its reduce-scatters run alone
    (`tp_backward_reduce_scatter_exposed`: the all-gathers and reduce-scatters move equal bytes)."""
    forward = 1.0 - tp_comm_hidden_share(traits, device_overlaps, tp, sequence_parallel, tp_within_node=tp_within_node)
    backward = (forward + 1.0) / 2 if traits.tp_backward_reduce_scatter_exposed else forward
    return forward, backward


def tp_comm_hidden_share(traits: FrameworkTraits, device_overlaps: bool, tp: int, sequence_parallel: bool,
                         *, tp_within_node: bool) -> float:
    """The share of a layer's tensor-parallel collectives the framework hides behind its GEMMs
    (`tp_comm_overlap`: all but one ring-exchange step of tp)."""
    overlaps = tp_comm_overlaps(traits, device_overlaps, tp, sequence_parallel, tp_within_node=tp_within_node)
    return (tp - 1) / tp if overlaps else 0.0


def shared_expert_split(tp: int, shared_expert_tp: bool) -> int:
    """Over how many ranks a mixture's shared expert is split: the dense TP group where the
    framework splits it (`shared_expert_tp`), none where each TP rank holds it whole."""
    return tp if shared_expert_tp else 1


def with_ep_overlap(traits: FrameworkTraits) -> FrameworkTraits:
    """Megatron-Core's traits with its expert all-to-all overlap (`ep_a2a_overlap`) as the recipes
    that turn it on run it: CUDA_DEVICE_MAX_CONNECTIONS raised for the overlap's streams (32 in the
    Megatron-MoE model zoo's sbatch_benchmarking.sh and Megatron-Bridge's recipes), and without
    Transformer Engine's TP overlap, which none of them combines with it."""
    return replace(traits, ep_a2a_overlap=True, tp_comm_overlap=False)


def framework_traits(name: str | None) -> FrameworkTraits:
    """The traits of a named framework; `GENERIC` for an empty or unknown name."""
    return FRAMEWORKS.get(_key(name), GENERIC)


def framework_known(name: str | None) -> bool:
    """Whether the name is one of FRAMEWORKS (else framework_traits gives GENERIC)."""
    return _key(name) in FRAMEWORKS


def _key(name: str | None) -> str:
    return (name or "").strip().lower()


def float8_params(plan: Plan, traits: FrameworkTraits) -> bool:
    """Whether the plan's weights are kept and all-gathered in float8 (`float8_param_gather`,
    Megatron-Core's --fp8-param-gather): float8 linears under the distributed optimizer (ZeRO
    1 and up) with the optimizer on the device; Megatron-LM takes an offloaded optimizer's float8
    weights with the delayed recipe only (megatron/training/arguments.py), which the export does
    not write (planner.exports.megatron)."""
    return plan.fp8_linears and traits.float8_param_gather and plan.zero_stage >= 1 and not plan.offload_optimizer


def traits_on(traits: FrameworkTraits, device: DeviceProfile) -> FrameworkTraits:
    """A framework's traits with torch's kernels on this kind of device (`cpu_kernels`) and
    Transformer Engine's float8 copies as this chip needs them (`float8_transposed_copy`)."""
    cpu = device.kind == "cpu"
    transposed = not device.float8_gemm_any_layout
    if traits.cpu_kernels == cpu and traits.float8_transposed_copy == transposed:
        return traits
    return replace(traits, cpu_kernels=cpu, float8_transposed_copy=transposed)


# FlashAttention-2 over the first generation, fwd + bwd (Dao 2023, arXiv 2307.08691: "around 2x")
FLASH1_SLOWDOWN = 2.0
# FlashAttention-2 over FlashAttention in Triton (the same paper, Sec. 4.1: "1.3-1.5x faster ... in the
# forward pass and around 2x faster in the backward pass"), weighted by the passes' FLOPs (the
# backward's 2.5 forwards, costmodel.kernels.attention FLASH_BACKWARD_FACTOR): (1.4 + 2.5 x 2) / 3.5
FLASH_TRITON_SLOWDOWN = (1.4 + 2.5 * 2.0) / 3.5


def attention_speedup(traits: FrameworkTraits, vendor_speedup: float) -> float:
    """What a framework's attention gains over FlashAttention-2: the device's vendor speedup
    where it calls the vendor's kernel (`vendor_attention`), a loss where its kernel is of the
    first generation (`flash_attention_1`) or its Triton port (`flash_attention_triton`), else nothing."""
    if traits.vendor_attention:
        return vendor_speedup
    if traits.flash_attention_1:
        return 1.0 / FLASH1_SLOWDOWN
    return 1.0 / FLASH_TRITON_SLOWDOWN if traits.flash_attention_triton else 1.0
