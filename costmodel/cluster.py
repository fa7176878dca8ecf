"""Hardware as data: device profiles (TOML files) x nodes x devices per node.

A profile keeps datasheet numbers (`[device]`, `[[network]]`) apart from the achievable
efficiency parameters (`[efficiency]`), which are fitted or measured and say how.
"""
from __future__ import annotations

import math
import re
import statistics
import tomllib
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from costmodel import inputs, machine
from costmodel.frameworks import RUNTIME, FrameworkTraits, traits_on
from costmodel.inputs import InputError
from costmodel.specs import DType

# Fraction of the device memory CUDA reports that plans leave free by default: the spread of the
# allocator's reserved-over-allocated ratio between runs of one job (a few %, see the profiles'
# `allocator_fragmentation` notes) is what a plan at the edge would trip over.
DEFAULT_MEMORY_HEADROOM = 0.05


# the collectives a tier's kind_factors may name (costmodel.comm.RING_KINDS; comm imports this module)
RING_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True, kw_only=True, slots=True)
class NetworkTier:
    """One level of the network. Bandwidth is per device, per direction (what one GPU can push)."""

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float
    efficiency: float  # achievable fraction of bandwidth_bytes_per_s for large collectives
    p2p_latency_s: float | None = None  # measured point-to-point latency when it differs (gloo)
    # a tier between the node and the whole cluster (a rack, a leaf switch) connects groups of at
    # most this many nodes; None for the node and cluster tiers
    max_nodes: int | None = None
    # (collective kind, latency factor, bandwidth factor): a kind's own microbenchmark fit over
    # the tier's joint one (costmodel.comm.kind_factors), where the backend runs the kinds
    # differently (gloo's reduce-scatter); empty (every kind at the tier's) for a datasheet tier
    kind_factors: tuple[tuple[str, float, float], ...] = ()

    @property
    def effective_bandwidth_bytes_per_s(self) -> float:
        return self.bandwidth_bytes_per_s * self.efficiency

    def _factors(self, kind: str) -> tuple[float, float]:
        for name, latency, bandwidth in self.kind_factors:
            if name == kind:
                return latency, bandwidth
        return 1.0, 1.0

    def latency_for(self, kind: str) -> float:
        """One ring step's latency for a collective of this kind."""
        return self.latency_s * self._factors(kind)[0]

    def bandwidth_for(self, kind: str) -> float:
        """The effective bandwidth a collective of this kind moves its bytes at."""
        return self.effective_bandwidth_bytes_per_s * self._factors(kind)[1]


@dataclass(frozen=True, kw_only=True, slots=True)
class Efficiency:
    """Achievable fractions of the datasheet peaks, and fixed overheads (see each profile's notes)."""

    gemm: float               # large-GEMM fraction of dense peak FLOP/s
    attention: float          # fused (flash) attention fraction of dense peak FLOP/s
    memory: float             # fraction of HBM bandwidth reached by memory-bound kernels
    kernel_overhead_s: float  # fixed cost per kernel: launch, and on CPUs eager dispatch (wave tails: compute.wave_efficiency)
    reserved_memory_bytes: int  # outside PyTorch's allocator: CUDA context, NCCL buffers, workspaces
    source: str
    overlap: float = 1.0      # fraction of compute that data-parallel communication can hide behind
    # data-parallel terms' (FSDP's bucketed reduce-scatters and gathers, and what rides on them:
    # contention, offload copies) speed over the links' fitted efficiency and latency, which TP's
    # and CP's many activation-sized collectives share: 1 where one efficiency serves all. A CPU
    # profile's probes fit it (planner.calibrate.CPU_COMM_PARAMS; costmodel.rank_time.dp_term_comm_s).
    dp_comm: float = 1.0
    # a pipeline stage's work (its layers, embedding and head, with their collectives) over
    # its price when pp > 1: the stage work of every stored closed loop's pp2 plans ran a median
    # 14 points further over its price than the same run's one-rank plan (28 of 32 run-dtype
    # pairs; 2026-11-27). `planner calibrate` fits it on a CPU's runs when some have a pipeline
    # (planner.calibrate.CPU_COMM_PARAMS; costmodel.rank_time.rank_time_model); 1 in datasheets
    # and measured profiles (planner.probes.fit_probes).
    pp_stage: float = 1.0
    # the caching allocator's reserved bytes over the bytes it hands out, minus 1 (block rounding
    # and fragmentation): what allocated tensors really cost of the device
    allocator_fragmentation: float = 0.0
    # compute slowdown per second of data-parallel communication hidden behind it (NCCL's
    # kernels occupy SMs and HBM bandwidth beside the GEMMs); fitted, 0 where unknown
    comm_contention: float = 0.0
    # how much faster the vendor's fused attention (cuDNN, FlashAttention-3) runs than the
    # FlashAttention-2 kernel `attention` describes, for frameworks that use it; 1: none
    vendor_attention_speedup: float = 1.0
    # host work once per training step outside the layers' kernels and the optimizer's (the
    # runtime's barrier, the loss's reduction, the batch, zero_grad): fitted by a measured
    # profile's probes, whose small steps show it (planner.probes.compute_params); 0 in datasheets
    step_overhead_s: float = 0.0
    # what recomputing a layer costs, as a share of its priced forward: 1 where a recomputed
    # forward runs the forward's kernels again (a GPU; Korthikanti et al. 2022 price full
    # recomputation as one more forward). On a CPU it costs less, most likely because a layer
    # recomputed inside the backward pass leaves its activations in cache for the backward that
    # reads them at once, where a training forward writes fresh pages (0.6-0.75 in
    # `planner run` on a 2-core EPYC, 2026-11-27). `calibrate` fits it from runs that recompute;
    # `planner profile` does not measure it: within its budget the same measurement read 0.5 to
    # 1.1 on that machine (README, "Recomputation's cost").
    recompute_cost: float = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class HostSpec:
    """The host a node's devices hang off, for what is offloaded to it (optimizer states and
    their step, ZeRO-Offload / FSDP2's CPUOffloadPolicy). Memory figures are per node; the link is
    per device and per direction, as it is when every device of the node copies at once."""

    memory_bytes: int                      # host DRAM per node (datasheet)
    memory_bandwidth_bytes_per_s: float    # host DRAM bandwidth per node (channels x rate)
    memory_efficiency: float               # achievable fraction of it for streaming kernels
    link_bandwidth_bytes_per_s: float      # device <-> host, per device, per direction
    link_efficiency: float                 # achievable fraction of it for pinned-memory copies
    source: str

    @property
    def link_effective_bytes_per_s(self) -> float:
        return self.link_bandwidth_bytes_per_s * self.link_efficiency


# What a profile's [efficiency.<dtype>] table sets (the rest is the device's).
DTYPE_FIELDS = ("gemm", "attention", "memory", "kernel_overhead_s")
OPTIONAL_DTYPE_FIELDS = ("step_overhead_s", "recompute_cost")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceProfile:
    name: str
    aliases: tuple[str, ...]
    peak_flops: tuple[tuple[str, float], ...]  # (dtype, dense peak FLOP/s); a tuple keeps specs hashable
    memory_bytes: int         # datasheet capacity
    memory_bandwidth_bytes_per_s: float
    intra_node: NetworkTier
    inter_node: NetworkTier
    # tiers between the node and the cluster, innermost first ([[network]] entries with another
    # scope and `max_nodes`): a third tier is a profile change, not a code change
    middle_tiers: tuple[NetworkTier, ...] = ()
    efficiency: Efficiency
    path: str
    # Measured curves (`planner profile`): per dtype, (FLOPs per GEMM call, achieved FLOP/s);
    # (bytes per memory-bound kernel, achieved bytes/s). Empty: datasheet peak x efficiency.
    gemm_curves: tuple[tuple[str, tuple[tuple[float, float], ...]], ...] = ()
    memory_curve: tuple[tuple[float, float], ...] = ()
    kind: str = "gpu"   # "cpu": ranks are processes on CPU cores (gloo); runs need no GPU
    threads_per_rank: int = 0   # CPU: threads per rank the figures were measured with (0: unknown)
    # `planner profile`: the costmodel.machine key and description of the machine measured
    # (empty for datasheet profiles, which describe a kind of device, not one machine)
    machine_key: str = ""
    machine: str = ""
    # per compute dtype where training differs by dtype (a CPU's bf16 path: other kernels, other
    # per-kernel costs): `planner profile`'s [efficiency.<dtype>] tables; empty: one for all
    dtype_efficiency: tuple[tuple[str, Efficiency], ...] = ()
    # what the runtime can allocate on: torch.cuda's total_memory (less than the datasheet:
    # ECC and the driver's own reservations); 0: unknown, the datasheet figure is used
    reported_memory_bytes: int = 0
    num_sms: int = 0   # streaming multiprocessors (GEMM wave quantisation); 0: not modelled
    # the node's host, where offloaded states live; None: nothing can be offloaded (a CPU
    # profile's ranks already run on the host)
    host: HostSpec | None = None
    # `planner profile`: an AdamW step as the runtime takes one, seconds per parameter (0: not
    # measured; the step is then priced as memory-bound traffic)
    optimizer_s_per_param: float = 0.0
    # `planner profile`: one micro-batch's gradients added in place into fp32 gradients, seconds
    # per parameter, by the dtype the new ones come in (empty: not measured; the add is then
    # priced as memory-bound traffic, costmodel.compute.gradient_add_s)
    grad_accumulate_s_per_param: tuple[tuple[str, float], ...] = ()
    # `planner profile`: FSDP2's reduce and gather on a one-rank group, seconds per parameter, by
    # "reduce.<compute dtype>" and "gather.<compute dtype>" (empty: not measured; then priced as
    # their copies' traffic, costmodel.compute.fsdp_sync_s)
    fsdp_sync_s_per_param: tuple[tuple[str, float], ...] = ()
    # `planner profile`: torch's dropout, seconds per element, on a CPU (0: not measured, or a
    # GPU, whose dropout draws inside the multiply's kernel; dropout is then priced as the
    # multiply's bytes alone)
    dropout_s_per_element: float = 0.0
    # `planner profile` on a CPU: torch's GeLU, (approximation, forward, backward) seconds per
    # element, "tanh" and "none" (erf) (empty: not measured, or a GPU, whose GeLU is memory-bound
    # and priced as bytes)
    gelu_s_per_element: tuple[tuple[str, float, float], ...] = ()
    # `planner profile` on a CPU: torch's causal SDPA as the runtime calls it, per compute dtype,
    # pass and dropout (sdpa_key): points of (sequence, head dim, seconds per head), sorted
    # (costmodel.compute.sdpa_head_s); empty: attention is priced from the GEMM curve
    sdpa_curves: tuple[tuple[str, tuple[tuple[float, float, float], ...]], ...] = ()
    # the cost model the profile's probes were fitted under (PROBE_FIT_VERSION; 0: no probes)
    probe_fit_version: int = 0

    @property
    def usable_memory_bytes(self) -> int:
        return self.reported_memory_bytes or self.memory_bytes

    def tier_for(self, num_nodes: int) -> NetworkTier:
        """The slowest tier a group spread over `num_nodes` nodes crosses (its nodes taken as
        consecutive, as the row-major placement lays them out): the node's own links for one node,
        the innermost middle tier that spans them, else the cluster's."""
        if num_nodes <= 1:
            return self.intra_node
        return next((t for t in self.middle_tiers if num_nodes <= (t.max_nodes or 0)), self.inter_node)

    def for_dtype(self, dtype: DType) -> "DeviceProfile":
        """This profile with the efficiency of `dtype` (itself when it has none of its own)."""
        if not self.dtype_efficiency:
            return self
        return _for_dtype(self, str(dtype))

    def gemm_curve(self, dtype: DType) -> tuple[tuple[float, float], ...]:
        return dict(self.gemm_curves).get(str(dtype), ())

    def sdpa_curve(self, dtype: DType, dropout: bool, backward: bool) -> tuple[tuple[float, float, float], ...]:
        return dict(self.sdpa_curves).get(sdpa_key(str(dtype), dropout, backward), ())

    def grad_accumulate_rate(self, incoming: DType) -> float | None:
        """Seconds per parameter of an add of `incoming` gradients into fp32 ones; None: not measured."""
        return dict(self.grad_accumulate_s_per_param).get(str(incoming))

    def fsdp_sync_rate(self, kind: str, compute: DType) -> float | None:
        """Seconds per parameter of FSDP2's one-rank `kind` ("reduce", "gather"); None: not measured."""
        return dict(self.fsdp_sync_s_per_param).get(fsdp_sync_key(kind, str(compute)))

    @property
    def peak_flops_per_s(self) -> dict[str, float]:
        return dict(self.peak_flops)

    def peak_for(self, dtype: DType) -> float:
        peak = self.peak_flops_per_s.get(str(dtype), 0.0)
        if peak <= 0:
            raise ValueError(f"device {self.name} has no {dtype} support in its profile")
        return peak


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceGroup:
    """One group of a mixed cluster: `num_nodes` nodes of one device profile."""

    device: DeviceProfile
    num_nodes: int

    def label(self, devices_per_node: int) -> str:
        """`4x8xA100-SXM4-80GB`: how clusters and tables name it."""
        return f"{self.num_nodes}x{devices_per_node}x{self.device.name}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterSpec:
    """The hardware, and how it is driven: the software whose traits price a plan (our runtime
    unless a published run says otherwise) and the share of memory plans leave free.

    A mixed cluster (`groups`, costmodel.groups) is several groups of nodes, each of one device
    profile, with the same devices per node, joined by `group_link`; `device` is then the first
    group's and means nothing alone: what a rank costs is asked of its group's view
    (costmodel.groups.rank_view), whose `pipeline_link` is the tier pipeline sends cross."""

    device: DeviceProfile
    num_nodes: int
    devices_per_node: int
    framework: FrameworkTraits = RUNTIME
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM
    groups: tuple[DeviceGroup, ...] = ()      # a mixed cluster's groups in rank order; () uniform
    group_link: NetworkTier | None = None     # a mixed cluster's link between its groups
    pipeline_link: NetworkTier | None = None  # a group's view: the tier its pipeline sends take
    # the search's caches key on clusters (a mixed one's views many times per candidate):
    # hashing the nested profiles each time cost seconds, so the hash is taken once
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return self._hash

    def __post_init__(self) -> None:
        if self.num_nodes <= 0 or self.devices_per_node <= 0:
            raise ValueError("a cluster needs at least one node and one device per node")
        if self.groups:
            _check_groups(self)
        inputs.check_limit("cluster", "world size", self.num_nodes * self.devices_per_node,
                           inputs.MAX_WORLD_SIZE)
        if not 0.0 <= self.memory_headroom < 1.0:
            raise ValueError(f"memory headroom {self.memory_headroom} must be in [0, 1)")
        # torch's kernels differ by device kind (costmodel.frameworks.traits_on)
        object.__setattr__(self, "framework", traits_on(self.framework, self.device.kind))
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare)))

    @property
    def is_mixed(self) -> bool:
        return bool(self.groups)

    def pipeline_tier(self, num_nodes: int) -> NetworkTier:
        """The tier a pipeline send over `num_nodes` nodes takes: the device's, or in a mixed
        cluster's group view the slower of it and the link between the groups (every pipeline
        of a mixed plan crosses that link; inner sends are priced at it too, a small
        pessimism: sends are one activation per micro-batch)."""
        own = self.device.tier_for(num_nodes)
        link = self.pipeline_link
        if link is None or link.effective_bandwidth_bytes_per_s >= own.effective_bandwidth_bytes_per_s:
            return own
        return link

    @property
    def memory_budget_bytes(self) -> float:
        """What a stage's predicted total (allocated tensors + the fixed reserve) may reach: the
        reported capacity less the headroom, with allocated bytes costing 1 + fragmentation.
        Stage totals count the reserve once, so the budget is stated in the same units."""
        if self.groups:
            raise AssertionError("a mixed cluster has a memory budget per group (costmodel.groups)")
        eff = self.device.efficiency
        fixed = eff.reserved_memory_bytes
        usable = self.device.usable_memory_bytes * (1.0 - self.memory_headroom) - fixed
        return usable / (1.0 + eff.allocator_fragmentation) + fixed

    def host_for(self, what: str) -> HostSpec:
        """The node's host, which `what` (an offloaded thing) needs; ValueError without one."""
        if self.device.host is None:
            raise ValueError(f"device {self.device.name} has no [host] for {what}")
        return self.device.host

    def host_stream_bytes_per_s(self, what: str) -> float:
        """One device's share of its host's DRAM bandwidth: every device of the node works on
        the host at once (their optimizer steps, their gradient adds)."""
        host = self.host_for(what)
        return host.memory_bandwidth_bytes_per_s * host.memory_efficiency / self.devices_per_node

    @property
    def host_budget_bytes(self) -> float:
        """Host memory one device's offloaded states may take: its share of the node's host
        memory, less the same headroom (0 without a [host])."""
        host = self.device.host
        return 0.0 if host is None else host.memory_bytes * (1.0 - self.memory_headroom) / self.devices_per_node

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.devices_per_node

    @property
    def name(self) -> str:
        if self.groups:
            return "+".join(g.label(self.devices_per_node) for g in self.groups)
        return f"{self.num_nodes}x{self.devices_per_node}x{self.device.name}"

    def to_dict(self) -> dict[str, Any]:
        out = {"num_nodes": self.num_nodes, "devices_per_node": self.devices_per_node,
               "device": _device_ref(self.device)}
        if self.memory_headroom != DEFAULT_MEMORY_HEADROOM:   # older readers never see the key
            out["memory_headroom"] = self.memory_headroom
        if self.groups:   # nor these, for a uniform cluster
            out["groups"] = [{"num_nodes": g.num_nodes, "device": _device_ref(g.device)} for g in self.groups]
            assert self.group_link is not None
            out["group_link_bytes_per_s"] = self.group_link.bandwidth_bytes_per_s
        return out


def _device_ref(dev: DeviceProfile) -> str:
    """A shipped profile by its name; any other (e.g. one `planner profile` wrote) by its path."""
    return dev.name if Path(dev.path).parent == profile_dir() else dev.path


def _check_groups(cluster: ClusterSpec) -> None:
    groups = cluster.groups
    if len(groups) < 2:
        raise ValueError("a mixed cluster needs at least two groups")
    if any(g.num_nodes <= 0 for g in groups):
        raise ValueError("every group of a mixed cluster needs at least one node")
    if sum(g.num_nodes for g in groups) != cluster.num_nodes or groups[0].device != cluster.device:
        raise ValueError("a mixed cluster's nodes and first device are its groups'")
    if len({g.device.kind for g in groups}) > 1:
        raise ValueError("a mixed cluster cannot mix GPU and CPU profiles (their ranks run different backends)")
    if cluster.group_link is None:
        raise ValueError("a mixed cluster needs the link between its groups")


@lru_cache(maxsize=64)
def _for_dtype(dev: DeviceProfile, dtype: str) -> DeviceProfile:
    own = dict(dev.dtype_efficiency).get(dtype)
    return dev if own is None else replace(dev, efficiency=own, dtype_efficiency=())


def profile_dir() -> Path:
    """Where the shipped profiles live (and where `planner profile` writes by default)."""
    return Path(str(resources.files("profiles")))


def _middle_tiers(path: Path, tiers: list[dict[str, Any]], efficiency: float) -> tuple[NetworkTier, ...]:
    out = []
    for raw in tiers:
        if raw["scope"] in ("node", "cluster"):
            continue
        if not isinstance(raw.get("max_nodes"), int) or raw["max_nodes"] < 2:
            raise ValueError(f"{path}: [[network]] scope {raw['scope']!r} needs max_nodes >= 2 (the nodes it connects)")
        out.append(replace(_tier(raw, float(raw.get("efficiency", efficiency))), max_nodes=raw["max_nodes"]))
    return tuple(sorted(out, key=lambda t: t.max_nodes))


def _tier(raw: dict[str, Any], efficiency: float) -> NetworkTier:
    p2p = raw.get("p2p_latency_s")
    return NetworkTier(name=raw["name"], bandwidth_bytes_per_s=float(raw["bandwidth_bytes_per_s"]),
                       latency_s=float(raw["latency_s"]), efficiency=efficiency,
                       p2p_latency_s=None if p2p is None else float(p2p),
                       kind_factors=_kind_factors(raw))


def _kind_factors(raw: dict[str, Any]) -> tuple[tuple[str, float, float], ...]:
    """A [[network]] table's kind_factors: a table of {latency, bandwidth} tables, one per kind
    (the kinds and the factors' signs are checked with the profile: profile_problems)."""
    kinds = raw.get("kind_factors", {})
    where = f"[[network]] {raw.get('name', '?')} kind_factors"
    if not isinstance(kinds, dict):
        raise ValueError(f"{where} is not a table of kinds")
    out = []
    for kind, pair in kinds.items():
        if not isinstance(pair, dict) or set(pair) != {"latency", "bandwidth"}:
            raise ValueError(f"{where}.{kind} needs exactly latency and bandwidth, got {pair!r}")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair.values()):
            raise ValueError(f"{where}.{kind}: latency and bandwidth are numbers, got {pair!r}")
        out.append((kind, float(pair["latency"]), float(pair["bandwidth"])))
    return tuple(out)


def _v1_memory_mix(path: Path, points: list) -> list[list[float]]:
    """A version-1 memory curve as the mix version 2 measures: per size e elements, the add's
    point (12e bytes) and the faster other kernel's (8e, standing for both RMS norm and softmax)
    give 28e bytes in 2 x 8e / rate + 12e / rate seconds (a little optimistic where the two
    differed). [device] memory_bandwidth_bytes_per_s stays the best single kernel's: the cost
    model reads it only where a profile has no curve."""
    pairs = sorted((float(x), float(y)) for x, y in points)
    if len(pairs) % 2 or not all(math.isfinite(v) and v > 0 for pair in pairs for v in pair) or \
            any(abs(add / other - 1.5) > 1e-3 for (other, _), (add, _) in zip(pairs[::2], pairs[1::2])):
        raise ValueError(f"{path}: [measured] memory_bound is not a version-1 curve (8 and 12 bytes per element "
                         f"at each size); measure the machine again with `planner profile`")
    out = []
    for (other, other_rate), (add, add_rate) in zip(pairs[::2], pairs[1::2]):
        elems = other / 8
        out.append([28 * elems / 3, 28 * elems / (2 * other / other_rate + add / add_rate)])
    return out


FSDP_SYNC_KINDS = ("reduce", "gather")


def fsdp_sync_key(kind: str, dtype: str) -> str:
    """How [measured] fsdp_sync_s_per_param names a rate: <reduce|gather>.<compute dtype>."""
    return f"{kind}.{dtype}"


def sdpa_key(dtype: str, dropout: bool, backward: bool) -> str:
    """How [measured] names an SDPA curve: sdpa_<dtype>[_dropout]_<forward|backward>."""
    return f"sdpa_{dtype}{'_dropout' if dropout else ''}_{'backward' if backward else 'forward'}"


# (batch, heads, sequence, head dim) of the SDPA calls a version-1 or -2 profile timed, its
# points (score-dims per call, score-dims/s) in this order (runtime.profiler.CPU_SDPA_SHAPES then)
V2_SDPA_SHAPES = ((1, 4, 128, 32), (1, 4, 256, 64), (1, 8, 512, 64), (2, 8, 1024, 64))


def _sdpa_numbers(path: Path, key: str, points: Any, width: int, what: str) -> list[list[float]]:
    """[measured] `key` as a list of points of `width` positive finite numbers, else one error
    naming the file, the key and the point."""
    if not isinstance(points, list):
        raise ValueError(f"{path}: [measured] {key} is not a list of [{what}] points")
    for i, point in enumerate(points):
        if not (isinstance(point, list) and len(point) == width
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                        for v in point)):
            raise ValueError(f"{path}: [measured] {key} point {i} ({point!r}) is not [{what}] of positive "
                             "numbers; measure the machine again with `planner profile`")
    return [[float(v) for v in point] for point in points]


def _v2_sdpa_points(path: Path, key: str, points: Any) -> list[list[float]]:
    """A version-2 SDPA curve as version 3's points: each (score-dims b·h·s²·d per call,
    score-dims/s) is one of V2_SDPA_SHAPES, found by its score-dims; its time over b·h heads.
    One head dim a sequence: the pricing scales it in proportion to the head dim, as version 2's
    score-dims did."""
    shapes = {b * h * s * s * d: (b * h, s, d) for b, h, s, d in V2_SDPA_SHAPES}
    out = []
    for i, (work, rate) in enumerate(_sdpa_numbers(path, key, points, 2, "score-dims per call, score-dims/s")):
        shape = next((v for w, v in shapes.items() if math.isclose(work, w, rel_tol=1e-3)), None)
        if shape is None:
            raise ValueError(f"{path}: [measured] {key} point {i} is at {work:g} score-dims, a call no version-2 "
                             "profile timed; measure the machine again with `planner profile`")
        heads, seq, dim = shape
        out.append([float(seq), float(dim), work / rate / heads])
    return out


def _sdpa_points(path: Path, key: str, points: Any) -> tuple[tuple[float, float, float], ...]:
    """[measured] sdpa_*: (sequence, head dim, seconds per head), sorted."""
    checked = _sdpa_numbers(path, key, points, 3, "sequence, head dim, seconds per head")
    return tuple(sorted((s, d, t) for s, d, t in checked))


def _curve(points: list[list[float]]) -> tuple[tuple[float, float], ...]:
    """Sorted by size, one rate per size: several GEMM shapes share a FLOP count (tokens x hidden
    x n in different orders) and the cost model knows the count only, so their median stands for
    it (interpolation among duplicates would otherwise land on whichever sorted first)."""
    by_size: dict[float, list[float]] = {}
    for x, y in points:
        by_size.setdefault(float(x), []).append(float(y))
    return tuple((x, statistics.median(ys)) for x, ys in sorted(by_size.items()))


# What a profile may hold, per table; anything else is refused (a misspelt key would otherwise
# leave its default in force without a word).
PROFILE_FORMAT_VERSION = 3   # written by `planner profile` / `calibrate`; files without one are read as version 1
# 2 (2026-11-27): [measured] memory_bound is one point per size, an add, an RMS norm and a softmax
# as one mix (runtime.profiler.memory_points). Version 1 held two per size, the add's (12 bytes
# per element) and the faster of the other two's (8): read as the mix they make (_v1_memory_mix).
# 3 (2026-11-27): [measured] sdpa_* are (sequence, head dim, seconds per head) at two head dims
# a sequence (costmodel.compute.sdpa_head_s). Versions 1-2 held (score-dims per call,
# score-dims/s) at one: read as the shapes they timed (_v2_sdpa_points).
READABLE_FORMAT_VERSIONS = (1, 2, PROFILE_FORMAT_VERSION)
# The cost model a profile's probe fit belongs to: raised when the model prices the probes'
# kernels differently (2: CPU layers counted op by op; 3: a GPU's kernels as the longer of host
# and device, the probes fitting a per-step host cost too; both 2026-11-26; 4: recomputation
# stopping early, and a second DP probe that tells the overlap, 2026-11-27; 5: the GEMM factor's
# upper bound 1.15 -> 1.5, planner.probes.PROBE_BOUNDS, 2026-11-27; 6: a CPU's attention priced from
# its measured SDPA curves (score-dims per call then); 7: a CPU's GEMM factor no longer fitted,
# planner.probes.compute_params; both 2026-11-27; 8: a CPU's DP collectives exposed (overlap 0)
# at a factor of their own, Efficiency.dp_comm; 9: a CPU's SDPA call below the smallest measured
# one at that one's time, costmodel.compute._measured_sdpa_s; 10: the memory-bound curve one kernel
# mix per size, PROFILE_FORMAT_VERSION 2; all 2026-11-27; 11: a CPU's SDPA priced per head at
# each call's sequence and head dim, PROFILE_FORMAT_VERSION 3, 2026-11-27; 12: a CPU's GEMM and
# memory-bound factors measured in a probe layer, not fitted, planner.probes.layer_factors,
# 2026-11-28; 13: each collective kind priced at its own microbenchmark fit, NetworkTier.kind_factors, and
# a second TP probe, 2026-11-28; 14: CPU ranks keep the memory they free, runtime.host_memory,
# so the probes' steps run faster than before, 2026-11-28; 15: gradient accumulation priced at
# its own measurement, costmodel.rank_time.grad_accumulation_s, and the embedding's dense gradient
# table, 2026-11-28; 16: FSDP2's reduce and gather on a one-replica plan priced at their own
# measurement, costmodel.rank_time.one_replica_fsdp_s, 2026-11-28; 17: FSDP units of a bucket's
# layers below ZeRO-3, costmodel.params.fsdp_unit_layers: the probes' steps run fewer collectives,
# 2026-11-28), so a cached `local` profile fitted under an older one is measured again instead of
# carrying factors fitted to other formulas or bounds.
PROBE_FIT_VERSION = 17
PROFILE_KEYS = {
    "": {"format_version", "device", "network", "efficiency", "measured", "probes", "host"},
    "host": {"memory_bytes", "memory_bandwidth_bytes_per_s", "memory_efficiency", "link_bandwidth_bytes_per_s",
             "link_efficiency", "source"},
    "device": {"name", "kind", "aliases", "peak_flops_per_s", "memory_bytes", "reported_memory_bytes", "num_sms",
               "memory_bandwidth_bytes_per_s", "threads_per_rank"},
    "network": {"scope", "name", "bandwidth_bytes_per_s", "latency_s", "p2p_latency_s", "max_nodes", "efficiency",
                "kind_factors"},
    "efficiency": {"gemm", "attention", "memory", "kernel_overhead_s", "intra_node_comm", "inter_node_comm",
                   "reserved_memory_bytes", "source", "overlap", "dp_comm", "pp_stage", "allocator_fragmentation",
                   "comm_contention", "vendor_attention_speedup", "step_overhead_s", "recompute_cost"},
}


def _check_keys(path: Path, raw: dict[str, Any]) -> None:
    tables = [("", raw), ("device", raw.get("device", {})), ("efficiency", raw.get("efficiency", {})),
              ("host", raw.get("host", {}))]
    tables += [("network", t) for t in raw.get("network", [])]
    for name, table in tables:
        extra = sorted(k for k, v in table.items() if k not in PROFILE_KEYS[name]
                       and not (name == "efficiency" and isinstance(v, dict)))
        if extra:
            where = f"[{name}]" if name else "the top level"
            raise ValueError(f"{path}: unknown key(s) {', '.join(extra)} in {where}")
    allowed = set(DTYPE_FIELDS) | set(OPTIONAL_DTYPE_FIELDS)
    for dtype, table in raw.get("efficiency", {}).items():
        if isinstance(table, dict) and set(table) - allowed:
            raise ValueError(f"{path}: unknown key(s) {', '.join(sorted(set(table) - allowed))} "
                             f"in [efficiency.{dtype}]")


def load_profile(path: Path) -> DeviceProfile:
    return parse_profile(inputs.read_text(path, "profile"), path)


def parse_profile(text: str, path: Path) -> DeviceProfile:
    """A profile's text, checked as `load_profile` checks a file (`path` names it in errors);
    the writer checks what it is about to write with it, so no profile is written unreadable."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{path}: not a valid profile (truncated? {exc})") from None
    version = raw.get("format_version", 1)   # profiles of 2026-11-22..24 have none, and a version-1 curve
    if version not in READABLE_FORMAT_VERSIONS:
        raise ValueError(f"{path}: profile format version {version!r}; this planner reads versions "
                         f"{', '.join(map(str, READABLE_FORMAT_VERSIONS))} (written by a newer planner?)")
    try:
        measured = raw.get("measured", {})
        if version == 1 and measured.get("memory_bound"):
            measured["memory_bound"] = _v1_memory_mix(path, measured["memory_bound"])
        if version < 3:
            for key in [k for k in measured if k.startswith("sdpa_")]:
                measured[key] = _v2_sdpa_points(path, key, measured[key])
        _check_keys(path, raw)
        profile = _profile_from(path, raw)
    except KeyError as exc:
        raise InputError(f"{path}: profile lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as exc:
        text = str(exc)
        raise InputError(text if text.startswith(str(path)) else f"{path}: not a valid profile ({text})") from None
    if problems := profile_problems(profile):
        raise InputError(f"{path}: " + "; ".join(problems))
    return profile


def profile_problems(dev: DeviceProfile) -> list[str]:  # noqa: C901 - one check per number
    """Every number the cost model divides by or adds: finite, and positive where it is a rate.
    (A zero bandwidth was a ZeroDivisionError; a negative one made plans faster.)"""
    out = []
    def need(name: str, value: float, ok: bool) -> None:
        if not (math.isfinite(value) and ok):
            out.append(f"{name} = {value!r} is out of range")
    for dtype, flops in dev.peak_flops:
        need(f"peak_flops_per_s.{dtype}", flops, flops > 0)
    need("memory_bytes", dev.memory_bytes, dev.memory_bytes > 0)
    need("memory_bandwidth_bytes_per_s", dev.memory_bandwidth_bytes_per_s, dev.memory_bandwidth_bytes_per_s > 0)
    need("threads_per_rank", dev.threads_per_rank, dev.threads_per_rank >= 0)
    for name in ("reported_memory_bytes", "num_sms", "optimizer_s_per_param", "dropout_s_per_element"):
        need(name, getattr(dev, name), getattr(dev, name) >= 0)
    for dtype, seconds in dev.grad_accumulate_s_per_param:
        need(f"grad_accumulate_s_per_param.{dtype}", seconds, seconds > 0)
    for key, seconds in dev.fsdp_sync_s_per_param:   # a difference of two timings: 0 where noise ate it
        need(f"fsdp_sync_s_per_param.{key}", seconds, seconds >= 0)
    for approximate, fwd, bwd in dev.gelu_s_per_element:
        need(f"gelu_s_per_element.{approximate}", fwd, fwd >= 0)
        need(f"gelu_s_per_element.{approximate}", bwd, bwd >= 0)
    if not isinstance(dev.name, str) or not dev.name.strip() or not dev.name.isprintable():
        out.append(f"device.name {dev.name!r} is not a name")
    if dev.kind not in ("gpu", "cpu"):
        out.append(f"device.kind = {dev.kind!r} is neither gpu nor cpu")
    for tier in (dev.intra_node, dev.inter_node, *dev.middle_tiers):
        need(f"network {tier.name} bandwidth_bytes_per_s", tier.bandwidth_bytes_per_s, tier.bandwidth_bytes_per_s > 0)
        need(f"network {tier.name} latency_s", tier.latency_s, tier.latency_s >= 0)
        need(f"network {tier.name} efficiency", tier.efficiency, 0 < tier.efficiency <= 1)
        if tier.p2p_latency_s is not None:
            need(f"network {tier.name} p2p_latency_s", tier.p2p_latency_s, tier.p2p_latency_s >= 0)
        for kind, latency, bandwidth in tier.kind_factors:
            if kind not in RING_COLLECTIVES:
                out.append(f"network {tier.name} kind_factors: {kind!r} is none of {', '.join(RING_COLLECTIVES)}")
            need(f"network {tier.name} kind_factors.{kind}.latency", latency, latency > 0)
            need(f"network {tier.name} kind_factors.{kind}.bandwidth", bandwidth, bandwidth > 0)
    for label, eff in (("efficiency", dev.efficiency), *((f"efficiency.{d}", e) for d, e in dev.dtype_efficiency)):
        for name in ("gemm", "attention", "memory", "vendor_attention_speedup", "recompute_cost"):
            need(f"{label}.{name}", getattr(eff, name), getattr(eff, name) > 0)
        for name in ("kernel_overhead_s", "reserved_memory_bytes", "allocator_fragmentation", "comm_contention",
                     "step_overhead_s"):
            need(f"{label}.{name}", getattr(eff, name), getattr(eff, name) >= 0)
        need(f"{label}.overlap", eff.overlap, 0 <= eff.overlap <= 1)
    # device-wide factors (no per-dtype table holds them): checked once
    for name in ("dp_comm", "pp_stage"):
        need(f"efficiency.{name}", getattr(dev.efficiency, name), getattr(dev.efficiency, name) > 0)
    if (host := dev.host) is not None:
        for name in ("memory_bytes", "memory_bandwidth_bytes_per_s", "link_bandwidth_bytes_per_s"):
            need(f"host.{name}", getattr(host, name), getattr(host, name) > 0)
        for name in ("memory_efficiency", "link_efficiency"):
            need(f"host.{name}", getattr(host, name), 0 < getattr(host, name) <= 1)
        if dev.kind == "cpu":
            out.append("[host] on a cpu profile: its ranks already run on the host, nothing is offloaded")
    sdpa = dict(dev.sdpa_curves)
    for key in sdpa:   # the pricing reads a forward and its backward together (compute._measured_sdpa_s)
        partner = key.removesuffix("_forward") + "_backward" if key.endswith("_forward") else \
            key.removesuffix("_backward") + "_forward"
        if not re.fullmatch(r"sdpa_\w+?(_dropout)?_(forward|backward)", key) or not sdpa[key] or not sdpa.get(partner):
            out.append(f"measured.{key} is not one of a non-empty forward and backward pair of SDPA curves")
    for name, curve in (*((f"measured.gemm_{d}", c) for d, c in dev.gemm_curves),
                        ("measured.memory_bound", dev.memory_curve)):
        if any(not (math.isfinite(x) and math.isfinite(y) and x > 0 and y > 0) for x, y in curve):
            out.append(f"{name} has a point that is not a positive size and rate")
    for key, points in dev.sdpa_curves:
        if any(not all(math.isfinite(v) and v > 0 for v in point) for point in points):
            out.append(f"measured.{key} has a point that is not a positive sequence, head dim and time")
    return out


def _profile_from(path: Path, raw: dict[str, Any]) -> DeviceProfile:
    dev, eff, net = raw["device"], raw["efficiency"], {t["scope"]: t for t in raw["network"]}
    efficiency = Efficiency(gemm=float(eff["gemm"]), attention=float(eff["attention"]),
                            memory=float(eff["memory"]), kernel_overhead_s=float(eff["kernel_overhead_s"]),
                            reserved_memory_bytes=int(eff["reserved_memory_bytes"]),
                            source=eff["source"], overlap=float(eff.get("overlap", 1.0)),
                            dp_comm=float(eff.get("dp_comm", 1.0)), pp_stage=float(eff.get("pp_stage", 1.0)),
                            allocator_fragmentation=float(eff.get("allocator_fragmentation", 0.0)),
                            comm_contention=float(eff.get("comm_contention", 0.0)),
                            vendor_attention_speedup=float(eff.get("vendor_attention_speedup", 1.0)),
                            step_overhead_s=float(eff.get("step_overhead_s", 0.0)),
                            recompute_cost=float(eff.get("recompute_cost", 1.0)))
    return DeviceProfile(
        name=dev["name"], aliases=tuple(dev.get("aliases", ())),
        peak_flops=tuple((k, float(v)) for k, v in dev["peak_flops_per_s"].items()),
        memory_bytes=int(dev["memory_bytes"]),
        reported_memory_bytes=int(dev.get("reported_memory_bytes", 0)),
        num_sms=int(dev.get("num_sms", 0)),
        memory_bandwidth_bytes_per_s=float(dev["memory_bandwidth_bytes_per_s"]),
        intra_node=_tier(net["node"], eff["intra_node_comm"]),
        inter_node=_tier(net["cluster"], eff["inter_node_comm"]),
        middle_tiers=_middle_tiers(path, raw["network"], eff["inter_node_comm"]),
        efficiency=efficiency, path=str(path), kind=dev.get("kind", "gpu"), host=_host(raw.get("host")),
        threads_per_rank=int(raw.get("measured", {}).get("threads_per_rank", dev.get("threads_per_rank", 0))),
        gemm_curves=tuple((k.removeprefix("gemm_"), _curve(v)) for k, v in raw.get("measured", {}).items()
                          if k.startswith("gemm_")),
        sdpa_curves=tuple((k, _sdpa_points(path, k, v)) for k, v in raw.get("measured", {}).items()
                          if k.startswith("sdpa_")),
        memory_curve=_curve(raw.get("measured", {}).get("memory_bound", [])),
        machine_key=str(raw.get("measured", {}).get("machine_key", "")),
        machine=str(raw.get("measured", {}).get("machine", "")),
        optimizer_s_per_param=float(raw.get("measured", {}).get("optimizer_s_per_param", 0.0)),
        dropout_s_per_element=float(raw.get("measured", {}).get("dropout_s_per_element", 0.0)),
        grad_accumulate_s_per_param=_rate_table(raw, "grad_accumulate_s_per_param", [str(d) for d in DType]),
        fsdp_sync_s_per_param=_rate_table(raw, "fsdp_sync_s_per_param",
                                          [fsdp_sync_key(k, str(d)) for k in FSDP_SYNC_KINDS for d in DType]),
        gelu_s_per_element=_gelu_rates(raw.get("measured", {}).get("gelu_s_per_element", {})),
        probe_fit_version=(int(raw["probes"].get("fit_version", 1)) if isinstance(raw.get("probes"), dict)
                           else 0),
        dtype_efficiency=tuple((k, replace(efficiency, **{f: float(v[f]) for f in DTYPE_FIELDS},
                                           **{f: float(v[f]) for f in OPTIONAL_DTYPE_FIELDS if f in v}))
                               for k, v in eff.items() if isinstance(v, dict)))


GELU_APPROXIMATIONS = ("tanh", "none")   # torch's names; costmodel.compute.GELU_OF maps MLP kinds to them


def _rate_table(raw: dict[str, Any], field: str, names: list[str]) -> tuple[tuple[str, float], ...]:
    """[measured] `field`: {name: seconds per parameter}, each name one of `names`
    (grad_accumulate_s_per_param by the new gradients' dtype, fsdp_sync_s_per_param by
    fsdp_sync_key); absent: not measured."""
    table = raw.get("measured", {}).get(field, {})
    if not isinstance(table, dict) or any(name not in names for name in table):
        raise ValueError(f"measured.{field} is not a table of {', '.join(names)}")
    return tuple((str(name), float(v)) for name, v in table.items())


def _gelu_rates(raw: Any) -> tuple[tuple[str, float, float], ...]:
    """[measured] gelu_s_per_element: {approximation: [forward, backward]} seconds per element."""
    if not isinstance(raw, dict):
        raise ValueError("measured.gelu_s_per_element is not a table of approximations")
    out = []
    for name, pair in raw.items():
        if name not in GELU_APPROXIMATIONS or not isinstance(pair, list) or len(pair) != 2:
            raise ValueError(f"measured.gelu_s_per_element.{name} is not one of {', '.join(GELU_APPROXIMATIONS)} "
                             "with [forward, backward]")
        out.append((str(name), float(pair[0]), float(pair[1])))
    return tuple(out)


def _host(raw: dict[str, Any] | None) -> HostSpec | None:
    if raw is None:
        return None
    return HostSpec(memory_bytes=int(raw["memory_bytes"]),
                    memory_bandwidth_bytes_per_s=float(raw["memory_bandwidth_bytes_per_s"]),
                    memory_efficiency=float(raw["memory_efficiency"]),
                    link_bandwidth_bytes_per_s=float(raw["link_bandwidth_bytes_per_s"]),
                    link_efficiency=float(raw["link_efficiency"]), source=str(raw["source"]))


def known_profiles() -> dict[str, DeviceProfile]:
    """Every shipped profile by name, in file-name order."""
    return {p.name: p for p in (load_profile(f) for f in sorted(profile_dir().glob("*.toml")))}


def local_profile() -> DeviceProfile:
    """This machine's measured profile from the cache; LocalProfileMissing (the command line
    then measures it) when there is none, it is unreadable, or it was measured elsewhere."""
    path = machine.local_profile_path()
    if not path.is_file():
        raise machine.LocalProfileMissing(path, "no profile of this machine yet")
    try:
        dev = load_profile(path)
    except (ValueError, OSError) as exc:
        raise machine.LocalProfileMissing(path, f"the cached profile is unreadable: {exc}") from None
    if dev.machine_key != machine.machine_key():
        raise machine.LocalProfileMissing(path, f"the cached profile was measured on {dev.machine or 'another machine'}")
    if not dev.optimizer_s_per_param:
        raise machine.LocalProfileMissing(path, "the cached profile predates the optimizer step's measurement")
    if not dev.grad_accumulate_s_per_param:
        raise machine.LocalProfileMissing(path, "the cached profile predates the gradient accumulation's measurement")
    if not dev.fsdp_sync_s_per_param:
        raise machine.LocalProfileMissing(
            path, "the cached profile predates the measurement of FSDP's one-rank reduce and gather")
    if dev.kind == "cpu" and not dev.dropout_s_per_element:   # a GPU's is 0 (runtime.profiler)
        raise machine.LocalProfileMissing(path, "the cached profile predates the dropout's measurement")
    if dev.kind == "cpu" and not dev.gelu_s_per_element:
        raise machine.LocalProfileMissing(path, "the cached profile predates GeLU's measurement")
    if dev.probe_fit_version < PROBE_FIT_VERSION:
        raise machine.LocalProfileMissing(path, "the cached profile's probes were fitted under an older cost model")
    return dev


def resolve_device(name_or_path: str) -> DeviceProfile:
    if not name_or_path.strip():
        raise InputError("the device name is empty (a name such as A100, `local`, or a .toml path)")
    if name_or_path.lower() == machine.LOCAL:
        return local_profile()
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if path.suffix != ".toml":
            raise InputError(f"device {name_or_path!r} is a path but not a .toml profile")
        return load_profile(path)
    profiles = known_profiles()
    wanted = name_or_path.lower()
    for profile in profiles.values():
        if wanted == profile.name.lower() or wanted in (a.lower() for a in profile.aliases):
            return profile
    names = ", ".join(f"{p.name} ({'/'.join(p.aliases)})" if p.aliases else p.name
                      for p in profiles.values())
    raise ValueError(f"unknown device {name_or_path!r}; known: {names}, or a path to a .toml profile")


_CLUSTER_RE = re.compile(r"^(\d+)x(\d+)x(.+)$")


def parse_cluster(text: str, group_link_bytes_per_s: float | None = None) -> ClusterSpec:
    """`NODESxDEVICES_PER_NODExDEVICE`, e.g. `8x8xA100`, `1x2xlocal` or `1x2xprofiles/xeon-amx.toml`;
    a mixed cluster is such groups joined by `+` (`4x8xA100+4x8xH100`), with the link between
    them at `group_link_bytes_per_s` per device and direction (default: the slowest group's own
    inter-node link)."""
    parts = text.split("+")
    if len(parts) > 1:
        return _parse_mixed(text, parts, group_link_bytes_per_s)
    if group_link_bytes_per_s is not None:
        raise ValueError(f"cluster {text!r} has one group: a link between groups needs a mixed cluster (A+B)")
    nodes, per_node, device = _parse_group(text, text)
    return ClusterSpec(device=resolve_device(device), num_nodes=nodes, devices_per_node=per_node)


MAX_GROUPS = 4   # the search tries every order of the groups along the pipeline (4! = 24)


def _parse_group(text: str, part: str) -> tuple[int, int, str]:
    match = _CLUSTER_RE.match(part.strip())
    if not match:
        raise ValueError(f"malformed cluster {text!r}: expected NODESxGPUS_PER_NODExDEVICE, "
                         "e.g. 8x8xA100, 1x2xpath/to/profile.toml, or groups joined by '+' (4x8xA100+4x8xH100)")
    nodes, per_node = int(match[1]), int(match[2])
    if nodes <= 0 or per_node <= 0:
        raise ValueError(f"malformed cluster {text!r}: node and device counts must be positive (group {part.strip()!r})")
    return nodes, per_node, match[3]


def _parse_mixed(text: str, parts: list[str], link_bytes_per_s: float | None) -> ClusterSpec:
    if len(parts) > MAX_GROUPS:
        raise ValueError(f"cluster {text!r}: at most {MAX_GROUPS} groups (got {len(parts)})")
    parsed = [_parse_group(text, part) for part in parts]
    if len({per_node for _, per_node, _ in parsed}) > 1:
        raise ValueError(f"cluster {text!r}: every group needs the same devices per node (got "
                         f"{', '.join(str(p) for _, p, _ in parsed)}): a pipeline stage is a whole number of nodes")
    groups = []
    for part, (nodes, _, device) in zip(parts, parsed):
        try:
            groups.append(DeviceGroup(device=resolve_device(device), num_nodes=nodes))
        except ValueError as exc:
            raise type(exc)(f"cluster {text!r}, group {part.strip()!r}: {exc}") from None
    try:
        return mixed_cluster(groups, parsed[0][1], link_bytes_per_s)
    except ValueError as exc:
        raise ValueError(f"cluster {text!r}: {exc}") from None


def mixed_cluster(groups: list[DeviceGroup], devices_per_node: int, link_bytes_per_s: float | None = None,
                  **fields: Any) -> ClusterSpec:
    """Groups joined by a link: its bandwidth `link_bytes_per_s` (per device and direction) or
    else the slowest group's inter-node tier; its latency and efficiency the slowest group's."""
    slowest = min((g.device.inter_node for g in groups), key=lambda t: t.effective_bandwidth_bytes_per_s)
    if link_bytes_per_s is not None and not (math.isfinite(link_bytes_per_s) and link_bytes_per_s > 0):
        raise ValueError(f"the link between groups needs a positive bandwidth (got {link_bytes_per_s!r})")
    link = replace(slowest, name="between groups", max_nodes=None,
                   bandwidth_bytes_per_s=link_bytes_per_s or slowest.bandwidth_bytes_per_s,
                   latency_s=max(g.device.inter_node.latency_s for g in groups))
    return ClusterSpec(device=groups[0].device, num_nodes=sum(g.num_nodes for g in groups),
                       devices_per_node=devices_per_node, groups=tuple(groups), group_link=link, **fields)


def cluster_from_dict(data: Any, where: str = "cluster") -> ClusterSpec:
    required, optional = {"num_nodes", "devices_per_node", "device"}, {"memory_headroom", "groups",
                                                                       "group_link_bytes_per_s"}
    if not isinstance(data, dict) or not required <= set(data) <= required | optional:
        raise InputError(f"{where}: expected an object with keys num_nodes, devices_per_node, device "
                         f"(and optionally memory_headroom; groups and group_link_bytes_per_s for a mixed "
                         f"cluster); got {sorted(data) if isinstance(data, dict) else data!r}")
    try:
        headroom = inputs.value(data, "memory_headroom", float, where, DEFAULT_MEMORY_HEADROOM)
        per_node = inputs.positive_field(data, "devices_per_node", where)
        if "groups" in data or "group_link_bytes_per_s" in data:
            return _mixed_from_dict(data, where, per_node, headroom)
        return ClusterSpec(device=resolve_device(inputs.value(data, "device", str, where)),
                           num_nodes=inputs.positive_field(data, "num_nodes", where),
                           devices_per_node=per_node, memory_headroom=headroom)
    except ValueError as exc:   # a profile's own errors name their file; the device's are ours
        text = str(exc)
        raise InputError(text if text.startswith(where) else f"{where}: {text}") from None


def _mixed_from_dict(data: dict, where: str, per_node: int, headroom: float) -> ClusterSpec:
    raw = data.get("groups")
    if not isinstance(raw, list) or len(raw) < 2 or "group_link_bytes_per_s" not in data:
        raise InputError(f"{where}: a mixed cluster needs groups (a list of two or more) and group_link_bytes_per_s")
    groups = []
    for i, entry in enumerate(raw):
        at = f"{where}: groups[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"num_nodes", "device"}:
            raise InputError(f"{at}: expected an object with keys num_nodes, device")
        try:
            device = resolve_device(inputs.value(entry, "device", str, at))
        except ValueError as exc:
            raise InputError(f"{at}: {exc}") from None
        groups.append(DeviceGroup(device=device, num_nodes=inputs.positive_field(entry, "num_nodes", at)))
    link = inputs.value(data, "group_link_bytes_per_s", float, where)
    cluster = mixed_cluster(groups, per_node, link, memory_headroom=headroom)
    if (cluster.num_nodes, _device_ref(cluster.device)) != (data["num_nodes"], data["device"]):
        raise InputError(f"{where}: num_nodes and device must be the groups' total and first device")
    return cluster
