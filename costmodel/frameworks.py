"""Training frameworks as data: what each one overlaps and how it implements ZeRO.

The same plan runs at different speeds under different software. A published run is priced with
the traits of the framework that ran it (`planner validate`); `search` and `predict` price plans
with `RUNTIME`, this project's own executor (`planner run`), unless `--framework` names the
framework that will run them (planner.targets: its space and these traits). A framework name the table does not know gets `GENERIC` (never an error): the plain
assumptions of the cost model with nothing hidden that a plain implementation would not hide.

Each trait is a mechanism with its source, not a per-framework fudge factor:
- `dp_grad_overlap`: the gradient reduction runs during backward, bucket by bucket. Megatron-LM
  before Megatron-Core all-reduced after the backward pass (Narayanan et al. SC'21 Sec. 4;
  `--overlap-grad-reduce` arrived with Megatron-Core in 2023).
- `dp_param_overlap`: ZeRO-1's all-gather of updated weights hides behind the next forward
  (Megatron-Core `--overlap-param-gather`), instead of running after the optimizer step.
- `dp_sync_per_chunk`: interleaved, each model chunk's gradients are reduced when its last
  micro-batch's backward ends and its weights gathered when its first forward starts
  (Megatron-Core's `--overlap-grad-reduce` / `--overlap-param-gather` hook each chunk's buffers
  into the interleaved schedule's grad_sync_func / param_sync_func), so those collectives hide
  behind the other chunks' last (first) round, not one micro-batch (costmodel.rank_time.dp_terms:
  chunk_window_micro_batches).
- `tp_comm_overlap`: Transformer Engine's userbuffer overlap of the sequence-parallel
  collectives with their GEMMs (Megatron-Core `--tp-comm-overlap`, on in NVIDIA's NeMo, MLPerf and
  Megatron-Bridge recipes): the all-gather and reduce-scatter are split into tp ring-exchange
  steps, each transfer behind the GEMM of the chunk already there (Wang et al. ASPLOS'23,
  "Overlap Communication with Dependent Computation via Decomposition"), so one step of tp stays
  exposed: the hidden share is (tp - 1) / tp, and none without sequence parallelism, which
  Megatron requires for it (tp_comm_hidden_share). Only on devices whose profile says
  `tp_comm_gemm_overlap` (Hopper and Blackwell): NVIDIA ships userbuffer configurations for H100,
  B200 and GB200 only (Megatron-Bridge `training/comm_overlap.py` presets, NeMo's
  `tp_overlap_configs/userbuffers.py`), and no published Megatron run on A100 used it, so an
  A100 plan is priced, and exported, without it. Only where the TP group lies within one node's
  NVLink domain: userbuffers exchange through CUDA multicast or IPC handles, which do not reach
  across InfiniBand (TransformerEngine#1071: "only possible with single-node tensor-parallelism";
  multi-node NVLink came with TE 2.2, #1470), and torch's async TP runs on symmetric memory, also
  intra-node; a TP group over nodes runs its collectives through NCCL, exposed.
- `tp_backward_reduce_scatter_exposed`: where the TP collectives are overlapped, whether the
  backward's reduce-scatters still run alone. torch's async TP (inductor's micro-pipeline pass,
  torchtitan's `enable_async_tensor_parallel`) fuses a reduce-scatter with the matmul that feeds
  it only where one matmul does: in backward the column-parallel projections' input gradient is
  a sum of matmuls (Q, K and V; gate and up), which the pass leaves unfused (pytorch/pytorch#149946,
  its review: the scaled_mm-reduce-scatter pattern is found in the forward graph only), so those
  reduce-scatters, half the backward's collectives, stay exposed. Transformer Engine's userbuffers
  overlap both directions.
- `sharded_grads_under_pp`: whether ZeRO-2/3 keep gradients sharded between the micro-batches of
  a pipeline. `torch.distributed.pipelining` turns FSDP's gradient sync off until the last
  micro-batch (`set_requires_gradient_sync(False)`, `set_reshard_after_backward(False)` in
  `pipelining/stage.py`), so under pp > 1 our runtime and torchtitan hold full gradients (and,
  for ZeRO-3, the unsharded weights) until the step's end and reduce-scatter once.
- `swiglu_saved_tensors`: f-wide tensors a SwiGLU MLP keeps for backward: 4 in eager PyTorch
  (gate, up, silu(gate), their product), 3 with a fused kernel (Transformer Engine and
  Megatron-Core's bias_swiglu keep the 2f-wide first projection and the product).
- `loss_grad_in_place`: Megatron's vocab-parallel cross entropy writes the logits' gradient over
  the softmax it saved; `torch.nn.functional.cross_entropy` allocates a new fp32 gradient.
- `dtensor_loss_parallel`: under TP the loss runs as torch's DTensor loss parallel
  (`torch.distributed.tensor.parallel.loss_parallel`, on by default in torchtitan): its backward
  (`_nll_loss_and_log_softmax_backward`) allocates a zero-filled fp32 gradient, exp of the saved
  fp32 log-probs and their sum before scaling it, 12 bytes a logit beside the saved 4, where
  `torch.nn.functional.cross_entropy` holds 8 (costmodel.memory.backward_working_bytes).
- `fused_cross_entropy`: the loss is one fused kernel over the logits in the compute dtype:
  flash-attn's `CrossEntropyLoss`, the default `loss_fn: fused_crossentropy` of llm-foundry's MPT
  models (`ComposerMPTCausalLM`, the MPT benchmark tables' runs). It keeps the 16-bit logits and
  one log-sum-exp per row for backward, not fp32 log-probabilities, and writes the gradient in
  the compute dtype; forward reads the logits once, backward reads them and writes the gradient.
- `fsdp_master_params`: FSDP's mixed precision keeps the sharded parameter in fp32 (it is the
  master weight) and casts a 16-bit copy on each gather: 16 bytes per parameter over the shards
  under ZeRO-3 (not the ZeRO paper's 2 + 2 + 12 with a separate 16-bit shard), and below ZeRO-3
  the fp32 shard plus a whole 16-bit copy held from forward to backward.
- `vendor_attention`: attention through Transformer Engine (cuDNN fused attention, FlashAttention-3
  class on Hopper) rather than PyTorch's FlashAttention-2 SDPA: the device's
  `vendor_attention_speedup` applies (costmodel.hardware.run_by).
- `flash_attention_1`: the framework's flash kernel is of FlashAttention's first generation (the
  CUDA kernel or its Triton port), as llm-foundry's MPT benchmarks ran it (`attn_impl: triton`
  or `flash` over flash-attn 1.x, torch 1.13 with triton-pre-mlir, before FlashAttention-2):
  FlashAttention-2 is "around 2x" faster than it (Dao 2023, arXiv 2307.08691, abstract; 1.3-2.5x
  over the Triton port), so the device's FlashAttention-2 figure is divided by FLASH1_SLOWDOWN.
- `tp_keeps_gathered_input`: under sequence parallelism, whether the column-parallel projections
  keep their all-gathered (whole-sequence) input for the weight gradient. torch's DTensor TP
  (`PrepareModuleInput` from `Shard(1)` to `Replicate()`, then `nn.Linear`) does: autograd saves
  the gathered tensor. Megatron-LM keeps the sequence shard and gathers it again in backward
  (Korthikanti et al. 2022 Sec. 4.2.2), so its inputs count 1/t; so does our runtime
  (runtime.sequence_parallel, measured by tests/runtime/test_activation_memory.py).
- `sp_regather_exposed`: where the saved sequence shard is all-gathered again in backward
  (`tp_keeps_gathered_input` off, under SP), whether that all-gather waits alone. Megatron-LM
  launches it asynchronously and computes the input gradient meanwhile
  (`LinearWithGradAccumulationAndAsyncCommunication.backward`), so it is not priced; our runtime
  (runtime.sequence_parallel) gathers, then computes: one more all-gather per block.
- `vocab_parallel_loss`: whether the loss runs on the vocabulary shards of the logits (Megatron's
  vocab-parallel cross entropy, torchtitan's `loss_parallel`), or, as in our runtime (output
  projection `ColwiseParallel(output_layouts=Replicate())`, then `F.cross_entropy`), every TP rank
  all-gathers the whole logits and computes the whole loss.
- `cpu_kernels`: torch's CPU kernels, which keep more for backward than the CUDA ones: RMSNorm is
  composite (`rms_norm_composite` keeps the normalised input besides the input; CUDA's fused
  kernel keeps the input and 1/rms), dropout multiplies by a mask in the compute dtype (CUDA's
  `native_dropout` keeps a 1-byte mask), and attention with dropout leaves the flash kernel for
  the math path (the s x s softmax, mask and dropped probabilities). Not a framework's choice but
  torch's on that device: `ClusterSpec` sets it for CPU profiles (`traits_on`). Measured by
  tests/runtime/test_activation_memory.py.
- `eager_layer`: the layer's memory-bound work as separate eager kernels (RoPE and its cos/sin
  tables, SwiGLU, residual adds and the gradient sums over shared inputs, each its own pass over
  the activations), as our runtime's `runtime.model` runs it on every device, instead of the
  fused kernels of Megatron-Core or Transformer Engine. On an H100, `python benchmarks/gpu_trace.py
  PLAN.json` on benchmarks/gpu_check.py's model (a 0.85B Llama-style model in bf16) puts such
  kernels at about a third of the step's device time, which a fused count would price at nothing
  (its GEMM-bound steps then too fast).
  IBM's fms-fsdp runs (`fms-fsdp`: FSDP1, `torch.compile` off) run the same kind of layer:
  foundation-model-stack's Llama has its own RMSNorm module (`LayerNormParameterized`, op by op),
  RoPE and the gated MLP as separate eager kernels.
- `eager_rms_norm_composite`: an eager layer's RMSNorm is a module of torch ops computed in fp32
  (cast up, pow, mean, add eps, rsqrt, multiply, cast back, times the weight: each its own kernel
  and pass over the activations, and its backward as autograd runs them), not torch's fused CUDA
  kernel: fms-fsdp's `LayerNormParameterized` (use_high_precision_pow), torchtitan's own `RMSNorm`
  class (2024, `torchtitan/models/norms.py`, `norm_type = "rmsnorm"`, before it moved to
  `nn.RMSNorm`). Its time is counted as torch's CPU composite is (costmodel.kernels.elementwise),
  at the compute dtype's width; a compiled layer fuses it. Its memory is priced as the fused
  kernel's: the CPU's measured count of what autograd keeps (the input in fp32 and a normalised
  copy) would put torchtitan's Llama 2 13B run without recomputation on 64 A100-80GB
  (profiles/runs, tt24a-l2-13b-noac) over the device, and that run was measured (every measured
  run fits: tests/planner/test_fidelity.py).
- `compiled_layer`: each transformer layer runs as `torch.compile` made it (`planner run
  --compile`, runtime.compile; torchtitan's regional compile): inductor fuses the layer's
  memory-bound work (norms, RoPE, SwiGLU, residual adds and the backward's sums) into a few
  kernels around the GEMMs and attention, so that work is priced at the fused count, fewer bytes
  and fewer kernels (hence less host cost per layer on a GPU), as Megatron-Core's fused kernels
  are, on a CPU too (inductor's C++ kernels), where `cpu_kernels` otherwise counts torch's eager
  ops. The embedding, the final norm, the head and the loss stay eager. Its activations are
  the eager layer's less one f-wide tensor of the SwiGLU (COMPILED_SWIGLU_SAVED): inductor's
  partitioner recomputes silu(gate) in the backward instead of saving it. On an H200 the compiled
  runs of benchmarks/gpu_check.py (16 layers, f 5632) allocated 11.3-11.5 KB a token and layer
  less than the eager ones (its --replay's allocated columns, eager less compiled, over tokens
  and layers), one bf16 tensor of width f (11.26 KB); under selective recomputation a
  hidden-wide tensor less again (15.3 KB), not modelled.
- `deferred_w_keeps_graph`: what a zero-bubble schedule's deferred weight pass holds. Qi et al.
  keep only the projections' inputs; torch pipelining's `stage_backward_input` runs
  `autograd.grad(..., retain_graph=True)` and starts the weight pass later from graph nodes that
  reach the whole stage, so every saved tensor of the micro-batch (logits included) lives until
  its weight pass (measured: tests/runtime/test_run_cli.py); torchtitan runs torch's schedules
  as they are, and keeps it too.
- `pipeline_sends_held`: torch's multi-stage schedule runner (`_PipelineScheduleRuntime`: our
  interleaved 1F1B, ZB-H1 and ZBV) keeps the Work of every send, and with it the tensor sent,
  until the step ends ("send ops should be waited on before step() exits"); its single-stage
  schedules (GPipe, 1F1B) wait each send at once. Run as it is, a 2-stage ZBV run's ranks grow by
  one activation per send until the step's end, and torchtitan runs it as it is: held. Our
  runtime's stages issue their sends themselves and let each go once delivered
  (runtime.pipeline), as Megatron's schedules do: not held (`python benchmarks/memory.py
  pipeline`, tests/runtime/test_run_cli.py).
- `pipe_engine_sends`: what DeepSpeed's PipelineEngine sends between stages (runtime/pipe/
  engine.py: `is_pipe_partitioned` follows model parallelism, `is_grad_partitioned` is False): the
  activation split over the TP ranks and gathered again after the receive, with the s x s
  attention mask in 16 bits beside it every micro-batch (GPT-NeoX and Megatron-DeepSpeed pass
  (hidden, mask) through the pipeline), and the gradient back whole from every TP rank. Megatron
  and our runtime send each rank's 1/t slice both ways.
- `bf16_optimizer_all_reduce`: DeepSpeed runs bf16 at ZeRO-1 with fp32 gradients through its
  BF16_Optimizer (runtime/engine.py `_do_optimizer_sanity_check`), which all-reduces the whole
  fp32 gradients after the backward (`allreduce_gradients` -> `buffered_allreduce_fallback` over
  `get_grads_for_reduction`; under a pipeline `_bf16_reduce_grads`), not overlapped, before each
  rank steps its partition and all-gathers the weights: twice a reduce-scatter's bytes, exposed.
- `ep_a2a_overlap`: Megatron-Core's `--overlap-moe-expert-parallel-comm` (usually with
  `--delay-wgrad-compute`), off by default: each steady-state step pairs one micro-batch's
  forward with another's backward layer by layer (pipeline_parallel/combined_1f1b.py,
  TransformerLayerSchedulePlan.run), every expert all-to-all on a communication stream under the
  other micro-batch's attention or experts; warmup forwards and cooldown backwards run alone, and
  an interleaved pipeline warms up one virtual micro-batch more to pair them (schedules.py), which
  it then holds. It needs EP > 1, no full recomputation, and a virtual pipeline where pp > 1
  (TransformerConfig's checks). Priced by costmodel.rank_time.ep_overlap; set per run by the runs
  table's `ep_overlap` column.
- `selective_modules`: what a plan's selective recomputation re-runs, Megatron-Core's
  `--recompute-modules` (TransformerConfig.recompute_modules; default `core_attn`, the attention
  core of Korthikanti et al.): `mla_up_proj` the latent attention's up-projections and RoPE (Q, K
  and V freed after the attention core), `mlp` a dense layer's MLP (not a mixture's), `moe_act`
  the experts' activation (the fc2 input freed), `layernorm` the norms Transformer Engine's spec
  keeps apart from a linear (latent attention's input norm, a mixture's pre-MLP norm). Each keeps
  its inputs and re-runs its forward in backward (costmodel.kernels.recompute_modules). Set by
  `--recompute-modules` (search and predict under --framework megatron; a plan file's cluster
  keeps it) and per run by the runs table's `recompute_modules` column; the search does not
  choose among module sets.
- `recv_buffers_kept`: torch's PipelineStage makes its receive buffers once, at its first step,
  one per micro-batch: the activation of every stage after the first and the output gradient of
  every stage before the last (torch/distributed/pipelining/stage.py, `_setup_forward_recv_info`,
  `_setup_backward_recv_info`), and keeps them across steps; torchtitan runs it as it is. Our
  runtime empties each once its micro-batch's backward is done (runtime.pipeline), and Megatron
  allocates a receive when it comes: four boundary tensors in flight
  (costmodel.memory.stage.pipeline_buffer_bytes).
- `cp_all_gather_kv`: how context parallelism exchanges keys and values. Our runtime
  (runtime.context_parallel) all-gathers the whole sequence's K/V before attention and
  reduce-scatters their gradients, neither overlapped, and keeps the gathered K/V for backward
  (Llama 3, Dubey et al. 2024 Sec. 3.3.2); each rank then runs one attention kernel per chunk it
  holds. torch's `context_parallel` (torchtitan) all-gathers too. Megatron-Core with Transformer
  Engine passes K/V around a ring (cp-1 hops overlapped with the partial kernels, each merged into
  the output with its softmax statistics) and keeps only its own block.
- `mtp_with_cp`: multi-token prediction under context parallelism: its labels and embeddings
  shifted by k positions cross the CP ranks' chunks, which Megatron-Core's `roll_tensor` exchanges
  (multi_token_prediction.py, its cp_group); our runtime (runtime.mtp) does not, and refuses it.
- `grouped_expert_gemm`: a device's experts run each projection as one grouped GEMM
  (Megatron-Core's `--moe-grouped-gemm`, Transformer Engine's GroupedLinear), their output tiles
  sharing the SMs' waves, instead of one GEMM per expert as our runtime (runtime.moe) runs them:
  many small experts (Qwen3-235B: 16 a device, a few hundred rows each) otherwise leave most of a
  wave idle per expert (costmodel.kernels.gemm.grouped_gemm_s).
- `dispatch_per_node`: the expert all-to-all sends a token once to each node holding some of its
  experts and forwards it inside the node (DeepSeek-V3, arXiv 2412.19437 Sec. 3.2.2; DeepEP,
  which Megatron-Core runs as its flex token dispatcher), so a token's network copies are the
  nodes its experts lie on, bounded under node-limited routing; it delivers a token once to each
  rank holding some of its experts, and across nodes its NVLink leg (at the node tier's
  forward_bytes_per_s where published) and network leg overlap (costmodel.moe_dispatch). Our
  runtime's all-to-all (runtime.moe) sends every routed row alone.
- `moe_probs_in_activation`: each routed row's gating weight multiplies inside the experts' fused
  SwiGLU (Megatron-Core's TEGroupedMLP calls `weighted_bias_swiglu_impl` with the permuted
  probabilities; the combine then only scatter-adds), so a routed slot keeps its probability and
  its place in the row map, not its expert output before and after weighting as our runtime's
  mixture does (runtime.moe: the weighted outputs are summed by index_add).
- `ep_folds_over_tp`: Megatron-Core's MoE parallel folding (Liu et al. 2025, arXiv 2504.14960;
  Megatron-Core MoE README): with expert TP 1 the experts' ranks are the same tp x cp x dp ranks
  decomposed anew, ep x edp (parallel_state's expert grid), so an EP group is the ep innermost
  ranks, TP first (inside a node), then CP, then DP, up to all tp x cp x dp ranks of a pipeline
  stage (costmodel.placement.expert_layout); each rank holds num_experts/ep experts whole (no TP
  replica), and an expert's states are sharded over the tp x cp x dp / ep ranks holding it
  (costmodel.params.expert_dp). Our runtime folds it the same way (runtime.parallel lays out the
  groups expert_layout gives) and runs a plan made for a framework that carves EP from data
  parallelism (ep consecutive dp ranks, the mixture whole on every TP rank) carved. torchtitan
  0.2 folds the same way at its expert TP 1 (ParallelDims.build_mesh unflattens the same ranks,
  pp>dp_replicate>dp_shard>cp>tp, as pp>dp_replicate>efsdp>ep>etp: the EP group is the ep
  innermost, TP first), which its export writes (expert_tensor_parallel_degree = 1).
- `expert_tensor_parallel`: each routed expert can be split over etp ranks (Plan.etp; Megatron-Core's
  `--expert-tensor-parallel-size`: TEGroupedMLP's projections column- then row-parallel over the
  expert TP group, the routed rows all-gathered over it after the all-to-all and reduce-scattered
  before the return, token_dispatcher.py), the etp innermost ranks of its expert grid
  (costmodel.placement.expert_layout). Our runtime runs such a plan as Megatron-Core lays it out
  (runtime.moe: the same gather and reduce-scatter, tests/runtime/test_moe_etp.py), but its own
  search does not offer expert TP: that space took Mixtral 8x7B's search on 8x8xH100 from 1.4 s to
  2.1 s for no better plan. torchtitan 0.2 allows
  only etp 1 or etp = tp, the latter with EP carved from dp x cp beside the TP group, and its main
  branch removed expert TP (pytorch/torchtitan#3167); neither is offered for it here.
- `shared_expert_tp`: a mixture's shared expert (ModelSpec.shared_expert_ffn_hidden_size) is split
  over the dense TP group as a dense MLP is: Megatron-Core's SharedExpertMLP is an MLP built on
  the TP process group (`tp_group=pg_collection.tp`, moe/shared_experts.py: its fc1 column- and
  fc2 row-parallel, not over the expert TP group), so each rank holds, trains and steps 1/tp of
  its projections, runs them over the whole micro-batch's tokens at 1/tp of the width, and pays
  a dense MLP's TP collectives for it (with sequence parallelism, which Megatron requires for
  MoE under TP, its own all-gather of the sequence shard before fc1 and reduce-scatter after
  fc2, the duals in backward; overlapped by Transformer Engine's userbuffers as the dense
  blocks' are, its fc1/fc2 buffers; `--moe-shared-expert-overlap`, which moves them beside the
  token dispatcher, is not set by our export and not priced). Its sigmoid gate (1 x h) stays
  whole on every rank. torchtitan does the same (`moe.shared_experts.w1/w3` ColwiseParallel,
  `w2` RowwiseParallel in 0.2's llama4 `apply_moe_ep_tp`, the dense-family plan of
  models/common/moe_sharding.py since), inside the mixture's one all-gather of its input and one
  reduce-scatter of its output: the same bytes. Our runtime (runtime.moe) keeps the shared
  expert whole on every TP rank over the rank's sequence shard, with no collective of its own.
- `dp_collectives_per_layer`: every ZeRO stage synchronises one FSDP unit at a time, each unit's
  collectives paying their own latency. Our runtime runs ZeRO-0 to 2 with FSDP2 too, a unit of a
  layer under ZeRO-3 and of a bucket's layers below it (costmodel.params.fsdp_unit_layers:
  Megatron-Core's 40M-parameter bucket; a stage of smaller layers is one unit whole), so a step
  issues a reduce-scatter (or an all-reduce) and an all-gather per unit. A unit per layer below
  ZeRO-3 would pay each collective's latency once per layer, which on gloo (a rendezvous of the
  ranks whatever the bytes) outweighs a small model's compute; the bucket bounds that count.
- `fsdp_block_units`: the framework's FSDP wraps each transformer block as a unit at every stage
  that shards (FSDP1's transformer_auto_wrap_policy, as llm-foundry and fms-fsdp wrap; FSDP2's
  fully_shard per block, as torchtitan does), so with sharded gradients and whole weights
  (ZeRO-2: SHARD_GRAD_OP, reshard_after_forward=False) each block still gathers its weights and
  reduce-scatters its gradients on its own, each collective paying its latency, as under ZeRO-3
  (ZeRO-1, which these frameworks do not run, is priced alike: a pipeline's ZeRO-2 is its twin);
  no sharding (ZeRO-0) is DDP's bucketed all-reduce.
- `hybrid_shard`: the framework can shard ZeRO's states over part of the data-parallel ranks and
  replicate the shards over the rest (HSDP, Plan.dp_replicate): torchtitan's
  `data_parallel_replicate_degree` x `data_parallel_shard_degree` (FSDP2 over a 2-D mesh: each
  gradient reduce-scattered inside its shard group, then the shard all-reduced over the
  replicas), FSDP1's `HYBRID_SHARD` (fms-fsdp's `sharding_strategy = "hsdp"`, Composer's
  `sharding_strategy: HYBRID_SHARD`), and our runtime (runtime.parallel: FSDP2 over the same 2-D
  mesh). DeepSpeed's hpZ is another mechanism, not priced here.
- `partial_distributed_optimizer`: hybrid sharding at ZeRO-1 only: Megatron-Core's
  `--num-distributed-optimizer-instances R` shards the distributed optimizer over (dp x cp) / R
  consecutive ranks of the data-parallel group (parallel_state's intra-partial data-parallel
  groups: the shard group is dp.in with cp, as `hybrid_layout` cuts it), reduce-scatters the
  gradients inside an instance and all-reduces the shard over the R instances, and gathers the
  updated weights inside it; the same collectives as HSDP's at ZeRO-1. Megatron-FSDP's stages are
  not offered with it.
- `zero3_gathers_per_param`: DeepSpeed ZeRO-3 gathers parameter by parameter (many small
  collectives, each paying the ring latency) rather than one flat buffer per layer as FSDP does.
- `recompute_placement`: under interleaving, which of a rank's layers are the recomputed ones
  (Plan.recompute_per_stage). `first`: its first layers in model order, its first chunk first,
  as our runtime (runtime.parallel.recomputed_layers). `each_chunk`: Megatron's block method
  recomputes the first `--recompute-num-layers` of every model chunk (each virtual stage builds
  its own TransformerBlock, whose checkpointing counts its own layers: megatron/core/recompute.py,
  the block branch over `num_layers_per_pipeline_rank`). `every_nth`: torchtitan's layer-level
  checkpointing wraps every n-th block a process builds, counted by one module-level counter
  across its model chunks (`_apply_layer_sac`, `_layer_sac_count`). The first chunk holds the
  most micro-batches at the peak, so where they sit moves the peak.
- `grads_reduced_after_pipeline`: DeepSpeed's PipelineEngine (Megatron-DeepSpeed's pipeline)
  reduces the data-parallel gradients as an instruction of its own after the last micro-batch's
  backward (deepspeed/runtime/pipe/schedule.py TrainSchedule: ReduceTiedGrads, ReduceGrads,
  OptimizerStep at the final step), so under a pipeline nothing hides them whatever
  `dp_grad_overlap` says.
- `grad_overlap_zero3_only`: the reduction overlaps the backward only under ZeRO-3. DeepSpeed's
  `zero_optimization.overlap_comm`, unset, is true for stage 3 and false below it
  (deepspeed/runtime/zero/config.py, overlap_comm_valid), and Megatron-DeepSpeed's ZeRO-0/1
  configurations leave it unset (examples_deepspeed/rebase/ds_config_*_zero1.json), so below
  ZeRO-3 its buckets reduce on the compute stream. Our DeepSpeed export sets it (exports.deepspeed),
  so `deepspeed` plans keep `dp_grad_overlap` at every stage.
- `float8_casts_fused`: how float8 linears (Plan.fp8_linears) scale and cast their operands.
  torchao in eager mode runs each cast as six full-tensor kernels (abs, max, to
  fp32, multiply by the scale, clamp, to float8: 33 bytes per element) and casts six times per
  linear (input and weight forward, output gradient and weight for the input gradient, output
  gradient and input again for the weight gradient); compiled (torchtitan's float8 runs use
  torch.compile; our runtime compiles each float8 linear on CUDA) or Transformer Engine's fused
  kernels: one amax read and one scaled cast (5
  bytes per element), three casts per linear, the backward reusing the forward's.
- `float8_param_gather`: with float8 linears, the weights are kept and all-gathered in float8 (one
  byte an element instead of two): Megatron-Core's `--fp8-param-gather` (Transformer Engine's
  `fp8_model_init`), which NVIDIA's float8 recipes set (NeMo's `bf16_with_fp8_mixed` fp8_params,
  Megatron-Bridge's float8 presets, MLPerf's FP8_PARAMS). Priced on the distributed optimizer's
  weight all-gather, every gathered element at a byte (the embedding and norms that stay 16-bit
  are under 1 % of a large model's weights); the weights' memory is left as it is, Transformer
  Engine keeping a transposed float8 copy beside the float8 weight on Hopper.
- `float8_with_tp`: float8 linears under tensor parallelism: Transformer Engine's fp8 GEMMs
  inside Megatron-Core's column- and row-parallel layers, torchao's float8 tensor-parallel
  styles in torchtitan; our runtime does not apply those styles (float8 without TP only).
- `float8_experts`: float8 linears reach a mixture's experts: Megatron-Core's TEGroupedMLP runs
  each projection of a device's experts as Transformer Engine's GroupedLinear, which takes the
  fp8 recipe as every TE linear does (its inputs split-quantized per expert, one multi-tensor
  cast), and the shared experts are TE linears; the router and the token dispatch stay bf16
  (Megatron-Bridge's float8 recipes, `bf16_with_fp8_current_scaling_mixed` on H100 and
  `bf16_with_mxfp8_mixed` on B200, set no float8 dispatch). Priced in
  costmodel.kernels.gemm._moe_gemms_s. Our runtime's experts are batched weights
  (runtime.moe) that torchao's float8 linears do not reach, and torchao's float8 grouped GEMM
  (`torchao.prototype.moe_training`, torch `_scaled_grouped_mm`) has no CPU kernel, so it
  refuses float8 with experts (costmodel.check.fp8_problems).
- `float8_saved_inputs`: a float8 linear keeps its input for the weight gradient in float8 (one
  byte an element, the column-wise copy the weight-gradient GEMM reads): Transformer Engine's
  Linear, LayerNormLinear and GroupedLinear keep the quantized input and drop its row-wise data
  after the forward GEMM (transformer_engine/pytorch/module/linear.py, grouped_linear.py:
  `inputmat.update_usage(rowwise_usage=False, columnwise_usage=True)`; TE's docs: "With FP8, TE
  saves quantized tensors"). The attention's output, which the attention keeps in 16 bits for
  its own backward, gains a float8 copy beside it; a mixture's router keeps its 16-bit input
  (costmodel.memory.activations). torchao's float8 linears (torchtitan, our runtime) keep the
  16-bit input and cast it again in backward.
- `fused_grad_accumulation`: the weight-gradient GEMMs add into the fp32 gradient buffer
  themselves (Megatron's `gradient_accumulation_fusion` with APEX's `fused_weight_gradient_mlp_cuda`,
  on unless `--no-gradient-accumulation-fusion`; in Megatron-LM since commit 83b1e42 of
  2022-02-13, before the sequence parallelism of Korthikanti et al.'s runs), so a micro-batch's
  GEMM-made gradients cost no pass of their own; the embedding's is added into `main_grad` by a
  hook every micro-batch. Narayanan et al.'s SC'21 runs predate it and added each
  micro-batch's gradients into `main_grad` in a hook: their rows leave that pass unpriced.
  Elsewhere every micro-batch after the first adds its gradients into the step's in place:
  autograd's `grad += new` in fp32, FSDP2's fp32 `unsharded_accumulated_grad += bf16 grad` under
  mixed precision, or, with ZeRO-2/3 reducing every micro-batch, the reduced shard into the
  sharded gradient (costmodel.rank_time.grad_accumulation_s).
- `one_replica_fsdp`: FSDP2 wraps a plan with one data-parallel replica too, wherever it has
  something to do (costmodel.memory.runtime_wraps_in_fsdp: 16-bit compute, TP, offload), so its
  reduction and its gathers run on a one-rank group: no collective, but FSDP's copies and casts
  into and out of its flat buffers, which a plan with more replicas pays inside its collectives'
  fitted time; here they are priced alone, at the profile's FSDP rates
  (costmodel.rank_time.one_replica_fsdp_s). Our runtime's trait.
- `own_pipeline_schedules`: the framework runs pipeline schedules of its own rather than
  `torch.distributed.pipelining`'s, whose Schedule1F1B refuses fewer micro-batches than stages.
  Megatron's 1F1B warms up min(p - rank - 1, m) micro-batches (schedules.py,
  forward_backward_pipelining_without_interleaving) and DeepSpeed's TrainSchedule runs
  2(m + p - 1) steps for any m, so a step of fewer micro-batches than stages runs there, its
  bubble (p - 1)/(m + p - 1) priced as any 1F1B's. Off for our runtime and torchtitan.
- `empty_end_stages`: the first and the last virtual pipeline stage may hold no layer, only the
  embedding or the final norm, head and loss. Megatron-Core counts the embedding and the loss as
  a layer each under `--account-for-embedding-in-pipeline-split` and
  `--account-for-loss-in-pipeline-split`, so 94 layers split into pp 32 x vpp 3 = 96 stages of
  one unit (the Megatron-MoE model zoo's Qwen3-235B layout), and its explicit
  `--pipeline-model-parallel-layout` may give the first stage the embedding alone or the last the
  MTP modules and the loss alone (Megatron-Bridge's DeepSeek-V3 `...|mL`); elsewhere every stage
  needs a layer.
- `recompute_early_stop`: a fully recomputed layer stops before its last projection. Our runtime
  wraps each layer in torch's non-reentrant checkpoint (`checkpoint_wrapper`), whose early stop
  (on by default) ends the recomputation once every tensor the backward needs is saved again; the
  MLP's down projection saves its input before its GEMM runs, so that GEMM and the residual add
  after it are never recomputed (costmodel.kernels.final_linear_forward_s; listed by
  tests/runtime/test_recompute_early_stop.py), and the recomputed forward costs less than a
  training forward. Megatron-LM's own checkpoint recomputes the whole layer; for the other
  frameworks' published runs what their checkpoint wrapper did is not recorded, and they keep the
  whole forward.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from costmodel.selective_modules import DEFAULT_SELECTIVE_MODULES


@dataclass(frozen=True, kw_only=True, slots=True)
class FrameworkTraits:
    name: str
    dp_grad_overlap: bool
    dp_param_overlap: bool
    sharded_grads_under_pp: bool
    zero3_gathers_per_param: bool
    recompute_placement: str = "first"
    dp_collectives_per_layer: bool = False
    fsdp_block_units: bool = False
    swiglu_saved_tensors: int = 4
    loss_grad_in_place: bool = False
    dtensor_loss_parallel: bool = False
    fused_cross_entropy: bool = False
    fsdp_master_params: bool = False
    vendor_attention: bool = False
    flash_attention_1: bool = False
    tp_keeps_gathered_input: bool = False
    sp_regather_exposed: bool = False
    vocab_parallel_loss: bool = True
    cpu_kernels: bool = False
    eager_layer: bool = False
    eager_rms_norm_composite: bool = False
    deferred_w_keeps_graph: bool = False
    pipeline_sends_held: bool = False
    recv_buffers_kept: bool = False
    cp_all_gather_kv: bool = False
    float8_casts_fused: bool = False
    float8_with_tp: bool = False
    float8_param_gather: bool = False
    float8_experts: bool = False
    float8_saved_inputs: bool = False
    tp_comm_overlap: bool = False
    tp_backward_reduce_scatter_exposed: bool = False
    ep_folds_over_tp: bool = False
    expert_tensor_parallel: bool = False
    recompute_early_stop: bool = False
    fused_grad_accumulation: bool = False
    one_replica_fsdp: bool = False
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
    bf16_optimizer_all_reduce: bool = False
    ep_a2a_overlap: bool = False
    selective_modules: tuple[str, ...] = DEFAULT_SELECTIVE_MODULES


GENERIC = FrameworkTraits(name="generic", dp_grad_overlap=True, dp_param_overlap=True,
                          sharded_grads_under_pp=True, zero3_gathers_per_param=False)

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
                          recompute_early_stop=True, one_replica_fsdp=True, ep_folds_over_tp=True,
                          hybrid_shard=True, own_pipeline_schedules=False)

# f-wide tensors a compiled SwiGLU keeps for backward (`compiled_layer`): eager's four less
# silu(gate), which inductor recomputes
COMPILED_SWIGLU_SAVED = 3

# The same executor with its layers compiled (planner run --compile).
COMPILED_RUNTIME = replace(RUNTIME, name="planner-compiled", eager_layer=False, compiled_layer=True,
                           swiglu_saved_tensors=COMPILED_SWIGLU_SAVED)

_MEGATRON = dict(sharded_grads_under_pp=True, zero3_gathers_per_param=False, loss_grad_in_place=True,
                 fused_grad_accumulation=True, recompute_placement="each_chunk")
_FSDP = dict(dp_grad_overlap=True, dp_param_overlap=True, zero3_gathers_per_param=False, hybrid_shard=True,
             fsdp_master_params=True, fsdp_block_units=True)
_DEEPSPEED = dict(dp_grad_overlap=True, dp_param_overlap=False, sharded_grads_under_pp=True,
                  zero3_gathers_per_param=True, grads_reduced_after_pipeline=True, pipe_engine_sends=True,
                  bf16_optimizer_all_reduce=True)

FRAMEWORKS: dict[str, FrameworkTraits] = {t.name: t for t in (
    RUNTIME,
    COMPILED_RUNTIME,
    GENERIC,
    FrameworkTraits(name="megatron-lm", dp_grad_overlap=False, dp_param_overlap=False,
                    **_MEGATRON),
    FrameworkTraits(name="megatron-core", dp_grad_overlap=True, dp_param_overlap=True, tp_comm_overlap=True,
                    swiglu_saved_tensors=3, vendor_attention=True, float8_casts_fused=True, float8_with_tp=True,
                    float8_param_gather=True, float8_experts=True, float8_saved_inputs=True, ep_folds_over_tp=True, expert_tensor_parallel=True,
                    dp_sync_per_chunk=True,
                    dispatch_per_node=True, moe_probs_in_activation=True,
                    grouped_expert_gemm=True, mtp_with_cp=True, shared_expert_tp=True,
                    partial_distributed_optimizer=True, empty_end_stages=True, **_MEGATRON),
    FrameworkTraits(name="megatron-deepspeed", **{**_DEEPSPEED, "loss_grad_in_place": True,
                                                   "grad_overlap_zero3_only": True}),
    FrameworkTraits(name="deepspeed", **_DEEPSPEED),
    FrameworkTraits(name="composer-fsdp", sharded_grads_under_pp=True, flash_attention_1=True,
                    fused_cross_entropy=True, **_FSDP),
    FrameworkTraits(name="fms-fsdp", sharded_grads_under_pp=True, eager_layer=True, eager_rms_norm_composite=True,
                    **_FSDP),
    FrameworkTraits(name="torchtitan", sharded_grads_under_pp=False, tp_keeps_gathered_input=True,
                    recv_buffers_kept=True, pipeline_sends_held=True, tp_backward_reduce_scatter_exposed=True,
                    dtensor_loss_parallel=True,
                    cp_all_gather_kv=True, float8_casts_fused=True, float8_with_tp=True,
                    deferred_w_keeps_graph=True, shared_expert_tp=True, eager_rms_norm_composite=True,
                    ep_folds_over_tp=True, recompute_placement="every_nth", own_pipeline_schedules=False,
                    **_FSDP),
)}


def shards_in_part(traits: FrameworkTraits, zero_stage: int) -> bool:
    """Whether the framework shards ZeRO's states over part of the data-parallel ranks at this
    stage: hybrid sharding (`hybrid_shard`) at any, Megatron's optimizer instances at ZeRO-1."""
    return traits.hybrid_shard or (traits.partial_distributed_optimizer and zero_stage == 1)


def composite_rms_norm(traits: FrameworkTraits) -> bool:
    """Whether RMSNorm's time is torch's ops in fp32 rather than one fused kernel's: torch's CPU
    kernels (`cpu_kernels`), or an eager GPU layer whose framework writes RMSNorm op by op
    (`eager_rms_norm_composite`); a compiled layer's is fused."""
    return traits.cpu_kernels or (traits.eager_rms_norm_composite and traits.eager_layer and not traits.compiled_layer)


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


def framework_traits(name: str | None) -> FrameworkTraits:
    """The traits of a named framework; `GENERIC` for an empty or unknown name."""
    return FRAMEWORKS.get(_key(name), GENERIC)


def framework_known(name: str | None) -> bool:
    """Whether the name is one of FRAMEWORKS (else framework_traits gives GENERIC)."""
    return _key(name) in FRAMEWORKS


def _key(name: str | None) -> str:
    return (name or "").strip().lower()


def traits_on(traits: FrameworkTraits, device_kind: str) -> FrameworkTraits:
    """A framework's traits with torch's kernels on this kind of device (`cpu_kernels`)."""
    cpu = device_kind == "cpu"
    return traits if traits.cpu_kernels == cpu else replace(traits, cpu_kernels=cpu)


# FlashAttention-2 over the first generation, fwd + bwd (Dao 2023, arXiv 2307.08691: "around 2x")
FLASH1_SLOWDOWN = 2.0


def attention_speedup(traits: FrameworkTraits, vendor_speedup: float) -> float:
    """What a framework's attention gains over FlashAttention-2: the device's vendor speedup
    where it calls the vendor's kernel (`vendor_attention`), a loss where its kernel is of the
    first generation (`flash_attention_1`), else nothing."""
    if traits.vendor_attention:
        return vendor_speedup
    return 1.0 / FLASH1_SLOWDOWN if traits.flash_attention_1 else 1.0
