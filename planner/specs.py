"""The specs a question is asked about, built once for the command line and the Python API:
the model (a registry name, a Hugging Face config path or dict, or a ModelSpec), the training
(the model's published recipe where unstated) and the cluster as the framework drives it."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from costmodel.check_levers import float8_device_problem
from costmodel.frameworks import with_ep_overlap
from costmodel.groups import views
from costmodel.hardware import DEFAULT_MEMORY_HEADROOM, ClusterSpec, parse_cluster
from costmodel.inputs import UserError
from costmodel.rank_time.ep_overlap import model_overlap_problems
from costmodel.registry import default_recipe, resolve_model
from costmodel.selective_modules import MEGATRON_CORE, module_problems
from costmodel.specs import DEFAULT_EXPERT_IMBALANCE, AttentionKernel, DType, ModelSpec, TrainSpec

FP8 = "fp8"   # dtype fp8: bf16 beside float8 linears (TrainSpec.float8), not a DType of its own
ModelLike = str | Path | dict | ModelSpec


def model_of(model: ModelLike) -> ModelSpec:
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):
        from costmodel.hf_config import model_from_hf_dict
        return model_from_hf_dict(model, "model config (dict)")
    if isinstance(model, (str, Path)):
        return resolve_model(str(model))
    raise UserError(f"model: expected a registry name, a config.json path, a Hugging Face config dict or a "
                    f"ModelSpec, got {type(model).__name__}")


def enum_value(kind: type, value: Any, what: str):
    """`value` as the enum `kind` (the API's and the CLI's strings), or a UserError naming `what`
    and the values it takes."""
    try:
        return kind(value)
    except ValueError:
        extra = f", {FP8}" if kind is DType and what == "dtype" else ""
        raise UserError(f"{what} {value!r} is not one of {', '.join(str(k.value) for k in kind)}{extra}") from None


def build_specs(model: ModelLike, cluster: str | ClusterSpec, *, seq_len: int | None = None,
                global_batch: int | None = None, dtype: str = "bf16", grad_dtype: str = "fp32",
                attention: str = "flash", expert_imbalance: float = DEFAULT_EXPERT_IMBALANCE,
                memory_headroom: float = DEFAULT_MEMORY_HEADROOM, group_link_bytes_per_s: float | None = None,
                framework: str = "planner", recompute_modules: tuple[str, ...] = (),
                ep_overlap: bool = False) -> tuple[ModelSpec, TrainSpec, ClusterSpec]:
    """recompute_modules: what the framework's selective recomputation re-runs (Megatron-Core's
    --recompute-modules; empty: its default). ep_overlap: Megatron-Core's expert all-to-all overlap
    (frameworks.with_ep_overlap; the plans it runs: costmodel.check)."""
    from planner.targets import NAMES, cluster_for
    if framework not in NAMES:
        raise UserError(f"framework {framework!r} is not one of {', '.join(NAMES)}")
    spec = model_of(model)
    parsed = cluster if isinstance(cluster, ClusterSpec) else parse_cluster(cluster, group_link_bytes_per_s)
    parsed = cluster_for(framework, dataclasses.replace(parsed, memory_headroom=memory_headroom))
    if recompute_modules:
        if problems := module_problems(recompute_modules, parsed.framework.name, spec):
            raise UserError(f"--recompute-modules {','.join(recompute_modules)}: {problems[0]}"
                            + (" (--framework megatron)" if framework != "megatron" else ""))
        parsed = dataclasses.replace(parsed, framework=dataclasses.replace(parsed.framework,
                                                                           selective_modules=recompute_modules))
    if ep_overlap:
        compute = DType.BF16 if dtype == FP8 else enum_value(DType, dtype, "dtype")   # float8 beside bf16
        parsed = _with_ep_overlap(parsed, spec, framework, compute)
    seq, batch = default_recipe(spec)
    float8 = dtype == FP8
    if float8 and (problem := next(filter(None, (float8_device_problem(v.device) for v in views(parsed))), None)):
        raise UserError(f"--dtype fp8: {problem}")
    train = TrainSpec(seq_len=seq if seq_len is None else seq_len,
                      global_batch_size=batch if global_batch is None else global_batch,
                      compute_dtype=DType.BF16 if float8 else enum_value(DType, dtype, "dtype"),
                      grad_dtype=enum_value(DType, grad_dtype, "grad_dtype"), float8=float8,
                      attention_kernel=enum_value(AttentionKernel, attention, "attention"),
                      expert_load_imbalance=expert_imbalance)
    return spec, train, parsed



def _with_ep_overlap(cluster: ClusterSpec, model: ModelSpec, framework: str, compute_dtype: DType) -> ClusterSpec:
    """The cluster's framework with its expert all-to-all overlap, where the framework has one and
    Megatron-Core's checks of model and dtype pass (model_overlap_problems; a plan's own:
    costmodel.check)."""
    if cluster.framework.name != MEGATRON_CORE:
        raise UserError("--ep-overlap is Megatron-Core's --overlap-moe-expert-parallel-comm: it needs "
                        f"--framework megatron (not {framework})")
    if problems := model_overlap_problems(model, compute_dtype):
        raise UserError(f"--ep-overlap {problems[0]}")
    return dataclasses.replace(cluster, framework=with_ep_overlap(cluster.framework))
