"""FSDP units: the consecutive layers a framework wraps together and gathers and reduces as one
(what runtime.parallel wraps, what the DP terms and the memory model count)."""
from __future__ import annotations

from costmodel.frameworks import RUNTIME, FrameworkTraits
from costmodel.params import ceil_div, dense_layers_by_stage, layer_params, rank_params_at
from costmodel.plan import Plan
from costmodel.specs import ModelSpec

# An FSDP unit below ZeRO-3 reaches Megatron-Core's default DDP bucket, max(40M, 1M x dp·cp)
# parameters (DistributedDataParallelConfig.bucket_size: "larger DP sizes need larger buckets to
# ensure collectives do not become latency-bound"). One layer a unit would pay a collective's
# latency per layer: on gloo a rendezvous of the ranks, whatever its bytes.
FSDP_UNIT_MIN_PARAMS = 40_000_000
FSDP_UNIT_MIN_PARAMS_PER_RANK = 1_000_000


def fsdp_unit_layers(model: ModelSpec, plan: Plan) -> int:
    """Consecutive layers one FSDP unit holds, as runtime.parallel wraps a stage: one under
    ZeRO-3 (its units bound the gathered weights, FSDP's per-block wrapping) and under expert
    parallelism (the experts are units of their own); below ZeRO-3, enough layers to reach the
    bucket above. A stage with no more layers than this is one unit whole (its root's, with the
    embedding and head); otherwise units of this many layers from its last, the first few left
    to the root."""
    if plan.zero_stage >= 3 or plan.ep > 1:
        return 1
    return bucket_layers(layer_params(model, plan.tp), plan.dp * plan.cp)


def bucket_layers(layer_params: int, data_parallel: int) -> int:
    """Layers of `layer_params` parameters that reach the bucket above over `data_parallel` ranks."""
    bucket = max(FSDP_UNIT_MIN_PARAMS, FSDP_UNIT_MIN_PARAMS_PER_RANK * data_parallel)
    return max(1, ceil_div(bucket, layer_params))


def whole_stage_units(model: ModelSpec, plan: Plan, traits: FrameworkTraits = RUNTIME) -> bool:
    """Whether the framework's FSDP units (costmodel.frameworks `dp_collectives_per_layer`) are
    each stage whole: units of more layers than the model has (fsdp_unit_layers)."""
    if not traits.dp_collectives_per_layer:
        return False
    k = fsdp_unit_layers(model, plan)
    return k > 1 and k >= model.num_layers


def fsdp_unit_params(model: ModelSpec, plan: Plan, traits: FrameworkTraits = RUNTIME) -> int:
    """The parameters of a TP rank's largest FSDP unit: fsdp_unit_layers layers, or where a
    stage is one unit whole, the largest (virtual) stage's, embedding and head included. A
    framework without such units (costmodel.frameworks `dp_collectives_per_layer`): a layer."""
    if whole_stage_units(model, plan, traits):
        last, dense = plan.num_virtual_stages - 1, dense_layers_by_stage(model, plan)
        return max(rank_params_at(model, plan, layers, j == 0, j == last, traits, dense[j]).total
                   for j, layers in enumerate(plan.layers_per_stage))
    k = fsdp_unit_layers(model, plan) if traits.dp_collectives_per_layer else 1
    return k * layer_params(model, plan.tp, plan.ep, plan.etp, traits.shared_expert_tp)
