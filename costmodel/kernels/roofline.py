"""The roofline every kernel is priced by, and the shapes and times kernels share.

Each kernel is priced by the roofline (Williams et al. 2009): the larger of FLOPs over the
achievable FLOP/s and bytes over the achievable memory bandwidth, plus a fixed per-kernel cost
(launch and wave tail), which is what makes small GEMMs and many small kernels inefficient.
Achievable rates are datasheet peak x the profile's fitted efficiencies, or, where the profile
was measured (`planner profile`), the measured rate at that size: FLOP/s interpolated by FLOPs
per GEMM call, bytes/s by bytes per memory-bound kernel (log-linear between measured sizes,
flat beyond them), times the same efficiencies (1 unless calibrated). Measured rates include the
bare call's cost; a measured profile's kernel overhead is what training adds per kernel (autograd,
module calls, hooks), 0 until `planner calibrate` fits it.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass
from typing import Protocol

from costmodel.hardware import DeviceProfile
from costmodel.specs import TrainSpec


class KernelShape(Protocol):
    """What kernel times depend on (a Plan has these, and so does the search's cache key)."""

    tp: int
    cp: int
    ep: int
    etp: int
    sequence_parallel: bool
    micro_batch_size: int
    fp8_linears: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelTimes:
    """Seconds for one micro-batch through one layer on one device (no communication)."""

    forward_s: float
    backward_input_s: float   # dX (and everything without weights, e.g. attention core)
    backward_weight_s: float  # dW of the projections
    attention_forward_s: float  # the part selective recomputation re-runs
    # what a full recomputation re-runs: the forward, less what torch's early stop skips
    # (`final_linear_forward_s`) where the framework stops early; the forward elsewhere
    recompute_forward_s: float

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s


def roofline_s(flops: float, num_bytes: float, dev: DeviceProfile, peak: float, eff: float,
               num_kernels: int = 1) -> float:
    return (max(flops / (peak * eff), num_bytes / (dev.memory_bandwidth_bytes_per_s * dev.efficiency.memory))
            + num_kernels * dev.efficiency.kernel_overhead_s)


def interpolate(curve: tuple[tuple[float, float], ...], x: float) -> float:
    """Log-linear in x between measured points, the end values beyond them."""
    if x <= curve[0][0]:
        return curve[0][1]
    if x >= curve[-1][0]:
        return curve[-1][1]
    i = bisect_left(curve, (x, -math.inf))
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0)) if x1 > x0 else 0.0
    return y0 + w * (y1 - y0)


def memory_bound_s(num_bytes: float, dev: DeviceProfile, num_kernels: int, native: bool = False) -> float:
    """native: vectorised kernels of the kind a measured memory curve times (softmax, RMS norm,
    add: runtime.profiler.memory_points), priced at the curve itself; the fitted memory factor
    is what a training step's other memory-bound work adds to it. Without a curve every kernel
    gets the profile's share of the bandwidth."""
    if dev.memory_curve and num_bytes > 0:
        per_kernel = num_bytes / num_kernels
        factor = 1.0 if native else dev.efficiency.memory
        return num_kernels * (per_kernel / (interpolate(dev.memory_curve, per_kernel) * factor)
                              + dev.efficiency.kernel_overhead_s)
    return roofline_s(0.0, num_bytes, dev, 1.0, 1.0, num_kernels)


def compute_bound_s(flops: float, num_bytes: float, dev: DeviceProfile, train: TrainSpec, eff: float,
                    num_kernels: int = 1) -> float:
    """A GEMM-like kernel: the measured rate at its size when profiled, else the roofline."""
    curve = dev.gemm_curve(train.compute_dtype)
    if curve:
        per_kernel = flops / num_kernels
        return num_kernels * (per_kernel / (interpolate(curve, per_kernel) * eff)
                              + dev.efficiency.kernel_overhead_s)
    return roofline_s(flops, num_bytes, dev, dev.peak_for(train.compute_dtype), eff, num_kernels)
