"""The modules Megatron-Core's selective recomputation may name (`--recompute-modules`,
TransformerConfig.recompute_modules at Megatron-LM d98e8a64), which the model prices (costmodel
.kernels.recompute_modules: their forward again; costmodel.memory.activations: their inputs kept),
and the checks Megatron-Core makes of them, one line each: the one boundary for a runs-table row,
a plan file's cluster and the command line."""
from __future__ import annotations

from costmodel.specs import ModelSpec

DEFAULT_SELECTIVE_MODULES = ("core_attn",)   # Megatron-Core's default: the attention core
SELECTIVE_MODULES = ("core_attn", "layernorm", "mla_up_proj", "mlp", "moe_act")
# Megatron-Core's other names: a whole mixture (its dispatch and combine again) or shared expert
UNPRICED_MODULES = ("moe", "shared_experts")
MEGATRON_CORE = "megatron-core"
# torchtitan's per-op selective checkpointing (costmodel.selective_ops), priced as one more module:
# not a name a user can give (module_problems refuses it as unknown)
OP_POLICY = "op_policy"


def priced_modules(selective_modules: tuple[str, ...], op_policy: bool) -> tuple[str, ...]:
    """What a framework's selective recomputation re-runs, as the pricing names it: torchtitan's
    per-op policy (frameworks `selective_op_policy`), else its modules (`selective_modules`)."""
    return (OP_POLICY,) if op_policy else selective_modules


def module_problems(names: tuple[str, ...], framework: str, model: ModelSpec | None = None) -> list[str]:
    """Why `names` cannot be the selective recomputation of `framework` (costmodel.frameworks
    name) on `model` (where known): another framework, a name not priced or not known, a name
    twice, a module the model lacks (Megatron-Core refuses mla_up_proj without latent attention and
    moe_act without a mixture's grouped experts)."""
    if framework != MEGATRON_CORE:
        return [f"recompute modules are Megatron-Core's --recompute-modules; {framework} has no such option"]
    out = [f"the model does not price recomputing {n!r}" for n in names if n in UNPRICED_MODULES]
    out += [f"unknown module {n!r} (known: {', '.join(SELECTIVE_MODULES)})" for n in names
            if n not in SELECTIVE_MODULES + UNPRICED_MODULES]
    if not names:
        out.append("no module named")
    if len(set(names)) < len(names):
        out.append("a module is named twice")
    if model is not None and "mla_up_proj" in names and not model.is_mla:
        out.append(f"mla_up_proj needs multi-latent attention, which {model.name} does not have")
    if model is not None and "moe_act" in names and not model.is_moe:
        out.append(f"moe_act needs a mixture of experts, and {model.name} is dense")
    return out
