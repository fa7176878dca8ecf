"""torchtitan (0.2.x): a job TOML for `torchrun -m torchtitan.train --job.config_file F`.

The layer split is written as module names per (virtual) stage
(`parallelism.module_fqns_per_model_part`), so every split of ours is said exactly. What
torchtitan cannot say, and the nearest it runs (each a line of the export):
- ZeRO-1: torchtitan's FSDP2 without resharding after forward is ZeRO-2 (gradients reduce-
  scattered every micro-batch); ZeRO-0 is replication (`data_parallel_replicate_degree`).
- Tensor parallelism always comes with sequence parallelism there.
- Recomputation: none, full, every n-th layer, or its per-op policy on every layer. Full
  recomputation of some layers per rank is said as every n-th layer where the ranks' shares allow
  it, else all layers. Selective recomputation is the per-op policy (`selective_ac_option = "op"`:
  every second matmul's output recomputed, attention and the rest of its save list kept), on every
  layer; a plan searched for our runtime (core attention recomputed) says what changes.
- Schedules: its layers are compiled (`[compile]`, as priced), and torch's zero-bubble and
  DualPipeV schedule classes refuse compiled stage modules (`_check_torch_compile_compatibility`):
  ZB-H1 runs as 1F1B, ZBV and DualPipeV as interleaved 1F1B with their two virtual stages.
- Rank order: pp, dp_replicate, dp_shard, cp, tp (outermost first); other mesh orders become it.
  Hybrid sharding (Plan.dp_replicate) is its data_parallel_replicate x data_parallel_shard.
- DDP (ZeRO-0 with replicas) runs on a one-dimensional mesh only: with TP, PP, CP or EP beside
  it, the replicas become FSDP2 without resharding after forward (ZeRO-2).
- Models: torchtitan's own llama3 and qwen3 flavours are named (planner.exports.torchtitan_models);
  its qwen3 train spec has no pipeline, so a plan of one with pp > 1 is refused. Any other model
  needs a flavour (or a train spec) of its own in torchtitan, whose dimensions the export lists.
- Refused: fp16 (its mixed precision is bf16 or fp32), gradients reduced in other than fp32
  (`training.mixed_precision_reduce`), and unfused (eager) attention (its models call SDPA).
"""
from __future__ import annotations

import json

from costmodel.deepseek import deepseek_mechanisms
from costmodel.plan import Plan, PlanFile, Recompute, every_nth_interval
from costmodel.schedules import Schedule
from costmodel.specs import Arch, AttentionKernel, DType, ModelSpec, TrainSpec
from planner.exports.common import (
    Adjusted,
    CannotExport,
    activations_on_device,
    on_hosts,
    recompute_is_uniform,
    to_rank_order,
    to_schedule,
    to_uniform_recompute,
)
from planner.exports.torchtitan_models import flavour_of
from planner.search_options import replicas_beside_parallelism

NAME = "torchtitan"
FRAMEWORK = "torchtitan"
SUFFIX = ".toml"
ORDER = ("pp", "dp", "cp", "tp")   # torchtitan's world mesh: pp, dp_replicate, dp_shard, cp, tp
# the ZeRO stages and recompute modes it runs, whatever else a plan holds (`nearest` moves the
# others; planner.targets keeps the search from listing them)
ZERO_STAGES = frozenset({0, 2, 3})
# those it runs where replicas share the mesh with TP, PP, CP or EP: DDP runs on a
# one-dimensional mesh only
ZERO_STAGES_BESIDE_PARALLELISM = frozenset({2, 3})
RECOMPUTE_MODES = frozenset({Recompute.NONE, Recompute.SELECTIVE, Recompute.FULL})
# the torch schedules that take compiled stage modules (the others raise at construction)
SCHEDULES = frozenset({Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED})


def nearest(pf: PlanFile) -> Adjusted:
    if pf.model.arch is not Arch.LLAMA:
        raise CannotExport(f"torchtitan cannot run this plan: it has no model of the {pf.model.arch} kind "
                           "(LayerNorm, learned positions, GeLU MLP)")
    if deepseek := deepseek_mechanisms(pf.model):   # a llama3 or qwen3 job file would describe another model
        raise CannotExport(f"torchtitan cannot run this plan: this export writes llama3 and qwen3 jobs, without "
                           f"{', '.join(deepseek)} (torchtitan's deepseek_v3 model computes attention with "
                           "FlexAttention, which the cost model does not price)")
    _refuse_precision(pf.train)
    if pf.plan.pp > 1 and not pipelines(pf.model):
        flavour = flavour_of(pf.model)
        raise CannotExport(f"torchtitan cannot run this plan: its {flavour.name} model ({flavour.flavor}) runs "
                           f"without a pipeline (the {flavour.name} train spec has no pipelining_fn), not at "
                           f"pp {pf.plan.pp}")
    adj = Adjusted(pf.plan)
    plan = adj.plan
    if plan.zero_stage not in ZERO_STAGES:   # ZeRO-1
        adj.change("zero 1: torchtitan's FSDP2 without resharding after forward is ZeRO-2 (gradients "
                   "reduce-scattered every micro-batch)", zero_stage=2)
    elif plan.zero_stage not in ZERO_STAGES_BESIDE_PARALLELISM and replicas_beside_parallelism(plan):
        adj.change("zero 0 beside other parallelism: torchtitan's DDP runs on a one-dimensional mesh only; "
                   "FSDP2 without resharding after forward (ZeRO-2)", zero_stage=2)
    if plan.tp > 1 and not plan.sequence_parallel:
        adj.change("tensor parallelism without sequence parallelism: torchtitan always shards the sequence "
                   "between TP regions; with SP", sequence_parallel=True)
    plan = adj.plan
    if plan.recompute is Recompute.SELECTIVE:
        _per_op_policy(adj, pf)
    elif plan.recompute is Recompute.FULL and every_nth_interval(plan) is None:
        to_uniform_recompute(adj, Recompute.FULL, f"full recomputation of {list(plan.recompute_num_layers)} "
                                                  "layers per rank: torchtitan recomputes all layers or every "
                                                  "n-th; all layers")
    _compiled_schedule(adj, pf.model.num_layers)
    to_rank_order(adj, (ORDER,), "torchtitan lays ranks out as pp>dp>cp>tp")
    if flavour_of(pf.model) is None:
        adj.differences.append(_model_note(pf.model, adj.plan.pp))
    activations_on_device(adj, NAME)
    return adj


def _compiled_schedule(adj: Adjusted, num_layers: int) -> None:
    """A schedule whose torch class takes compiled stages: ZB-H1 as 1F1B, the V-shaped ones as
    interleaved 1F1B over the same two virtual stages."""
    plan = adj.plan
    if plan.pp == 1 or plan.schedule in SCHEDULES:
        return
    why = (f"schedule {plan.schedule}: torch's {plan.schedule.traits.torch_class} refuses the compiled layers "
           "torchtitan runs")
    if plan.vpp > 1:
        to_schedule(adj, num_layers, Schedule.INTERLEAVED, plan.vpp, f"{why}; interleaved-1f1b")
    else:
        to_schedule(adj, num_layers, Schedule.ONE_F_ONE_B, 1, f"{why}; 1f1b")


def _per_op_policy(adj: Adjusted, pf: PlanFile) -> None:
    """Selective recomputation as torchtitan runs it: its per-op policy, wrapped round every layer."""
    plan = adj.plan
    if not recompute_is_uniform(plan):
        to_uniform_recompute(adj, Recompute.SELECTIVE, f"selective recomputation of {list(plan.recompute_num_layers)} "
                                                       "layers per rank: torchtitan's per-op policy wraps every "
                                                       "layer; all layers")
    if pf.cluster.framework.name != FRAMEWORK:   # the plan was priced with our runtime's selective
        adj.differences.append("selective recomputation: torchtitan's per-op policy (selective_ac_option 'op') "
                               "recomputes every second matmul and keeps attention's output, where the plan "
                               "recomputed core attention; priced as torchtitan runs it")


def pipelines(m: ModelSpec) -> bool:
    """Whether torchtitan splits the model over pipeline stages: not one of its own flavours whose
    train spec has no pipelining_fn (a model of the user's runs with the spec they register)."""
    flavour = flavour_of(m)
    return flavour is None or flavour.pipelined


def _refuse_precision(t: TrainSpec) -> None:
    """What torchtitan's configuration cannot say at all (its mixed precision's literals)."""
    if t.compute_dtype is DType.FP16:
        raise CannotExport("torchtitan cannot run this plan: its mixed precision is bf16 or fp32, not fp16")
    if t.grad_dtype is not DType.FP32:
        raise CannotExport(f"torchtitan cannot run this plan: it reduces gradients in fp32 "
                           f"(training.mixed_precision_reduce), not {t.grad_dtype}")
    if t.attention_kernel is AttentionKernel.EAGER:
        raise CannotExport("torchtitan cannot run this plan: its models call fused attention (SDPA), not "
                           "eager attention")


def _model_note(m: ModelSpec, pp: int) -> str:
    dims = (f"dim={m.hidden_size}, n_layers={m.num_layers}, n_heads={m.num_heads}, n_kv_heads={m.num_kv_heads}, "
            f"ffn hidden {m.ffn_hidden_size}, vocab_size={m.vocab_size}, rope_theta={m.rope_theta:g}, "
            f"norm_eps={m.norm_eps:g}")
    if m.qk_norm and not m.qkv_bias:   # what torchtitan's qwen3 model builds (Qwen3ModelArgs)
        experts = (f", moe_enabled with {m.num_experts} experts of width {m.moe_ffn_hidden_size}, top-"
                   f"{m.experts_per_token}" if m.is_moe else "")
        pipeline = (f"; with its pipelining_fn (torchtitan's pipeline_llm) for pp {pp}: the qwen3 spec has none"
                    if pp > 1 else "")
        return (f"model {m.name}: no torchtitan qwen3 flavour has its dimensions; register a train spec named "
                f"'{m.name}' built on torchtitan.models.qwen3 ({dims}, head_dim={m.head_dim}, qk_norm{experts})"
                f"{pipeline} before running")
    if m.qk_norm or m.explicit_head_dim is not None or m.qkv_bias:   # beyond what llama3's model builds
        dims += (f", head_dim {m.head_dim}{', Q/K norms per head' if m.qk_norm else ''}"
                 f"{', biases on the Q, K and V projections' if m.qkv_bias else ''}")
        return (f"model {m.name}: torchtitan's llama3 model has no such attention; register a train spec named "
                f"'{m.name}' ({dims}) before running")
    if m.is_moe:
        return (f"model {m.name}: torchtitan 0.2 has no model of this kind; register a train spec named "
                f"'{m.name}' ({dims}; {m.num_experts} experts of width {m.moe_ffn_hidden_size}, top-"
                f"{m.experts_per_token}) before running")
    return (f"model {m.name}: no torchtitan llama3 flavour has its dimensions; add flavour '{m.name}' to "
            f"torchtitan.models.llama3.llama3_args ({dims})")


def _model_section(m: ModelSpec) -> tuple[str, str]:
    if (flavour := flavour_of(m)) is not None:
        return flavour.name, flavour.flavor
    return ("llama3", m.name) if not (m.is_moe or m.qk_norm or m.explicit_head_dim or m.qkv_bias) else (m.name, m.name)


def _stage_modules(pf: PlanFile, plan: Plan) -> list[list[str]]:
    """torchtitan's module names of each (virtual) stage, in stage order."""
    out, layer = [], 0
    for j, count in enumerate(plan.layers_per_stage):
        names = ["tok_embeddings"] if j == 0 else []
        names += [f"layers.{i}" for i in range(layer, layer + count)]
        layer += count
        if j == plan.num_virtual_stages - 1:
            names += ["norm", "output"]
        out.append(names)
    return out


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return json.dumps(v)   # numbers, strings and lists of strings are TOML as JSON writes them


def sections(pf: PlanFile, plan: Plan) -> dict[str, dict]:
    m, t = pf.model, pf.train
    name, flavor = _model_section(m)
    local = plan.micro_batch_size * plan.num_micro_batches if plan.pp > 1 else plan.micro_batch_size
    zero0 = plan.zero_stage == 0
    parallelism = {
        "data_parallel_replicate_degree": plan.dp if zero0 else plan.dp_replicate,
        "data_parallel_shard_degree": 1 if zero0 else plan.dp_shard,
        "fsdp_reshard_after_forward": "always" if plan.zero_stage == 3 else "never",
        "tensor_parallel_degree": plan.tp,
        "context_parallel_degree": plan.cp,
        "context_parallel_rotate_method": "allgather",
        "expert_parallel_degree": plan.ep,
        "expert_tensor_parallel_degree": 1,
        "pipeline_parallel_degree": plan.pp,
    }
    if plan.pp > 1:
        parallelism.update({
            "pipeline_parallel_schedule": plan.schedule.traits.torch_class.removeprefix("Schedule"),
            "pipeline_parallel_microbatch_size": plan.micro_batch_size,
            "module_fqns_per_model_part": _stage_modules(pf, plan),
        })
    if plan.recompute is Recompute.NONE:
        checkpointing = {"mode": "none"}
    elif plan.recompute is Recompute.SELECTIVE:   # every layer (nearest)
        checkpointing = {"mode": "selective", "selective_ac_option": "op"}
    else:
        n = every_nth_interval(plan)
        checkpointing = {"mode": "full"} if n == 1 else {"mode": "selective", "selective_ac_option": str(n)}
    precision = "float32" if t.compute_dtype is DType.FP32 else "bfloat16"
    doc = {
        "job": {"description": f"{plan.short()} for {m.name} (planner export)", "dump_folder": "./outputs"},
        "model": {"name": name, "flavor": flavor},
        "training": {"local_batch_size": local, "global_batch_size": t.global_batch_size, "seq_len": t.seq_len,
                     "mixed_precision_param": precision, "mixed_precision_reduce": "float32",
                     # FSDP2's CPUOffloadPolicy on every unit, as our runtime runs offloaded states
                     **({"enable_cpu_offload": True} if plan.offload_optimizer else {})},
        "parallelism": parallelism,
        "activation_checkpoint": checkpointing,
        # the transformer layers compiled, as the plan was priced (frameworks `compiled_layer`: torchtitan's
        # presets and published runs compile them); the loss stays eager, as priced
        "compile": {"enable": True, "components": ["model"]},
    }
    if plan.fp8_linears:   # torchao float8 linears, the LM head left out (compiled: its docs require it)
        doc["model"]["converters"] = ["quantize.linear.float8"]
        doc["quantize.linear.float8"] = {"recipe_name": "tensorwise", "filter_fqns": ["output"]}
    return doc


# The TOML job config and its keys are torchtitan 0.2.x's: later torchtitan (from its config
# refactor, pytorch/torchtitan#2386) reads Python config dataclasses (--module/--config) and no
# longer takes --job.config_file
TOML_RELEASES = ("for torchtitan 0.2.x (a TOML job config, run with --job.config_file; "
                 "later releases take Python configs)")


def render(pf: PlanFile, plan: Plan) -> tuple[str, str]:
    c = pf.cluster
    lines = [f"# torchtitan job for {plan.short()}: {pf.model.name} on {c.num_nodes}x{c.devices_per_node} "
             f"{c.device.name} (planner export)", f"# {TOML_RELEASES}"]
    for section, values in sections(pf, plan).items():
        lines.append(f"\n[{section}]")
        lines += [f"{key} = {_value(value)}" for key, value in values.items()]
    hosts, per_host = c.launch_hosts
    launch = (f"torchrun --nnodes {hosts} --nproc-per-node {per_host} -m torchtitan.train "
              f"--job.config_file FILE (on {on_hosts(hosts, per_host)}, with torchrun's rendezvous flags; "
              "torchtitan 0.2.x)")
    return "\n".join(lines) + "\n", launch
