"""Hardware records: a device profile, its network tiers, efficiencies and host.

A profile keeps datasheet numbers (`[device]`, `[[network]]`) apart from the achievable
efficiency parameters (`[efficiency]`), which are fitted or measured and say how.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from functools import lru_cache

from costmodel.hardware.fabric import Fabric, FabricSpec
from costmodel.inputs import UserError
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
    latency_s: float   # one ring step's latency (costmodel.comm)
    efficiency: float  # achievable fraction of bandwidth_bytes_per_s for large collectives
    base_latency_s: float = 0.0  # a collective's fixed cost, once per call (NCCL's base latency)
    p2p_latency_s: float | None = None  # measured point-to-point latency when it differs (gloo)
    # a tier between the node and the whole cluster (a rack's switch, a multi-node NVLink domain)
    # connects blocks of this many consecutive nodes; None for the node and cluster tiers
    max_nodes: int | None = None
    # (collective kind, latency factor, bandwidth factor): a kind's own microbenchmark fit over
    # the tier's joint one (costmodel.comm.kind_factors), where the backend runs the kinds
    # differently (gloo's reduce-scatter); empty (every kind at the tier's) for a datasheet tier
    kind_factors: tuple[tuple[str, float, float], ...] = ()
    # the node tier's: what a per-node expert dispatcher (DeepEP, Hybrid-EP) delivers to each GPU
    # over it a second while its network leg runs, its own copies included (as the dispatcher's
    # benchmarks count them; costmodel.moe_dispatch); 0: not published, priced as the tier's all-to-all
    forward_bytes_per_s: float = 0.0
    # the scale-out tier's: what posting a step to the network costs the host-driven proxy (NCCL's
    # getNetOverhead, x3 under its Simple protocol: 3 us on Intel and Arm hosts, 6 us on AMD), the
    # least each in-node step of a ring that crosses nodes costs (costmodel.comm); 0: none
    post_overhead_s: float = 0.0

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

    gemm: float               # long-K GEMM fraction of dense peak FLOP/s (kernels.gemm.tile_efficiency below it)
    attention: float          # fused (flash) attention fraction of dense peak FLOP/s
    memory: float             # fraction of HBM bandwidth reached by memory-bound kernels
    kernel_overhead_s: float  # fixed cost per kernel: launch, and on CPUs eager dispatch (wave tails: costmodel.kernels.gemm.tile_efficiency)
    reserved_memory_bytes: int  # outside PyTorch's allocator: CUDA context, NCCL buffers, workspaces
    source: str
    overlap: float = 1.0      # fraction of compute that data-parallel communication can hide behind
    # data-parallel terms' (FSDP's bucketed reduce-scatters and gathers, and what rides on them:
    # contention, offload copies) speed over the links' fitted efficiency and latency, which TP's
    # and CP's many activation-sized collectives share: 1 where one efficiency serves all. A CPU
    # profile's probes fit it (planner.measure.calibrate.CPU_COMM_PARAMS; costmodel.rank_time.dp_term_comm_s).
    dp_comm: float = 1.0
    # a pipeline stage's work (its layers, embedding and head, with their collectives) over
    # its price when pp > 1: on a CPU a pipelined plan's stages run their work further over its
    # price than a one-rank plan of the same run does (benchmarks/closed_loop.py shows both).
    # `planner calibrate` fits it on a CPU's runs when some have a pipeline
    # (planner.measure.calibrate.CPU_COMM_PARAMS; costmodel.rank_time.rank_time_model); 1 in datasheets
    # and measured profiles (planner.measure.probes.fit_probes).
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
    # the attention kernel's backward rate over its forward's (published per chip, not fitted): the
    # backward's extra non-matmul work (dS, dQ's accumulation, on Blackwell shared-memory traffic) runs
    # its five products slower than the forward's two; `attention` (and its vendor speedup) is the forward's
    attention_backward_ratio: float = 1.0
    # host work once per training step outside the layers' kernels and the optimizer's (the
    # runtime's barrier, the loss's reduction, the batch, zero_grad): fitted by a measured
    # profile's probes, whose small steps show it (planner.measure.probes.compute_params); 0 in datasheets
    step_overhead_s: float = 0.0
    # what recomputing a layer costs, as a share of its priced forward: 1 where a recomputed
    # forward runs the forward's kernels again (a GPU; Korthikanti et al. 2022 price full
    # recomputation as one more forward). On a CPU it costs less, most likely because a layer
    # recomputed inside the backward pass leaves its activations in cache for the backward that
    # reads them at once, where a training forward writes fresh pages. `calibrate` fits it
    # from runs that recompute; `planner profile` does not measure it: within its time budget
    # the measurement's spread is wider than the effect.
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


# the efficiency parameters a published-runs fit sets (planner.measure.fit) and that a
# profile's [ranges] bound with published measurements
FITTED_PARAMS = ("gemm", "attention", "memory", "kernel_overhead_s", "intra_node_comm", "inter_node_comm",
                 "comm_contention", "vendor_attention_speedup", "step_overhead_s")


@dataclass(frozen=True, kw_only=True, slots=True)
class ParameterRange:
    """What published measurements allow a fitted efficiency: [low, high], and where from."""

    low: float
    high: float
    source: str


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
    # how the cluster tier's switches connect the nodes ([fabric]; costmodel.hardware.fabric)
    fabric: FabricSpec = FabricSpec()
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
    # the best bf16 matmul any shape reaches, a fraction of dense peak (the MAMF table): a chip that
    # borrows another's fitted GEMM fraction keeps the lender's share of it (planner.measure.fit
    # gemm_scale); 0: not published
    best_matmul_fraction: float = 0.0
    num_sms: int = 0   # streaming multiprocessors (GEMM wave quantisation); 0: not modelled
    # each output tile's fixed prologue (pipeline fill) and epilogue (store) in elements of the
    # reduction: a GEMM over K runs at K / (K + this) of its long-K rate; 0: not modelled
    gemm_tile_setup_k: int = 0
    # edge of the square output tile one SM computes at a time in the large GEMM kernels (wave
    # quantisation counts these tiles over num_sms)
    gemm_tile: int = 128
    # a CPU's: the ranks memory_bytes is one share of (its RAM divided among the ranks measured
    # together); a cluster of another count per node divides the RAM among its own (per_node)
    memory_ranks: int = 0
    # tensor-parallel collectives overlapped with their GEMMs run on this device: Transformer
    # Engine's userbuffers as its vendor ships them, torch's async TP on symmetric memory (SM90
    # and later); a framework overlaps them where its traits say so (costmodel.frameworks
    # `tp_comm_overlap`), and the Megatron export asks for --tp-comm-overlap where this is set
    tp_comm_gemm_overlap: bool = False
    # the float8 GEMMs take either operand transposed (compute capability 10.x, Blackwell's datacenter
    # parts: Transformer Engine's is_non_tn_fp8_gemm_supported), so a float8 tensor read both ways keeps
    # one copy; Hopper's take the TN layout only, and Transformer Engine keeps a transposed copy beside
    # each such tensor (costmodel.frameworks `float8_transposed_copy`)
    float8_gemm_any_layout: bool = False
    # devices one NVLink domain joins, where it spans several hosts (GB200 NVL72: 72 over 18 trays of
    # 4); a node of the cluster is then the domain, and a smaller one prices hosts joined by the network
    # (ClusterSpec.node_note); 0: the node's own devices
    nvlink_domain_devices: int = 0
    # devices one host (its OS, one torchrun) holds where a node of the cluster is an NVLink domain of
    # several hosts (GB200 NVL72: a compute tray of 4); a launcher starts ranks per host
    # (ClusterSpec.launch_hosts); 0: the node is one host
    devices_per_host: int = 0
    # the node's host, where offloaded states live; None: nothing can be offloaded (a CPU
    # profile's ranks already run on the host)
    host: HostSpec | None = None
    # `planner profile`: an AdamW step as the runtime takes one, seconds per parameter (0: not
    # measured; the step is then priced as memory-bound traffic)
    optimizer_s_per_param: float = 0.0
    # `planner profile`: one micro-batch's gradients added in place into fp32 gradients, seconds
    # per parameter, by the dtype the new ones come in (empty: not measured; the add is then
    # priced as memory-bound traffic, costmodel.kernels.gradient_add_s)
    grad_accumulate_s_per_param: tuple[tuple[str, float], ...] = ()
    # `planner profile`: FSDP2's reduce and gather on a one-rank group, seconds per parameter, by
    # "reduce.<compute dtype>" and "gather.<compute dtype>" (empty: not measured; then priced as
    # their copies' traffic, costmodel.kernels.fsdp_sync_s)
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
    # (costmodel.kernels.sdpa_head_s); empty: attention is priced from the GEMM curve
    sdpa_curves: tuple[tuple[str, tuple[tuple[float, float, float], ...]], ...] = ()
    # the cost model the profile's probes were fitted under (PROBE_FIT_VERSION; 0: no probes)
    probe_fit_version: int = 0
    # step-time MAPE (a fraction) of its probe training steps, predicted after the fit against
    # measured ([probes] steps): how well this profile prices training here (0: no probes)
    probe_error: float = 0.0
    # [ranges]: per FITTED_PARAMS name, the published range its fitted value must lie inside
    ranges: tuple[tuple[str, ParameterRange], ...] = ()
    # the tiers and fabric as a switch graph, rebuilt with every copy (dataclasses.replace
    # runs __post_init__) so that it always answers for this record's tiers
    _fabric: Fabric | None = field(default=None, init=False, repr=False, compare=False)
    # the kernel and collective caches key on the profile (tens of thousands of lookups per
    # search): hashing its nested curves each time cost more than the lookup, so it is taken once
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        return self._hash

    def with_efficiency(self, **changes: float) -> "DeviceProfile":
        """This profile with `changes` made to its efficiency and to every dtype's own."""
        return replace(self, efficiency=replace(self.efficiency, **changes),
                       dtype_efficiency=tuple((d, replace(e, **changes)) for d, e in self.dtype_efficiency))

    def graphed(self) -> "DeviceProfile":
        """The device as a whole-iteration CUDA graph drives it (frameworks `iteration_graph`): no
        host cost per kernel (kernel_overhead_s) nor per step (step_overhead_s)."""
        return self.with_efficiency(kernel_overhead_s=0.0, step_overhead_s=0.0)

    def fitted_value(self, name: str) -> float:
        """A FITTED_PARAMS value as the profile holds it (the links' efficiencies on their tiers)."""
        if name == "intra_node_comm":
            return self.intra_node.efficiency
        if name == "inter_node_comm":
            return self.inter_node.efficiency
        return float(getattr(self.efficiency, name))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_fabric", Fabric(node=self.intra_node, middle=self.middle_tiers,
                                                   cluster=self.inter_node, spec=self.fabric))
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare)))

    @property
    def die(self) -> str:
        """The die a profile's name starts with (H100-SXM5-80GB: H100), what the fit groups by."""
        return self.name.split("-")[0]

    @property
    def usable_memory_bytes(self) -> int:
        return self.reported_memory_bytes or self.memory_bytes

    def per_node(self, devices_per_node: int) -> DeviceProfile:
        """This device as one of `devices_per_node` on a node: a CPU's share of the node's RAM
        (memory_ranks) is that RAM divided among them; another device is itself."""
        if not self.memory_ranks or devices_per_node == self.memory_ranks:
            return self
        return replace(self, memory_bytes=self.memory_bytes * self.memory_ranks // devices_per_node,
                       memory_ranks=devices_per_node)

    def tier_for(self, num_nodes: int, same_rail: bool = True) -> NetworkTier:
        """The slowest tier a group spread over `num_nodes` nodes crosses (its nodes taken as
        consecutive, as the row-major placement lays them out), read off the fabric's graph
        (costmodel.hardware.fabric): the node's own links for one node, the innermost middle tier
        that spans them, else a leaf switch or the spine. `same_rail`: its members on different
        nodes sit at the same local rank, as the placement puts a data-parallel or pipeline
        group's when the inner axes fill the node (costmodel.placement.AxisSpan.same_rail)."""
        assert self._fabric is not None
        return self._fabric.tier(num_nodes, same_rail)

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
            has = " or ".join(d for d, p in self.peak_flops_per_s.items() if p > 0)
            raise UserError(f"device {self.name} has no {dtype} support in its profile (--dtype {has})")
        return peak


@lru_cache(maxsize=64)
def _for_dtype(dev: DeviceProfile, dtype: str) -> DeviceProfile:
    own = dict(dev.dtype_efficiency).get(dtype)
    return dev if own is None else replace(dev, efficiency=own, dtype_efficiency=())


FSDP_SYNC_KINDS = ("reduce", "gather")


def fsdp_sync_key(kind: str, dtype: str) -> str:
    """How [measured] fsdp_sync_s_per_param names a rate: <reduce|gather>.<compute dtype>."""
    return f"{kind}.{dtype}"


def sdpa_key(dtype: str, dropout: bool, backward: bool) -> str:
    """How [measured] names an SDPA curve: sdpa_<dtype>[_dropout]_<forward|backward>."""
    return f"sdpa_{dtype}{'_dropout' if dropout else ''}_{'backward' if backward else 'forward'}"


GELU_APPROXIMATIONS = ("tanh", "none")   # torch's names; costmodel.kernels.GELU_OF maps MLP kinds to them
