"""DeepSpeed: a `ds_config.json` (and the launcher line) for a training script that builds the
model as a `deepspeed.pipe.PipelineModule` when the plan has a pipeline.

What DeepSpeed cannot say of our plans, and the nearest it runs (each a line of the export):
- its pipeline engine runs one 1F1B-style schedule with one stage per rank: GPipe, interleaved
  and zero-bubble schedules become 1F1B, one stage per rank; its partitioner, told the
  transformer block's class (`partition_method='type:<class>'`), balances blocks over the stages,
  so other splits become the even one ('uniform' would count the embedding and the head as
  items too and shift the blocks);
- with a pipeline, ZeRO-2/3 are not run (its pipeline engine takes ZeRO-0/1): ZeRO-1;
- tensor parallelism is AutoTP (`tensor_parallel.autotp_size`), which has no sequence
  parallelism and no ZeRO-3: without SP, and ZeRO-2 at most. It does not combine with the
  pipeline engine (the engine replaces the PipelineModule's grid with AutoTP's data x tensor
  groups over the whole world): a plan with both is refused. Under AutoTP DeepSpeed counts the
  tensor-parallel ranks in `train_batch_size` too, so the file leaves it out (DeepSpeed derives
  it from the micro-batch and accumulation steps, which say the plan's global batch);
- context parallelism is not ours (DeepSpeed-Ulysses exchanges heads, not K/V): its ranks become
  data-parallel replicas;
- recomputation is per layer block, all or nothing: all layers in full where the plan recomputes
  any (our selective, core attention only, has no DeepSpeed equivalent);
- rank order: pipe, data, model (outermost first: pp>dp>tp); other mesh orders become it;
- experts: DeepSpeed-MoE takes its expert-parallel size in the model code, not in this file,
  and its engine refuses MoE layers under ZeRO-3: ZeRO-2;
- float8 linears: DeepSpeed's config has none (Transformer Engine goes in the model code): bf16.

ZeRO-3 is written with the prefetch it is priced with: the next layer's parameters gathered
behind the current layer's compute, two layers live, a layer's weights kept from its recomputed
forward to its backward (`stage3_prefetch_bucket_size`, `stage3_max_live_parameters`,
`stage3_max_reuse_distance`), where DeepSpeed's defaults prefetch by its own bounds.
"""
from __future__ import annotations

from costmodel.params import layer_params
from costmodel.plan import Plan, PlanFile, Recompute, even_layers
from costmodel.schedules import Schedule
from costmodel.specs import DType, ModelSpec, TrainSpec
from planner import outputs
from planner.exports.common import (
    Adjusted,
    CannotExport,
    activations_on_device,
    fold_cp_into_dp,
    one_shard_group,
    recompute_is_uniform,
    to_even_layers,
    to_rank_order,
    to_schedule,
    to_uniform_recompute,
)

NAME = "deepspeed"
FRAMEWORK = "deepspeed"
SUFFIX = ".json"
# the ZeRO stages its pipeline engine runs
ZERO_STAGES_WITH_PP = frozenset({0, 1})
ORDER = ("pp", "dp", "cp", "tp")   # DeepSpeed's PipeModelDataParallelTopology: pipe, data, model


def zero_stages(train: TrainSpec) -> frozenset[int]:
    """The ZeRO stages it runs for this training (`nearest` moves the others; planner.targets
    keeps the search from listing them): without ZeRO, only gradients in the model's dtype."""
    return frozenset({0, 1, 2, 3}) if train.grad_dtype is train.compute_dtype else frozenset({1, 2, 3})


def nearest(pf: PlanFile) -> Adjusted:
    if pf.plan.tp > 1 and pf.plan.pp > 1:   # engine._configure_tensor_parallel_states replaces the grid
        raise CannotExport(f"deepspeed cannot run this plan: its AutoTP (tp {pf.plan.tp}) does not combine with its "
                           f"pipeline engine (pp {pf.plan.pp}): AutoTP makes its own data x tensor groups over the "
                           "whole world in place of the PipelineModule's grid")
    adj = Adjusted(pf.plan)
    one_shard_group(adj, "DeepSpeed", "ZeRO")
    layers = pf.model.num_layers
    plan = adj.plan
    if plan.pp > 1 and (plan.schedule is not Schedule.ONE_F_ONE_B or plan.vpp > 1):
        to_schedule(adj, layers, Schedule.ONE_F_ONE_B, 1, f"schedule {plan.schedule}"
                    f"{f' (v={plan.vpp})' if plan.vpp > 1 else ''}: DeepSpeed's pipeline engine runs 1F1B "
                    "with one stage per rank")
    if adj.plan.pp > 1 and adj.plan.layers_per_stage != even_layers(layers, adj.plan.pp):
        to_even_layers(adj, layers, f"layers per stage {list(adj.plan.layers_per_stage)}: DeepSpeed's "
                                    "partitioner balances transformer blocks ('type:<block class>')")
    if adj.plan.cp > 1:
        fold_cp_into_dp(adj, pf.train.global_batch_size,
                        f"cp={adj.plan.cp}: DeepSpeed has no K/V-exchanging context parallelism (Ulysses "
                        f"exchanges heads); dp={adj.plan.dp * adj.plan.cp}, cp=1")
    plan = adj.plan
    if plan.pp > 1 and plan.zero_stage not in ZERO_STAGES_WITH_PP:
        adj.change(f"zero {plan.zero_stage} with a pipeline: DeepSpeed's pipeline engine runs ZeRO-0/1; ZeRO-1",
                   zero_stage=1)
    if adj.plan.tp > 1 and adj.plan.zero_stage == 3:
        adj.change("zero 3 with tensor parallelism: DeepSpeed's AutoTP trains with ZeRO-0/1/2; ZeRO-2",
                   zero_stage=2)
    if pf.model.is_moe and adj.plan.zero_stage == 3:
        adj.change("zero 3 with experts: DeepSpeed's engine refuses MoE layers under ZeRO-3; ZeRO-2",
                   zero_stage=2)
    t = pf.train
    if adj.plan.zero_stage not in zero_stages(t):
        # engine._do_optimizer_sanity_check: without ZeRO, gradients in the model's dtype only (0.19
        # raises NotImplementedError for bf16's in fp32, which older versions took)
        adj.change(f"zero 0 with {t.compute_dtype} compute and {t.grad_dtype} gradients: DeepSpeed adds gradients "
                   "in another dtype than the model's only under ZeRO; ZeRO-1", zero_stage=1)
    if adj.plan.tp > 1 and adj.plan.sequence_parallel:
        adj.change("sequence parallelism: DeepSpeed's AutoTP has none; tensor parallelism without it",
                   sequence_parallel=False)
    plan = adj.plan
    if plan.recompute is Recompute.SELECTIVE:
        to_uniform_recompute(adj, Recompute.FULL, "selective recomputation (core attention): DeepSpeed "
                                                  "checkpoints whole layers; full recomputation of every layer")
    elif plan.recompute is Recompute.FULL and not recompute_is_uniform(plan):
        to_uniform_recompute(adj, Recompute.FULL, f"full recomputation of {list(plan.recompute_num_layers)} "
                                                  "layers per rank: DeepSpeed checkpoints every layer or none; "
                                                  "every layer")
    to_rank_order(adj, (ORDER,), "DeepSpeed lays ranks out as pipe, data, model (pp>dp>tp)")
    if adj.plan.fp8_linears:
        adj.change("fp8 linears: DeepSpeed's config has no float8 (Transformer Engine layers go in the model "
                   "code); bf16 linears", fp8_linears=False)
    if pf.model.is_moe:
        adj.differences.append(f"experts: build the mixture with deepspeed.moe.layer.MoE(num_experts="
                               f"{pf.model.num_experts}, ep_size={adj.plan.ep}, k={pf.model.experts_per_token}) "
                               "in the model code; the config file has no place for it")
    activations_on_device(adj, NAME)
    return adj


def config(pf: PlanFile, plan: Plan) -> dict:
    t = pf.train
    cfg: dict = {
        # under AutoTP DeepSpeed counts the world's ranks in it (no mpu): derived, not given
        **({"train_batch_size": t.global_batch_size} if plan.tp == 1 else {}),
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.num_micro_batches,
        "zero_optimization": {"stage": plan.zero_stage, "overlap_comm": True, "contiguous_gradients": True,
                              # ZeRO-Offload: states and their step (DeepSpeed's CPU Adam) on the host
                              **({"offload_optimizer": {"device": "cpu", "pin_memory": True}}
                                 if plan.offload_optimizer else {}),
                              **(_zero3_prefetch(pf.model, plan) if plan.zero_stage == 3 else {})},
        "gradient_clipping": 1.0,
    }
    if t.compute_dtype is DType.BF16:
        cfg["bf16"] = {"enabled": True}
    elif t.compute_dtype is DType.FP16:
        cfg["fp16"] = {"enabled": True}
    if t.compute_dtype is not DType.FP32:
        # the dtype the gradients are kept and added in, as priced: DeepSpeed's own default has
        # been the model's dtype or fp32 by version and ZeRO stage (engine.get_data_types)
        cfg["data_types"] = {"grad_accum_dtype": t.grad_dtype.value}
    if plan.tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": plan.tp}
    if plan.pp > 1:
        # what its pipeline engine reads here; stages and their partition are the PipelineModule's
        cfg["pipeline"] = {"activation_checkpoint_interval": 1 if plan.recompute is Recompute.FULL else 0}
    if plan.recompute is Recompute.FULL:
        cfg["activation_checkpointing"] = {"partition_activations": False, "contiguous_memory_optimization": False,
                                           "number_checkpoints": pf.model.num_layers}
    return cfg


def _zero3_prefetch(model: ModelSpec, plan: Plan) -> dict[str, int]:
    """ZeRO-3's gathers as priced: the next layer's behind the current one's compute, two layers
    live (costmodel.memory.buffer_bytes), a layer's weights kept from its recomputed forward for
    its backward. DeepSpeed's defaults (costmodel.zero3_coordinator: a prefetch bucket of 5e7
    elements, 1e9 live parameters, weights kept for any use within 1e9) prefetch less than a layer
    where a layer passes 5e8 parameters, none behind a weight of 1e9 or more, and keep more than
    two where layers are small."""
    layer = layer_params(model, plan.tp, plan.ep)   # a layer as this rank gathers it
    return {"stage3_prefetch_bucket_size": layer, "stage3_max_live_parameters": 2 * layer,
            "stage3_max_reuse_distance": layer}


def render(pf: PlanFile, plan: Plan) -> tuple[str, str]:
    c = pf.cluster
    # a PipelineModule only with a pipeline: DeepSpeed's pipeline engine refuses ZeRO-2/3
    script = (f"with pp={plan.pp} it builds a PipelineModule(num_stages={plan.pp}, partition_method="
              f"'type:<your transformer block class>'): {_blocks_per_stage(pf.model.num_layers, plan.pp)}"
              if plan.pp > 1 else "it wraps the model with deepspeed.initialize, no PipelineModule")
    hosts, per_host = c.launch_hosts
    if plan.tp > 1:
        script += (f"; train_batch_size is left for DeepSpeed to derive: under AutoTP it counts all "
                   f"{c.world_size} ranks, where {plan.micro_batch_size} x {plan.num_micro_batches} steps x "
                   f"dp {plan.dp} = {pf.train.global_batch_size} sequences a step")
    launch = (f"deepspeed --num_nodes {hosts} --num_gpus {per_host} train.py --deepspeed "
              f"--deepspeed_config FILE (train.py: your script; {script})")
    return outputs.json_text(config(pf, plan)), launch


def _blocks_per_stage(num_layers: int, pp: int) -> str:
    """What that partition method gives each stage: the plan's even split (DeepSpeed's balancer
    places a remainder itself; the fullest stage, which sets the pace, holds as many)."""
    per, rest = divmod(num_layers, pp)
    return (f"{per} blocks a stage" if not rest
            else f"{per} or {per + 1} blocks a stage, {rest} of them {per + 1}")
