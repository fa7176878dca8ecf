"""The rules of the levers a plan pulls beside its degrees: ZeRO's states and the layers'
activations on the host, and float8 linears (costmodel.check applies them to a plan; the search
and the command line ask them before a plan exists)."""
from __future__ import annotations

from costmodel.frameworks import COMPILED_RUNTIME, RUNTIME
from costmodel.groups import views
from costmodel.hardware import ClusterSpec, DeviceProfile, float8_devices
from costmodel.plan import Recompute
from costmodel.schedules import Schedule
from costmodel.specs import ModelSpec, TrainSpec


def no_host_problem(cluster: ClusterSpec, lever: str) -> str | None:
    """Why nothing can be offloaded to this device's host (None: it has one; on a mixed cluster,
    every group's device has one)."""
    for device in (view.device for view in views(cluster)):
        if device.host is None:
            why = "its ranks already run on the host" if device.kind == "cpu" else "its profile has no [host] table"
            return f"{lever}: device {device.name} cannot offload ({why})"
    return None


def offload_problems(cluster: ClusterSpec, zero_stage: int, offload: bool) -> list[str]:
    """Offloading moves ZeRO's sharded states to the node's host: it needs a shard and a host."""
    if not offload:
        return []
    if problem := no_host_problem(cluster, "offload_optimizer"):
        return [problem]
    if zero_stage < 1:
        return ["offload_optimizer needs zero_stage >= 1 (the sharded optimizer states are what moves to the host)"]
    return []


def activation_offload_problems(cluster: ClusterSpec, offload: bool, recompute: Recompute,
                                schedule: Schedule, tp: int = 1) -> list[str]:
    """Activations copied to the host: a host to copy to; not with recomputation (torch's
    checkpoint keeps its region's inputs itself, on the device), a schedule whose split backward
    reads each saved tensor twice (zero bubble: two copies back), or tensor parallelism (its
    activations are DTensors, which runtime.offload's hooks leave in place)."""
    if not offload:
        return []
    if problem := no_host_problem(cluster, "offload_activations"):
        return [problem]
    out = []
    if recompute is not Recompute.NONE:
        out.append("offload_activations with recomputation: they are alternatives (torch's checkpoint keeps "
                   "the recomputed region's inputs on the device)")
    if schedule.defers_weight_grad:
        out.append(f"offload_activations with schedule {schedule}: its split backward reads every saved "
                   "tensor twice (two copies back per pass)")
    if tp > 1:
        out.append("offload_activations with tp > 1: tensor-parallel activations are DTensors, which the "
                   "runtime's hooks do not move")
    return out


def float8_device_problem(device: DeviceProfile) -> str | None:
    if device.kind == "cpu":
        return (f"device {device.name} is a CPU: the runtime cannot run float8 training on CPU (float8 tensor "
                f"cores: {float8_devices()})")
    if device.peak_flops_per_s.get("fp8", 0) <= 0:
        return (f"device {device.name} has no float8 tensor cores (no fp8 peak in its profile; float8 training "
                f"needs one of {float8_devices()})")
    return None


def fp8_problems(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, tp: int) -> list[str]:
    """What float8 linears need: a device with float8 tensor cores (an fp8 peak in its profile:
    costmodel.hardware.float8_devices; not A100, V100 or a CPU, where the runtime cannot run them either), a
    training spec that accepts float8 (bf16 beside it), a dense model where the framework does
    not run its experts in float8 (Megatron-Core does; torchao's float8 linears do not reach our
    runtime's batched expert weights: costmodel.frameworks `float8_experts`), and no tensor
    parallelism where the framework has none for float8 (our runtime does not apply torchao's
    float8 tensor-parallel styles; costmodel.frameworks `float8_with_tp`)."""
    out = []
    if problem := next(filter(None, (float8_device_problem(view.device) for view in views(cluster))), None):
        out.append(f"fp8_linears: {problem}")
    if not train.float8:
        out.append("fp8_linears: the training spec does not accept float8 numerics (--dtype fp8)")
    if model.is_moe and not cluster.framework.float8_experts:
        out.append(f"fp8_linears: model {model.name} is a mixture of experts; {cluster.framework.name} runs float8 "
                   "for dense models only (Megatron-Core runs experts in float8: --framework megatron)")
    if tp > 1 and not cluster.framework.float8_with_tp:
        ours = cluster.framework.name in (RUNTIME.name, COMPILED_RUNTIME.name)
        who = "the runtime" if ours else cluster.framework.name
        out.append(f"fp8_linears with tp > 1: {who} runs float8 linears without tensor parallelism")
    return out
