"""Clusters: device profiles x nodes x devices per node, uniform or mixed, and their parsing
(`8x8xA100`, `4x8xA100+4x8xH100`, a plan file's `cluster` object)."""
from __future__ import annotations

import hashlib
import math
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from costmodel import inputs
from costmodel.frameworks import FRAMEWORKS, RUNTIME, FrameworkTraits, attention_speedup, traits_on, with_ep_overlap
from costmodel.hardware.profile_io import profile_dir, resolve_device
from costmodel.hardware.records import DEFAULT_MEMORY_HEADROOM, DeviceProfile, HostSpec, NetworkTier
from costmodel.inputs import UserError
from costmodel.selective_modules import DEFAULT_SELECTIVE_MODULES, MEGATRON_CORE, module_problems


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
            raise UserError("a cluster needs at least one node and one device per node")
        if self.groups:
            _check_groups(self)
        # a CPU's RAM share divided among this cluster's ranks per node, whichever path built it
        # (a flag, a plan file, the profiler's probes): DeviceProfile.per_node
        object.__setattr__(self, "device", self.device.per_node(self.devices_per_node))
        object.__setattr__(self, "groups", tuple(replace(g, device=g.device.per_node(self.devices_per_node))
                                                 for g in self.groups))
        inputs.check_limit("cluster", "world size", self.num_nodes * self.devices_per_node,
                           inputs.MAX_WORLD_SIZE)
        if not 0.0 <= self.memory_headroom < 1.0:
            raise UserError(f"memory headroom {self.memory_headroom} must be in [0, 1)")
        # torch's kernels differ by device kind, Transformer Engine's float8 copies by chip
        # (costmodel.frameworks.traits_on)
        object.__setattr__(self, "framework", traits_on(self.framework, self.device))
        if self.framework.iteration_graph:   # launched from a CUDA graph: no host costs
            object.__setattr__(self, "device", self.device.graphed())
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare)))

    @property
    def is_mixed(self) -> bool:
        return bool(self.groups)

    @property
    def node_note(self) -> str:
        """One line where the nodes asked for do not match the NVLink domain of their devices
        (DeviceProfile.nvlink_domain_devices): larger than any system of the device has, they are
        priced as if NVLink joined them all; smaller than a domain shared across hosts, they are
        priced as hosts joined by the network, which the domain's NVLink would join. Empty otherwise."""
        domain = self.device.nvlink_domain_devices
        if domain and self.devices_per_node > domain:
            return (f"{self.device.name}'s NVLink joins at most {domain} devices; nodes of {self.devices_per_node} "
                    f"are priced as one NVLink domain, which no {self.device.name} system has (e.g. "
                    f"{-(-self.world_size // domain)}x{domain}x{self.device.name})")
        # a node of half a domain or more is one (a rack of which a job uses 64 of 72, NVL36)
        spans_hosts = domain > (self.device.devices_per_host or domain)
        if not spans_hosts or self.num_nodes == 1 or 2 * self.devices_per_node >= domain:
            return ""
        racks = -(-self.world_size // domain)
        layout = (f"{racks}x{self.world_size // racks}x{self.device.name}" if self.world_size % racks == 0
                  else f"NODESx{domain}x{self.device.name}")
        return (f"{self.device.name}'s NVLink joins up to {domain} devices across hosts; nodes of "
                f"{self.devices_per_node} are priced as hosts joined by the network (a node here is the "
                f"NVLink domain: e.g. {layout})")

    @property
    def launch_hosts(self) -> tuple[int, int]:
        """(hosts, devices on each) a launcher starts ranks on (torchrun's --nnodes and --nproc-per-node):
        a node each, or where a node is an NVLink domain of several hosts (DeviceProfile.devices_per_host:
        a GB200 NVL72 rack's trays of 4) its hosts. A node that is not whole hosts is refused: no
        launcher starts a different number of ranks on each host; so is a mixed cluster of such nodes,
        whose launch keeps a node per host in its groups' order."""
        device = next((g.device for g in self.groups if g.device.devices_per_host), self.device)
        host = device.devices_per_host
        if not host or self.devices_per_node <= host:
            return self.num_nodes, self.devices_per_node
        if self.is_mixed:
            raise UserError(f"a mixed cluster is launched a node per host, and {device.name}'s nodes of "
                            f"{self.devices_per_node} span hosts of {host}: launch its groups apart")
        if self.devices_per_node % host:
            raise UserError(f"{self.device.name}'s hosts hold {host} devices each: nodes of {self.devices_per_node} "
                            f"are not whole hosts, so no launcher can start them (nodes of a multiple of {host})")
        return self.world_size // host, host

    def pipeline_tier(self, num_nodes: int, same_rail: bool = True) -> NetworkTier:
        """The tier a pipeline send over `num_nodes` nodes takes (`same_rail`: DeviceProfile.tier_for):
        the device's, or in a mixed cluster's group view the slower of it and the link between
        the groups (every pipeline of a mixed plan crosses that link; inner sends are priced at it
        too, a small pessimism: sends are one activation per micro-batch)."""
        own = self.device.tier_for(num_nodes, same_rail)
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

    def allocator_reserved_bytes(self, total_bytes: float, outside_bytes: float | None = None) -> float:
        """What torch's caching allocator reserves (torch.cuda.max_memory_reserved, the figure
        torchtitan and Megatron-LM log) for a stage whose predicted total is `total_bytes`:
        memory_budget_bytes's accounting read the other way, what sits outside it (`outside_bytes`:
        the stage's reserved bytes, costmodel.memory.reserved_bytes; by default the device's fixed
        reserve, the CUDA context and NCCL's buffers) taken off."""
        eff = self.device.efficiency
        outside = eff.reserved_memory_bytes if outside_bytes is None else outside_bytes
        return (total_bytes - outside) * (1.0 + eff.allocator_fragmentation)

    def host_for(self, what: str) -> HostSpec:
        """The node's host, which `what` (an offloaded thing) needs; ValueError without one."""
        if self.device.host is None:
            raise UserError(f"device {self.device.name} has no [host] for {what}")
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
        if (print_ := profile_fingerprint(self.device)) is not None:   # a measured profile may be measured again
            out[FINGERPRINT_KEY] = print_
        if self.memory_headroom != DEFAULT_MEMORY_HEADROOM:   # only off the default: readers without the key read it
            out["memory_headroom"] = self.memory_headroom
        if self.framework.name != RUNTIME.name:   # the software it is priced for, when not our runtime
            out["framework"] = self.framework.name
        if self.framework.selective_modules != DEFAULT_SELECTIVE_MODULES:   # Megatron-Core's --recompute-modules
            out["recompute_modules"] = list(self.framework.selective_modules)
        if self.framework.ep_a2a_overlap:   # Megatron-Core's --overlap-moe-expert-parallel-comm
            out["ep_overlap"] = True
        if self.groups:   # nor these, for a uniform cluster
            out["groups"] = [{"num_nodes": g.num_nodes, "device": _device_ref(g.device)} for g in self.groups]
            assert self.group_link is not None
            out["group_link_bytes_per_s"] = self.group_link.bandwidth_bytes_per_s
        return out


def run_by(cluster: ClusterSpec, traits: FrameworkTraits) -> ClusterSpec:
    """The cluster as a framework drives it: its traits, and the device as its kernels use it
    (the vendor attention the framework calls, costmodel.frameworks.attention_speedup; the
    speedup of the cluster's present framework is taken off first, so this composes)."""
    if cluster.groups:
        raise AssertionError("a mixed cluster is priced for the included runtime only")
    dev = cluster.device
    speedup = dev.efficiency.vendor_attention_speedup
    factor = attention_speedup(traits, speedup) / attention_speedup(cluster.framework, speedup)
    if factor != 1.0:
        dev = replace(dev, efficiency=replace(dev.efficiency, attention=dev.efficiency.attention * factor))
    return replace(cluster, device=dev, framework=traits)


FINGERPRINT_KEY = "device_sha256"   # a plan file's cluster: profile_fingerprint of its device


def _shipped(dev: DeviceProfile) -> bool:
    """Whether the profile is one the package ships (referred to by its name)."""
    return Path(dev.path).parent == profile_dir()


def profile_fingerprint(dev: DeviceProfile) -> str | None:
    """The SHA-256 of a profile file that is not shipped (one `planner profile` or `calibrate`
    wrote, which a later measurement replaces in place: the cached `local` one), which a plan
    stores beside its path so that a reader can tell the profile changed; None for a shipped one,
    which goes by its name."""
    if _shipped(dev) or not Path(dev.path).is_file():
        return None
    return hashlib.sha256(Path(dev.path).read_bytes()).hexdigest()


def _device_ref(dev: DeviceProfile) -> str:
    """A shipped profile by its name; any other (e.g. one `planner profile` wrote) by its absolute
    path, so that a plan written with a profile given relative to one directory loads from any."""
    return dev.name if _shipped(dev) else os.path.abspath(dev.path)


def _check_groups(cluster: ClusterSpec) -> None:
    groups = cluster.groups
    if len(groups) < 2:
        raise UserError("a mixed cluster needs at least two groups")
    if any(g.num_nodes <= 0 for g in groups):
        raise UserError("every group of a mixed cluster needs at least one node")
    if sum(g.num_nodes for g in groups) != cluster.num_nodes or groups[0].device != cluster.device:
        raise UserError("a mixed cluster's nodes and first device are its groups'")
    if len({g.device.kind for g in groups}) > 1:
        raise UserError("a mixed cluster cannot mix GPU and CPU profiles (their ranks run different backends)")
    if cluster.group_link is None:
        raise UserError("a mixed cluster needs the link between its groups")


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
        raise UserError(f"cluster {text!r} has one group: a link between groups needs a mixed cluster (A+B)")
    nodes, per_node, device = _parse_group(text, text)
    return ClusterSpec(device=resolve_device(device), num_nodes=nodes, devices_per_node=per_node)


MAX_GROUPS = 4   # the search tries every order of the groups along the pipeline (4! = 24)


_COUNT_RE = re.compile(r"^(\d+)x([^x\d].*)$")


def _parse_group(text: str, part: str) -> tuple[int, int, str]:
    match = _CLUSTER_RE.match(part.strip())
    if not match:
        raise UserError(f"malformed cluster {text!r}: expected NODESxGPUS_PER_NODExDEVICE, "
                         "e.g. 8x8xA100, 1x2xpath/to/profile.toml, or groups joined by '+' (4x8xA100+4x8xH100)"
                         + _nodes_hint(part.strip()))
    nodes, per_node = int(match[1]), int(match[2])
    if nodes <= 0 or per_node <= 0:
        raise UserError(f"malformed cluster {text!r}: node and device counts must be positive (group {part.strip()!r})")
    return nodes, per_node, match[3]


def _nodes_hint(part: str) -> str:
    """For a device count without nodes ('2048xH100'), the same devices in nodes of the device's
    NVLink domain: '; 2048 H100 are 256x8xH100'; empty where the count does not split so."""
    match = _COUNT_RE.match(part)
    if not match:
        return ""
    try:
        per_node = resolve_device(match[2]).nvlink_domain_devices
    except UserError:
        return ""
    count = int(match[1])
    if per_node <= 0 or count <= 0 or count % per_node:
        return ""
    return f"; {count} {match[2]} are {count // per_node}x{per_node}x{match[2]}"


def _parse_mixed(text: str, parts: list[str], link_bytes_per_s: float | None) -> ClusterSpec:
    if len(parts) > MAX_GROUPS:
        raise UserError(f"cluster {text!r}: at most {MAX_GROUPS} groups (got {len(parts)})")
    parsed = [_parse_group(text, part) for part in parts]
    if len({per_node for _, per_node, _ in parsed}) > 1:
        raise UserError(f"cluster {text!r}: every group needs the same devices per node (got "
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
        raise UserError(f"cluster {text!r}: {exc}") from None


def mixed_cluster(groups: list[DeviceGroup], devices_per_node: int, link_bytes_per_s: float | None = None,
                  **fields: Any) -> ClusterSpec:
    """Groups joined by a link: its bandwidth `link_bytes_per_s` (per device and direction) or
    else the slowest group's inter-node tier; its latency and efficiency the slowest group's."""
    slowest = min((g.device.inter_node for g in groups), key=lambda t: t.effective_bandwidth_bytes_per_s)
    if link_bytes_per_s is not None and not (math.isfinite(link_bytes_per_s) and link_bytes_per_s > 0):
        raise UserError(f"the link between groups needs a positive bandwidth (got {link_bytes_per_s!r})")
    link = replace(slowest, name="between groups", max_nodes=None,
                   bandwidth_bytes_per_s=link_bytes_per_s or slowest.bandwidth_bytes_per_s,
                   latency_s=max(g.device.inter_node.latency_s for g in groups))
    return ClusterSpec(device=groups[0].device, num_nodes=sum(g.num_nodes for g in groups),
                       devices_per_node=devices_per_node, groups=tuple(groups), group_link=link, **fields)


def cluster_from_dict(data: Any, where: str = "cluster") -> ClusterSpec:
    required = {"num_nodes", "devices_per_node", "device"}
    optional = {"memory_headroom", "groups", "group_link_bytes_per_s", "framework", "recompute_modules", "ep_overlap",
                FINGERPRINT_KEY}
    if not isinstance(data, dict) or not required <= set(data) <= required | optional:
        raise UserError(f"{where}: expected an object with keys num_nodes, devices_per_node, device "
                         f"(and optionally memory_headroom, framework; groups and group_link_bytes_per_s for "
                         f"a mixed cluster); got {sorted(data) if isinstance(data, dict) else data!r}")
    try:
        headroom = inputs.value(data, "memory_headroom", float, where, DEFAULT_MEMORY_HEADROOM)
        per_node = inputs.positive_field(data, "devices_per_node", where)
        if "groups" in data or "group_link_bytes_per_s" in data:
            if key := next((k for k in ("framework", "recompute_modules", "ep_overlap") if k in data), None):
                raise UserError(f"{where}: {key}: a mixed cluster is priced for the included runtime only")
            return _mixed_from_dict(data, where, per_node, headroom)
        cluster = ClusterSpec(device=resolve_device(inputs.value(data, "device", str, where)),
                              num_nodes=inputs.positive_field(data, "num_nodes", where),
                              devices_per_node=per_node, memory_headroom=headroom)
        name = inputs.value(data, "framework", str, where, RUNTIME.name)
        if name not in FRAMEWORKS:
            raise UserError(f"{where}: framework {name!r} is not one of {', '.join(sorted(FRAMEWORKS))}")
        traits = _with_ep_overlap(_with_modules(FRAMEWORKS[name], data, where), data, where)
        return cluster if name == RUNTIME.name else run_by(cluster, traits)
    except ValueError as exc:   # a profile's own errors name their file; the device's are ours
        text = str(exc)
        raise UserError(text if text.startswith(where) else f"{where}: {text}") from None


def _with_modules(traits: FrameworkTraits, data: dict, where: str) -> FrameworkTraits:
    """The framework's traits with the selective recomputation's modules the file names
    (optional key recompute_modules: Megatron-Core's --recompute-modules)."""
    if "recompute_modules" not in data:
        return traits
    names = data["recompute_modules"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise UserError(f"{where}: recompute_modules: expected a list of module names, got {names!r}")
    if problems := module_problems(tuple(names), traits.name):
        raise UserError(f"{where}: recompute_modules: {problems[0]}")
    return replace(traits, selective_modules=tuple(names))


def _with_ep_overlap(traits: FrameworkTraits, data: dict, where: str) -> FrameworkTraits:
    """The framework's traits with the expert all-to-all overlap where the file turns it on
    (optional key ep_overlap: Megatron-Core's --overlap-moe-expert-parallel-comm)."""
    if not inputs.value(data, "ep_overlap", bool, where, False):
        return traits
    if traits.name != MEGATRON_CORE:
        raise UserError(f"{where}: ep_overlap: Megatron-Core's --overlap-moe-expert-parallel-comm; "
                        f"{traits.name} has no such overlap")
    return with_ep_overlap(traits)


def _mixed_from_dict(data: dict, where: str, per_node: int, headroom: float) -> ClusterSpec:
    raw = data.get("groups")
    if not isinstance(raw, list) or len(raw) < 2 or "group_link_bytes_per_s" not in data:
        raise UserError(f"{where}: a mixed cluster needs groups (a list of two or more) and group_link_bytes_per_s")
    groups = []
    for i, entry in enumerate(raw):
        at = f"{where}: groups[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"num_nodes", "device"}:
            raise UserError(f"{at}: expected an object with keys num_nodes, device")
        try:
            device = resolve_device(inputs.value(entry, "device", str, at))
        except ValueError as exc:
            raise UserError(f"{at}: {exc}") from None
        groups.append(DeviceGroup(device=device, num_nodes=inputs.positive_field(entry, "num_nodes", at)))
    link = inputs.value(data, "group_link_bytes_per_s", float, where)
    cluster = mixed_cluster(groups, per_node, link, memory_headroom=headroom)
    if (cluster.num_nodes, _device_ref(cluster.device)) != (data["num_nodes"], data["device"]):
        raise UserError(f"{where}: num_nodes and device must be the groups' total and first device")
    return cluster
