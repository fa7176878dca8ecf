"""Training frameworks as data: what each one overlaps and how it implements ZeRO.

The same plan runs at different speeds under different software. A published run is priced with
the traits of the framework that ran it (`planner validate`); `search` and `predict` price plans
with `RUNTIME`, this project's own executor, because `planner run` is what runs the plans they
emit. A framework name the table does not know gets `GENERIC` (never an error): the plain
assumptions of the cost model with nothing hidden that a plain implementation would not hide.

Each trait is a mechanism with its source, not a per-framework fudge factor:
- `dp_grad_overlap`: the gradient reduction runs during backward, bucket by bucket. Megatron-LM
  before Megatron-Core all-reduced after the backward pass (Narayanan et al. SC'21 Sec. 4;
  `--overlap-grad-reduce` arrived with Megatron-Core in 2023).
- `dp_param_overlap`: ZeRO-1's all-gather of updated weights hides behind the next forward
  (Megatron-Core `--overlap-param-gather`), instead of running after the optimizer step.
- `tp_comm_hidden`: fraction of tensor-parallel collectives hidden behind GEMMs (Megatron-Core
  with Transformer Engine `--tp-comm-overlap` splits GEMMs into chunks around userbuffer
  collectives; Wang et al. ASPLOS'23 report most of it hidden, we take half as a bound that the
  fit may not raise).
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
- `fsdp_master_params`: FSDP's mixed precision keeps the sharded parameter in fp32 (it is the
  master weight) and casts a 16-bit copy on each gather: 16 bytes per parameter over the shards
  under ZeRO-3 (not the ZeRO paper's 2 + 2 + 12 with a separate 16-bit shard), and below ZeRO-3
  the fp32 shard plus a whole 16-bit copy held from forward to backward.
- `vendor_attention`: attention through Transformer Engine (cuDNN fused attention, FlashAttention-3
  class on Hopper) rather than PyTorch's FlashAttention-2 SDPA: the device's
  `vendor_attention_speedup` applies (`device_as_run_by`).
- `zero3_gathers_per_param`: DeepSpeed ZeRO-3 gathers parameter by parameter (many small
  collectives, each paying the ring latency) rather than one flat buffer per layer as FSDP does.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from costmodel.cluster import DeviceProfile


@dataclass(frozen=True, kw_only=True, slots=True)
class FrameworkTraits:
    name: str
    dp_grad_overlap: bool
    dp_param_overlap: bool
    tp_comm_hidden: float
    sharded_grads_under_pp: bool
    zero3_gathers_per_param: bool
    swiglu_saved_tensors: int = 4
    loss_grad_in_place: bool = False
    fsdp_master_params: bool = False
    vendor_attention: bool = False


GENERIC = FrameworkTraits(name="generic", dp_grad_overlap=True, dp_param_overlap=True, tp_comm_hidden=0.0,
                          sharded_grads_under_pp=True, zero3_gathers_per_param=False)

# This project's executor: FSDP2 for every ZeRO stage (bucketed overlap of reduce-scatter and
# prefetched all-gathers, fp32 sharded parameters), DTensor TP without overlap, eager SwiGLU,
# torch's cross entropy, torch pipelining (see the module docstring).
RUNTIME = FrameworkTraits(name="planner", dp_grad_overlap=True, dp_param_overlap=True, tp_comm_hidden=0.0,
                          sharded_grads_under_pp=False, zero3_gathers_per_param=False,
                          fsdp_master_params=True)

_MEGATRON = dict(sharded_grads_under_pp=True, zero3_gathers_per_param=False, loss_grad_in_place=True)
_FSDP = dict(dp_grad_overlap=True, dp_param_overlap=True, tp_comm_hidden=0.0, zero3_gathers_per_param=False,
             fsdp_master_params=True)
_DEEPSPEED = dict(dp_grad_overlap=True, dp_param_overlap=False, tp_comm_hidden=0.0, sharded_grads_under_pp=True,
                  zero3_gathers_per_param=True)

FRAMEWORKS: dict[str, FrameworkTraits] = {t.name: t for t in (
    RUNTIME,
    GENERIC,
    FrameworkTraits(name="megatron-lm", dp_grad_overlap=False, dp_param_overlap=False, tp_comm_hidden=0.0,
                    **_MEGATRON),
    FrameworkTraits(name="megatron-core", dp_grad_overlap=True, dp_param_overlap=True, tp_comm_hidden=0.5,
                    swiglu_saved_tensors=3, vendor_attention=True, **_MEGATRON),
    FrameworkTraits(name="megatron-deepspeed", **{**_DEEPSPEED, "loss_grad_in_place": True}),
    FrameworkTraits(name="deepspeed", **_DEEPSPEED),
    FrameworkTraits(name="composer-fsdp", sharded_grads_under_pp=True, **_FSDP),
    FrameworkTraits(name="torchtitan", sharded_grads_under_pp=False, **_FSDP),
)}


def framework_traits(name: str | None) -> FrameworkTraits:
    """The traits of a named framework; `GENERIC` for an empty or unknown name."""
    return FRAMEWORKS.get((name or "").strip().lower(), GENERIC)


def device_as_run_by(device: "DeviceProfile", traits: FrameworkTraits) -> "DeviceProfile":
    """The device as a framework's kernels use it: its vendor attention where the framework
    calls it (the only device-side trait so far)."""
    speedup = device.efficiency.vendor_attention_speedup
    if not traits.vendor_attention or speedup == 1.0:
        return device
    eff = replace(device.efficiency, attention=device.efficiency.attention * speedup)
    return replace(device, efficiency=eff)
