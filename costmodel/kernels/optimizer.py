"""The optimizer step, gradient accumulation and casts, FSDP2's one-rank copies, and the host's
work once a step."""
from __future__ import annotations

from costmodel.hardware import ClusterSpec, DeviceProfile
from costmodel.kernels.roofline import memory_bound_s, roofline_s
from costmodel.specs import DType, Optimizer, TrainSpec


def host_optimizer_step_s(num_params: float, train: TrainSpec, cluster: ClusterSpec) -> float:
    """The optimizer step of offloaded states on the host (Plan.offload_optimizer), as the
    runtime runs it: torch's fused CPU AdamW over the fp32 shard reads master, moments and
    gradient and writes master and moments (no 16-bit copy: FSDP2 casts on the next gather, no
    clip). Memory-bound on the host's DRAM, which every device of the node shares: they step at
    once. (The foreach AdamW, a kernel per operation and tensor, runs several times slower per
    parameter on a CPU, which is why offload uses the fused one.)"""
    states = 3 * 4 if train.optimizer is Optimizer.ADAMW else 4
    per_param = 2 * states + 4
    return num_params * per_param / cluster.host_stream_bytes_per_s("an offloaded optimizer step")


def step_host_s(train: TrainSpec, dev: DeviceProfile) -> float:
    """The step's own host work, once per step (Efficiency.step_overhead_s), fitted by the probes
    per compute dtype. A term of its own, not part of the per-kernel cost: spread over the kernels
    it would grow with their count and price a model's host-bound GPU steps too slow."""
    return dev.for_dtype(train.compute_dtype).efficiency.step_overhead_s


def gradient_add_s(num_params: float, incoming: DType, accumulator: DType, num_tensors: float,
                   dev: DeviceProfile) -> float:
    """One micro-batch's gradients of `num_params` parameters in `num_tensors` tensors added in
    place into the step's (one kernel per tensor): at the profile's measured rate where the
    accumulator is fp32 and the new gradients' dtype was measured, else as traffic (read both,
    write the sum) at the profile's bandwidth. Affine in both counts (the search's rank shapes
    rely on it), hence the bandwidth rather than the memory-bound curve at a size per tensor."""
    rate = dev.grad_accumulate_rate(incoming)
    if rate and accumulator is DType.FP32:
        return num_params * rate + _launches_s(num_tensors, dev)
    return _traffic_s(num_params * (incoming.num_bytes + 2 * accumulator.num_bytes), num_tensors, dev)


def gradient_cast_s(num_params: float, incoming: DType, accumulator: DType, num_tensors: float,
                    dev: DeviceProfile) -> float:
    """The first micro-batch's 16-bit gradients cast into a new fp32 accumulator (FSDP2's
    `unsharded_accumulated_grad`): read one, write the other, at the profile's bandwidth."""
    return _traffic_s(num_params * (incoming.num_bytes + accumulator.num_bytes), num_tensors, dev)


# FSDP2's copy of an all-gather's output into the tensors the parameters view
# (foreach_all_gather_copy_out: torch.ops.fsdp.split_with_sizes_copy, run on the compute stream
# once it has waited on the gather's event; torch 2.13's _fsdp_collectives): the gathered bytes
# read and written once each
COPY_OUT_PASSES = 2

# FSDP2's own passes over a unit's parameters where its group has one rank, bytes per parameter
# by the compute dtype's width w: the reduce copies the gradients into its fp32 flat buffer and
# out into the fp32 sharded gradients (read and write each: 16); the gather casts the fp32 shard
# into the all-gather's input (4 + w; no cast in fp32) and, with no all-gather on one rank, copies
# it out (COPY_OUT_PASSES x w) (torch 2.13's _fsdp_param_group)
FSDP_SYNC_BYTES = {"reduce": lambda w: 16, "gather": lambda w: COPY_OUT_PASSES * w + (4 + w if w < 4 else 0)}


def gather_copy_out_s(gathered_bytes: float, dev: DeviceProfile) -> float:
    """FSDP2's copy-out of one all-gather of `gathered_bytes` (COPY_OUT_PASSES) at the profile's
    bandwidth: on the compute stream, so nothing hides it."""
    return _traffic_s(COPY_OUT_PASSES * gathered_bytes, 0, dev)


def fsdp_sync_s(kind: str, num_params: float, compute: DType, num_tensors: float, dev: DeviceProfile) -> float:
    """One FSDP2 reduce or gather ("reduce", "gather") of `num_params` parameters on a one-rank
    group (costmodel.frameworks `one_replica_fsdp`): at the profile's measured rate
    (`fsdp_sync_s_per_param`, runtime.profiler.fsdp_sync_s_per_param), else as its copies' traffic
    (FSDP_SYNC_BYTES) at the profile's bandwidth. The measured rate comes first: on a CPU the
    copies run slower than their bytes (16 and 10 a bf16 parameter) at the profile's bandwidth,
    so the traffic alone prices them fast."""
    rate = dev.fsdp_sync_rate(kind, compute)
    if rate is not None:
        return num_params * rate
    return _traffic_s(num_params * FSDP_SYNC_BYTES[kind](compute.num_bytes), num_tensors, dev)


def _traffic_s(num_bytes: float, num_tensors: float, dev: DeviceProfile) -> float:
    """Bytes at the profile's bandwidth (roofline_s), the tensors' launches apart (_launches_s)."""
    return roofline_s(0.0, num_bytes, dev, 1.0, 1.0, num_kernels=0) + _launches_s(num_tensors, dev)


def _launches_s(num_tensors: float, dev: DeviceProfile) -> float:
    """The per-kernel cost of one small kernel per tensor. On a GPU the host queues them during
    the backward pass while the device still computes, so they hide (as _host_or_device's
    longer of the two would have it); on a CPU the same cores run both."""
    return num_tensors * dev.efficiency.kernel_overhead_s if dev.kind == "cpu" else 0.0


def optimizer_step_s(num_params: float, train: TrainSpec, dev: DeviceProfile) -> float:
    """AdamW over the local (ZeRO-sharded) parameters: read master, moments and gradient, write
    master, moments and the 16-bit copy, plus one gradient read for the global-norm clip."""
    if dev.optimizer_s_per_param and train.optimizer is Optimizer.ADAMW:
        # measured on this machine as the runtime steps it (runtime.profiler): the memory-bound
        # curve's large kernels pay for fresh outputs (page faults on a CPU: 4-7x slower there)
        return num_params * dev.optimizer_s_per_param
    dev = dev.for_dtype(train.compute_dtype)
    g = train.grad_dtype.num_bytes
    states = 3 * 4 if train.optimizer is Optimizer.ADAMW else 4
    per_param = 2 * states + 2 * g + (train.compute_dtype.num_bytes if train.master_weights_fp32 else 0)
    return memory_bound_s(num_params * per_param, dev, 4)
