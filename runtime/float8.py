"""Float8 linears (Plan.fp8_linears): torchao's float8 training, tensorwise recipe.

Every linear projection of the transformer layers whose weight allows a float8 GEMM
(costmodel.kernels.float8_linear) becomes torchao's Float8Linear: its three GEMMs run in float8
(e4m3 input and weight, e5m2 output gradient, one dynamic scale per tensor) and everything else
stays as it was (the LM head, attention, norms, the FSDP2 states). On CUDA each converted linear
is compiled (torch.compile), which fuses torchao's casts into an amax and a scaled cast per
operand, as costmodel.frameworks prices our runtime (`float8_casts_fused`; eager, each cast is
six kernels and float8 loses to bf16: torchao and torchtitan call compile required for
competitive float8 performance). Applied before activation checkpointing and FSDP2, as
torchtitan converts models before parallelising them; plans with tensor parallelism or experts
never get here (costmodel.check.fp8_problems; costmodel.frameworks `float8_with_tp`,
`float8_experts`: torchao's float8 grouped GEMM for batched expert weights has no CPU kernel).

Float8 GEMMs need tensor cores that have them (H100, H200, B200): check_plan refuses plans for
other device profiles, and `planner run` refuses to start a float8 plan on a GPU without them or
without torchao (float8_run_problem), whatever its plan.json says. torch's CPU `_scaled_mm` lets
the tests check the numbers on CPU; that is not a way to train.
"""
from __future__ import annotations

from torch import nn

from costmodel.kernels import float8_linear

FLOAT8_CAPABILITY = (8, 9)   # torch._scaled_mm: compute capability 8.9 (Ada) or 9.0 (Hopper) and up


def float8_run_problem() -> str | None:
    """Why this machine cannot run float8 linears (None: it can): torchao missing, or a CUDA
    device whose tensor cores have no float8."""
    import importlib.util

    import torch
    if importlib.util.find_spec("torchao") is None:
        return "the plan runs float8 linears (fp8_linears), which needs torchao: pip install 'planner[fp8]'"
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        if capability < FLOAT8_CAPABILITY:
            return (f"the plan runs float8 linears, but this GPU ({torch.cuda.get_device_name()}, compute "
                    f"capability {capability[0]}.{capability[1]}) has no float8 tensor cores (8.9 and up)")
    return None


def apply_float8(stage: nn.Module, compile: bool = False) -> int:
    """Convert the stage's layers' linears in place (`compile`: and compile each, as on CUDA);
    returns how many were converted."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise RuntimeError("this plan runs float8 linears (fp8_linears), which needs torchao: "
                           "pip install 'planner[fp8]'") from None
    def wanted(module: nn.Module, fqn: str) -> bool:
        return isinstance(module, nn.Linear) and float8_linear(module.in_features, module.out_features)

    convert_to_float8_training(stage.layers, config=Float8LinearConfig.from_recipe_name("tensorwise"),
                               module_filter_fn=wanted)
    converted = [m for m in stage.layers.modules() if isinstance(m, nn.Linear) and type(m) is not nn.Linear]
    if compile:
        for module in converted:
            module.compile()
    return len(converted)
