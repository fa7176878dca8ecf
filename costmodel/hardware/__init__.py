"""Hardware as data: device profiles (TOML files) x nodes x devices per node.

`records` holds the frozen records, `profile_io` reads profiles, `profile_check` checks their
numbers, `clusters` parses clusters and holds `ClusterSpec`, `fabric` derives the network tiers a
group of nodes crosses from the cluster's switch graph.
"""
from costmodel.hardware.clusters import (
    MAX_GROUPS,
    ClusterSpec,
    DeviceGroup,
    cluster_from_dict,
    mixed_cluster,
    parse_cluster,
    run_by,
)
from costmodel.hardware.fabric import Fabric, FabricSpec, fabric_graph
from costmodel.hardware.profile_check import profile_problems, range_problems
from costmodel.hardware.profile_io import (
    PROBE_FIT_VERSION,
    PROFILE_FORMAT_VERSION,
    PROFILE_KEYS,
    float8_devices,
    known_profiles,
    load_profile,
    local_profile,
    parse_profile,
    profile_dir,
    resolve_device,
)
from costmodel.hardware.records import (
    DEFAULT_MEMORY_HEADROOM,
    DTYPE_FIELDS,
    FITTED_PARAMS,
    FSDP_SYNC_KINDS,
    GELU_APPROXIMATIONS,
    OPTIONAL_DTYPE_FIELDS,
    RING_COLLECTIVES,
    DeviceProfile,
    Efficiency,
    HostSpec,
    NetworkTier,
    ParameterRange,
    fsdp_sync_key,
    sdpa_key,
)

__all__ = [
    "DEFAULT_MEMORY_HEADROOM", "DTYPE_FIELDS", "FITTED_PARAMS", "FSDP_SYNC_KINDS", "GELU_APPROXIMATIONS", "MAX_GROUPS",
    "OPTIONAL_DTYPE_FIELDS", "PROBE_FIT_VERSION", "PROFILE_FORMAT_VERSION", "PROFILE_KEYS", "RING_COLLECTIVES",
    "ClusterSpec", "DeviceGroup", "DeviceProfile", "Efficiency", "Fabric", "FabricSpec", "HostSpec", "NetworkTier", "ParameterRange",
    "cluster_from_dict", "fabric_graph", "fsdp_sync_key", "known_profiles", "load_profile", "local_profile",
    "float8_devices", "mixed_cluster", "parse_cluster", "parse_profile", "profile_dir", "profile_problems", "range_problems", "resolve_device", "run_by", "sdpa_key"]
