"""The physical sanity of a profile's numbers, checked when it is read and before it is written."""
from __future__ import annotations

import math
import re

from costmodel.hardware.records import RING_COLLECTIVES, DeviceProfile

# The rates a step's times divide by, from far below any device to far above: a link's bandwidth
# per device and direction from 1 kB/s (gloo between processes on a loaded CPU has measured 30 kB/s)
# to 100 TB/s (a hundred times NVLink 5), a memory's from
# 1 MB/s to 1 PB/s, a peak from 1 MFLOP/s to 1 EFLOP/s. Beyond them a time reaches 1e300 s or
# 1e-300 s, which the solver's integer coefficients and a printed table cannot hold.
LINK_BYTES_PER_S_RANGE = (1e3, 1e14)
MEMORY_BYTES_PER_S_RANGE = (1e6, 1e15)
PEAK_FLOPS_PER_S_RANGE = (1e6, 1e18)
# Times added up into a step: one operation's (a latency, a kernel's or a step's overhead) up to
# 10 s, one parameter's or element's work up to a millisecond, and a slowdown factor up to 10x;
# beyond, a step's sum overflows to inf (a latency of 1e308 s did).
OPERATION_S_MAX = 10.0
PER_ITEM_S_MAX = 1e-3
FACTOR_MAX = 10.0
# A dimensionless factor a time or a rate is multiplied or divided by (an efficiency, a
# collective's factor over its tier, a spine's oversubscription): a thousandth to a thousand
# (measured CPU efficiencies reach 1.2, collectives' kind factors 0.3-1.7); beyond, a time leaves
# the floats.
RATIO_RANGE = (1e-3, 1e3)
# Capacities and counts: up to an exbibyte of memory, a million SMs or threads (a TOML integer
# of 2^63 would otherwise reach the memory ledger and the solver's coefficients).
MEMORY_BYTES_MAX = 2**60
COUNT_MAX = 1_000_000
SDPA_SIZE_MAX = 2**24   # a measured attention point's sequence or head dim (--seq-len's own limit)


def profile_problems(dev: DeviceProfile) -> list[str]:
    """Every number the cost model divides by or adds: finite, and positive where it is a rate.
    (A zero bandwidth would divide by zero; a negative one would make plans faster.)"""
    return [*_device_problems(dev), *_network_problems(dev), *_efficiency_problems(dev), *_host_problems(dev),
            *_measured_problems(dev)]


class _Checks(list):
    """The problems found so far; `need` adds one where a number is not finite or not `ok`."""

    def need(self, name: str, value: float, ok: bool) -> None:
        if not (math.isfinite(value) and ok):
            self.append(f"{name} = {value!r} is out of range")


def _device_problems(dev: DeviceProfile) -> list[str]:
    out = _Checks()
    need = out.need
    for dtype, flops in dev.peak_flops:
        need(f"peak_flops_per_s.{dtype}", flops, _within(flops, PEAK_FLOPS_PER_S_RANGE))
    need("memory_bytes", dev.memory_bytes, 0 < dev.memory_bytes <= MEMORY_BYTES_MAX)
    need("memory_bandwidth_bytes_per_s", dev.memory_bandwidth_bytes_per_s,
         _within(dev.memory_bandwidth_bytes_per_s, MEMORY_BYTES_PER_S_RANGE))
    need("threads_per_rank", dev.threads_per_rank, 0 <= dev.threads_per_rank <= COUNT_MAX)
    need("num_sms", dev.num_sms, 0 <= dev.num_sms <= COUNT_MAX)
    need("devices_per_host", dev.devices_per_host, 0 <= dev.devices_per_host <= COUNT_MAX)
    need("best_matmul_fraction", dev.best_matmul_fraction, 0 <= dev.best_matmul_fraction <= 1)
    need("gemm_tile_setup_k", dev.gemm_tile_setup_k, 0 <= dev.gemm_tile_setup_k <= COUNT_MAX)
    need("gemm_tile", dev.gemm_tile, 1 <= dev.gemm_tile <= COUNT_MAX)
    need("memory_ranks", dev.memory_ranks,   # a CPU's RAM shared by its ranks; a GPU's memory is its own
         0 <= dev.memory_ranks <= COUNT_MAX and (dev.kind == "cpu" or dev.memory_ranks == 0))
    need("reported_memory_bytes", dev.reported_memory_bytes, 0 <= dev.reported_memory_bytes <= MEMORY_BYTES_MAX)
    for name in ("optimizer_s_per_param", "dropout_s_per_element"):
        need(name, getattr(dev, name), 0 <= getattr(dev, name) <= PER_ITEM_S_MAX)
    for dtype, seconds in dev.grad_accumulate_s_per_param:
        need(f"grad_accumulate_s_per_param.{dtype}", seconds, 0 < seconds <= PER_ITEM_S_MAX)
    for key, seconds in dev.fsdp_sync_s_per_param:   # a difference of two timings: 0 where noise ate it
        need(f"fsdp_sync_s_per_param.{key}", seconds, 0 <= seconds <= PER_ITEM_S_MAX)
    for approximate, fwd, bwd in dev.gelu_s_per_element:
        need(f"gelu_s_per_element.{approximate}", fwd, 0 <= fwd <= PER_ITEM_S_MAX)
        need(f"gelu_s_per_element.{approximate}", bwd, 0 <= bwd <= PER_ITEM_S_MAX)
    if not isinstance(dev.name, str) or not dev.name.strip() or not dev.name.isprintable():
        out.append(f"device.name {dev.name!r} is not a name")
    if dev.kind not in ("gpu", "cpu"):
        out.append(f"device.kind = {dev.kind!r} is neither gpu nor cpu")
    return out


def _network_problems(dev: DeviceProfile) -> list[str]:
    out = _Checks()
    need = out.need
    for tier in (dev.intra_node, dev.inter_node, *dev.middle_tiers):
        need(f"network {tier.name} bandwidth_bytes_per_s", tier.bandwidth_bytes_per_s,
             _within(tier.bandwidth_bytes_per_s, LINK_BYTES_PER_S_RANGE))
        need(f"network {tier.name} latency_s", tier.latency_s, 0 <= tier.latency_s <= OPERATION_S_MAX)
        need(f"network {tier.name} base_latency_s", tier.base_latency_s, 0 <= tier.base_latency_s <= OPERATION_S_MAX)
        need(f"network {tier.name} efficiency", tier.efficiency, RATIO_RANGE[0] <= tier.efficiency <= 1)
        if tier.forward_bytes_per_s and tier is not dev.intra_node:
            out.append(f"network {tier.name} forward_bytes_per_s: only the node tier's is read (a per-node "
                       "expert dispatcher forwards within the node)")
        elif tier.forward_bytes_per_s:
            need(f"network {tier.name} forward_bytes_per_s", tier.forward_bytes_per_s,
                 _within(tier.forward_bytes_per_s, LINK_BYTES_PER_S_RANGE))
        if tier.p2p_latency_s is not None:
            need(f"network {tier.name} p2p_latency_s", tier.p2p_latency_s, 0 <= tier.p2p_latency_s <= OPERATION_S_MAX)
        for kind, latency, bandwidth in tier.kind_factors:
            if kind not in RING_COLLECTIVES:
                out.append(f"network {tier.name} kind_factors: {kind!r} is none of {', '.join(RING_COLLECTIVES)}")
            need(f"network {tier.name} kind_factors.{kind}.latency", latency, _within(latency, RATIO_RANGE))
            need(f"network {tier.name} kind_factors.{kind}.bandwidth", bandwidth, _within(bandwidth, RATIO_RANGE))
    # an NVLink domain across hosts holds some devices, or none is stated
    need("device.nvlink_domain_devices", dev.nvlink_domain_devices, dev.nvlink_domain_devices >= 0)
    # a leaf connects at least one node; a spine gives a device at most its NIC's bandwidth
    need("fabric.nodes_per_leaf", dev.fabric.nodes_per_leaf, dev.fabric.nodes_per_leaf >= 1)
    need("fabric.spine_oversubscription", dev.fabric.spine_oversubscription,
         1 <= dev.fabric.spine_oversubscription <= RATIO_RANGE[1])
    return out


def _efficiency_problems(dev: DeviceProfile) -> list[str]:
    out = _Checks()
    need = out.need
    for label, eff in (("efficiency", dev.efficiency), *((f"efficiency.{d}", e) for d, e in dev.dtype_efficiency)):
        for name in ("gemm", "attention", "memory", "vendor_attention_speedup", "recompute_cost"):
            need(f"{label}.{name}", getattr(eff, name), _within(getattr(eff, name), RATIO_RANGE))
        if dev.kind == "gpu" and not dev.machine_key:   # of a datasheet's peak, which no kernel beats
            # (a measured profile's peak is the best GEMM it saw, which its attention may pass)
            for name in ("gemm", "attention", "memory"):
                need(f"{label}.{name}", getattr(eff, name), getattr(eff, name) <= 1)
        need(f"{label}.reserved_memory_bytes", eff.reserved_memory_bytes,   # the runtime's own, less than the device
             0 <= eff.reserved_memory_bytes < dev.memory_bytes)
        need(f"{label}.allocator_fragmentation", eff.allocator_fragmentation,
             0 <= eff.allocator_fragmentation <= FACTOR_MAX)
        for name in ("kernel_overhead_s", "step_overhead_s"):
            need(f"{label}.{name}", getattr(eff, name), 0 <= getattr(eff, name) <= OPERATION_S_MAX)
        need(f"{label}.comm_contention", eff.comm_contention, 0 <= eff.comm_contention <= FACTOR_MAX)
        need(f"{label}.overlap", eff.overlap, 0 <= eff.overlap <= 1)
        need(f"{label}.attention_backward_ratio", eff.attention_backward_ratio, 0 < eff.attention_backward_ratio <= 1)
    # device-wide factors (no per-dtype table holds them): checked once
    for name in ("dp_comm", "pp_stage"):
        need(f"efficiency.{name}", getattr(dev.efficiency, name), _within(getattr(dev.efficiency, name), RATIO_RANGE))
    return out


def _host_problems(dev: DeviceProfile) -> list[str]:
    out = _Checks()
    if (host := dev.host) is None:
        return out
    out.need("host.memory_bytes", host.memory_bytes, 0 < host.memory_bytes <= MEMORY_BYTES_MAX)
    out.need("host.memory_bandwidth_bytes_per_s", host.memory_bandwidth_bytes_per_s,
             _within(host.memory_bandwidth_bytes_per_s, MEMORY_BYTES_PER_S_RANGE))
    out.need("host.link_bandwidth_bytes_per_s", host.link_bandwidth_bytes_per_s,
             _within(host.link_bandwidth_bytes_per_s, LINK_BYTES_PER_S_RANGE))
    for name in ("memory_efficiency", "link_efficiency"):
        out.need(f"host.{name}", getattr(host, name), RATIO_RANGE[0] <= getattr(host, name) <= 1)
    if dev.kind == "cpu":
        out.append("[host] on a cpu profile: its ranks already run on the host, nothing is offloaded")
    return out


def _measured_problems(dev: DeviceProfile) -> list[str]:
    """A measured profile's curves: SDPA's in forward and backward pairs, every point in range."""
    out = []
    sdpa = dict(dev.sdpa_curves)
    for key in sdpa:   # the pricing reads a forward and its backward together (compute._measured_sdpa_s)
        partner = key.removesuffix("_forward") + "_backward" if key.endswith("_forward") else \
            key.removesuffix("_backward") + "_forward"
        if not re.fullmatch(r"sdpa_\w+?(_dropout)?_(forward|backward)", key) or not sdpa[key] or not sdpa.get(partner):
            out.append(f"measured.{key} is not one of a non-empty forward and backward pair of SDPA curves")
    for name, curve, rates in (*((f"measured.gemm_{d}", c, PEAK_FLOPS_PER_S_RANGE) for d, c in dev.gemm_curves),
                               ("measured.memory_bound", dev.memory_curve, MEMORY_BYTES_PER_S_RANGE)):
        if any(not (math.isfinite(x) and x > 0 and _within(y, rates)) for x, y in curve):
            out.append(f"{name} has a point that is not a positive size and a rate from {rates[0]:g} to {rates[1]:g}")
    for key, points in dev.sdpa_curves:   # a time per query-key pair divides by the sequence squared
        if any(not (1 <= s <= SDPA_SIZE_MAX and 1 <= d <= SDPA_SIZE_MAX and 0 < t <= OPERATION_S_MAX)
               for s, d, t in points):
            out.append(f"measured.{key} has a point that is not a sequence and a head dim from 1 to "
                       f"{SDPA_SIZE_MAX:,} and a time up to {OPERATION_S_MAX:g} s")
    return out


def _within(value: float, bounds: tuple[float, float]) -> bool:
    return bounds[0] <= value <= bounds[1]


def bound_at(value: float, low: float, high: float) -> str | None:
    """"lower" or "upper" where `value` sits at that bound of the range low-high, within 1 % of
    its width (a fit's tolerance, and a profile's rounding); None inside it, or for a range of
    one value (low == high: a fixed value, not a bound)."""
    edge = 0.01 * (high - low)
    if low == high or min(value - low, high - value) > edge:
        return None
    return "lower" if value - low <= edge else "upper"


def range_problems(dev: DeviceProfile) -> list[str]:
    """Fitted efficiencies outside their published range ([ranges]), or at one of its bounds
    (bound_at): a fit pinned there wants what the measurements do not allow, so a mechanism is
    missing."""
    out = []
    for name, r in dev.ranges:
        value = dev.fitted_value(name)
        if value < r.low or value > r.high:
            out.append(f"{dev.name} {name} = {value:.4g} is outside its published range {r.low:g}-{r.high:g}")
        elif bound_at(value, r.low, r.high):
            out.append(f"{dev.name} {name} = {value:.4g} sits at a bound of its published range {r.low:g}-{r.high:g}")
    return out

