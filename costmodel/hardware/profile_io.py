"""Reading profiles: the one strict reader of `profiles/*.toml` and of `planner profile`'s
files, the shipped profiles by name, and this machine's cached one."""
from __future__ import annotations

import math
import statistics
import tomllib
from dataclasses import replace
from functools import lru_cache, partial
from importlib import resources
from pathlib import Path
from typing import Any

from costmodel import inputs, machine
from costmodel.hardware.profile_check import profile_problems
from costmodel.hardware.profile_fields import flag, names, peaks, real, text, whole
from costmodel.hardware.profile_network import network_scope, read_fabric, read_middle_tiers, read_tier
from costmodel.hardware.records import (
    DTYPE_FIELDS,
    FITTED_PARAMS,
    FSDP_SYNC_KINDS,
    GELU_APPROXIMATIONS,
    OPTIONAL_DTYPE_FIELDS,
    DeviceProfile,
    Efficiency,
    HostSpec,
    ParameterRange,
    fsdp_sync_key,
)
from costmodel.inputs import UserError
from costmodel.specs import DType


def profile_dir() -> Path:
    """Where the shipped profiles live (part of the installed package: nothing writes there)."""
    return Path(str(resources.files("profiles")))


def _measured_points(path: Path, key: str, points: Any, width: int, what: str) -> list[list[float]]:
    """[measured] `key` as a list of points of `width` positive finite numbers, else one error
    naming the file, the key and the point."""
    if not isinstance(points, list):
        raise UserError(f"{path}: [measured] {key} is not a list of [{what}] points")
    for i, point in enumerate(points):
        if not (isinstance(point, list) and len(point) == width
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                        for v in point)):
            raise UserError(f"{path}: [measured] {key} point {i} ({point!r}) is not [{what}] of positive "
                             "numbers; measure the machine again with `planner profile`")
    return [[float(v) for v in point] for point in points]


def _sdpa_points(path: Path, key: str, points: Any) -> tuple[tuple[float, float, float], ...]:
    """[measured] sdpa_*: (sequence, head dim, seconds per head), sorted."""
    checked = _measured_points(path, key, points, 3, "sequence, head dim, seconds per head")
    return tuple(sorted((s, d, t) for s, d, t in checked))


def _curve(path: Path, key: str, points: Any) -> tuple[tuple[float, float], ...]:
    """Sorted by size, one rate per size: several GEMM shapes share a FLOP count (tokens x hidden
    x n in different orders) and the cost model knows the count only, so their median stands for
    it (interpolation among duplicates would otherwise land on whichever sorted first)."""
    by_size: dict[float, list[float]] = {}
    for x, y in _measured_points(path, key, points, 2, "size, rate"):
        by_size.setdefault(float(x), []).append(float(y))
    return tuple((x, statistics.median(ys)) for x, ys in sorted(by_size.items()))


# written by `planner profile` / `calibrate`, and the only one read; a hand-written datasheet
# profile may leave it out
PROFILE_FORMAT_VERSION = 3
# The cost model a profile's probe fit belongs to, raised whenever the model prices the probes'
# kernels differently: a cached `local` profile fitted under an older one is measured again
# instead of carrying factors fitted to other formulas or bounds.
PROBE_FIT_VERSION = 17


# What a profile may hold, per table; anything else is refused (a misspelt key would otherwise
# leave its default in force without a word).
PROFILE_KEYS = {
    "": {"format_version", "device", "network", "fabric", "efficiency", "measured", "probes", "host", "ranges"},
    "fabric": {"rail_optimized", "nodes_per_leaf", "spine_oversubscription", "source"},
    "host": {"memory_bytes", "memory_bandwidth_bytes_per_s", "memory_efficiency", "link_bandwidth_bytes_per_s",
             "link_efficiency", "source"},
    "device": {"name", "kind", "aliases", "peak_flops_per_s", "memory_bytes", "reported_memory_bytes", "memory_ranks",
               "num_sms", "gemm_tile_setup_k", "gemm_tile", "best_matmul_fraction",
               "memory_bandwidth_bytes_per_s", "threads_per_rank", "tp_comm_gemm_overlap", "nvlink_domain_devices",
               "devices_per_host", "float8_gemm_any_layout"},
    "network": {"scope", "name", "bandwidth_bytes_per_s", "latency_s", "base_latency_s", "p2p_latency_s", "max_nodes", "efficiency",
                "kind_factors", "forward_bytes_per_s", "post_overhead_s"},
    "efficiency": {"gemm", "attention", "memory", "kernel_overhead_s", "intra_node_comm", "inter_node_comm",
                   "reserved_memory_bytes", "source", "overlap", "dp_comm", "pp_stage", "allocator_fragmentation",
                   "comm_contention", "vendor_attention_speedup", "attention_backward_ratio", "step_overhead_s",
                   "recompute_cost"},
}


def _check_keys(path: Path, raw: dict[str, Any]) -> None:
    tables = [("", raw), ("device", raw.get("device", {})), ("efficiency", raw.get("efficiency", {})),
              ("host", raw.get("host", {}))]
    if isinstance(raw.get("fabric"), dict):   # anything else is refused by _fabric
        tables.append(("fabric", raw["fabric"]))
    tables += [("network", t) for t in raw.get("network", [])]
    for name, table in tables:
        extra = sorted(k for k, v in table.items() if k not in PROFILE_KEYS[name]
                       and not (name == "efficiency" and isinstance(v, dict)))
        if extra:
            where = f"[{name}]" if name else "the top level"
            raise UserError(f"{path}: unknown key(s) {', '.join(extra)} in {where}")
    allowed = set(DTYPE_FIELDS) | set(OPTIONAL_DTYPE_FIELDS)
    for dtype, table in raw.get("efficiency", {}).items():
        if isinstance(table, dict) and set(table) - allowed:
            raise UserError(f"{path}: unknown key(s) {', '.join(sorted(set(table) - allowed))} "
                             f"in [efficiency.{dtype}]")


def load_profile(path: Path) -> DeviceProfile:
    return parse_profile(inputs.read_text(path, "profile"), path)


@lru_cache(maxsize=64)
def parse_profile(text: str, path: Path) -> DeviceProfile:
    """A profile's text, checked as `load_profile` checks a file (`path` names it in errors);
    the writer checks what it is about to write with it, so no profile is written unreadable.
    Cached by text and path (a DeviceProfile is immutable): resolving a device name reads every
    shipped profile, and a search or a validation resolves hundreds; a file read again with other
    text is parsed again, a refused one is never cached."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{path}: not a valid profile (truncated? {exc})") from None
    version = raw.get("format_version", PROFILE_FORMAT_VERSION)
    if version != PROFILE_FORMAT_VERSION:
        raise UserError(f"{path}: profile format version {version!r}; this planner reads version "
                         f"{PROFILE_FORMAT_VERSION} (measure the machine again with `planner profile`)")
    try:
        _check_keys(path, raw)
        profile = _profile_from(path, raw)
    except KeyError as exc:
        raise UserError(f"{path}: profile lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as exc:
        text = str(exc)
        raise UserError(text if text.startswith(str(path)) else f"{path}: not a valid profile ({text})") from None
    if problems := profile_problems(profile):
        raise UserError(f"{path}: " + "; ".join(problems))
    return profile


def _profile_from(path: Path, raw: dict[str, Any]) -> DeviceProfile:
    dev, eff = raw["device"], raw["efficiency"]
    if not isinstance(raw["network"], list) or not all(isinstance(t, dict) for t in raw["network"]):
        raise UserError(f"{path}: network is a list of [[network]] tables")
    net = {text(path, "network", t, "scope"): t for t in raw["network"]}
    num = partial(real, path, "efficiency", eff)
    efficiency = Efficiency(gemm=num("gemm"), attention=num("attention"), memory=num("memory"),
                            kernel_overhead_s=num("kernel_overhead_s"),
                            reserved_memory_bytes=whole(path, "efficiency", eff, "reserved_memory_bytes"),
                            source=text(path, "efficiency", eff, "source"), overlap=num("overlap", 1.0),
                            dp_comm=num("dp_comm", 1.0), pp_stage=num("pp_stage", 1.0),
                            allocator_fragmentation=num("allocator_fragmentation", 0.0),
                            comm_contention=num("comm_contention", 0.0),
                            vendor_attention_speedup=num("vendor_attention_speedup", 1.0),
                            attention_backward_ratio=num("attention_backward_ratio", 1.0),
                            step_overhead_s=num("step_overhead_s", 0.0), recompute_cost=num("recompute_cost", 1.0))
    intra, inter = num("intra_node_comm"), num("inter_node_comm")
    return DeviceProfile(
        name=text(path, "device", dev, "name"), aliases=names(path, "device", dev, "aliases"),
        peak_flops=peaks(path, dev),
        memory_bytes=whole(path, "device", dev, "memory_bytes"),
        reported_memory_bytes=whole(path, "device", dev, "reported_memory_bytes", 0),
        memory_ranks=whole(path, "device", dev, "memory_ranks", 0),
        num_sms=whole(path, "device", dev, "num_sms", 0),
        best_matmul_fraction=real(path, "device", dev, "best_matmul_fraction", 0.0),
        gemm_tile_setup_k=whole(path, "device", dev, "gemm_tile_setup_k", 0),
        gemm_tile=whole(path, "device", dev, "gemm_tile", 128),
        tp_comm_gemm_overlap=flag(path, "device", dev, "tp_comm_gemm_overlap"),
        float8_gemm_any_layout=flag(path, "device", dev, "float8_gemm_any_layout"),
        nvlink_domain_devices=whole(path, "device", dev, "nvlink_domain_devices", 0),
        devices_per_host=whole(path, "device", dev, "devices_per_host", 0),
        memory_bandwidth_bytes_per_s=real(path, "device", dev, "memory_bandwidth_bytes_per_s"),
        intra_node=read_tier(path, network_scope(path, net, "node"), intra),
        inter_node=read_tier(path, network_scope(path, net, "cluster"), inter),
        middle_tiers=read_middle_tiers(path, raw["network"], inter),
        fabric=read_fabric(path, raw.get("fabric")),
        efficiency=efficiency, path=str(path), kind=text(path, "device", dev, "kind", "gpu"), host=_host(path, raw.get("host")),
        threads_per_rank=whole(path, "measured", raw.get("measured", {}), "threads_per_rank",
                                whole(path, "device", dev, "threads_per_rank", 0)),
        gemm_curves=tuple((k.removeprefix("gemm_"), _curve(path, k, v)) for k, v in raw.get("measured", {}).items()
                          if k.startswith("gemm_")),
        sdpa_curves=tuple((k, _sdpa_points(path, k, v)) for k, v in raw.get("measured", {}).items()
                          if k.startswith("sdpa_")),
        memory_curve=_curve(path, "memory_bound", raw.get("measured", {}).get("memory_bound", [])),
        machine_key=str(raw.get("measured", {}).get("machine_key", "")),
        machine=str(raw.get("measured", {}).get("machine", "")),
        optimizer_s_per_param=float(raw.get("measured", {}).get("optimizer_s_per_param", 0.0)),
        dropout_s_per_element=float(raw.get("measured", {}).get("dropout_s_per_element", 0.0)),
        grad_accumulate_s_per_param=_rate_table(raw, "grad_accumulate_s_per_param", [str(d) for d in DType]),
        fsdp_sync_s_per_param=_rate_table(raw, "fsdp_sync_s_per_param",
                                          [fsdp_sync_key(k, str(d)) for k in FSDP_SYNC_KINDS for d in DType]),
        gelu_s_per_element=_gelu_rates(raw.get("measured", {}).get("gelu_s_per_element", {})),
        probe_fit_version=(whole(path, "probes", raw["probes"], "fit_version", 1)
                           if isinstance(raw.get("probes"), dict) else 0),
        probe_error=_probe_error(path, raw.get("probes")),
        ranges=_ranges(path, raw.get("ranges", {})),
        dtype_efficiency=tuple((k, replace(efficiency, **{f: real(path, f"efficiency.{k}", v, f) for f in DTYPE_FIELDS},
                                           **{f: real(path, f"efficiency.{k}", v, f)
                                              for f in OPTIONAL_DTYPE_FIELDS if f in v}))
                               for k, v in eff.items() if isinstance(v, dict)))


def _probe_error(path: Path, probes: Any) -> float:
    """Mean |predicted / measured - 1| of the [probes] steps (0 without any)."""
    steps = probes.get("steps", []) if isinstance(probes, dict) else []
    if not isinstance(steps, list) or not all(isinstance(s, dict) for s in steps):
        raise UserError(f"{path}: probes.steps is not a list of tables")
    pairs = [(s.get("predicted_s"), s.get("measured_s")) for s in steps]
    if any(not (_positive(p) and _positive(m)) for p, m in pairs):
        raise UserError(f"{path}: probes.steps: each needs predicted_s and measured_s, positive numbers")
    return sum(abs(p / m - 1) for p, m in pairs) / len(pairs) if pairs else 0.0


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _ranges(path: Path, raw: Any) -> tuple[tuple[str, ParameterRange], ...]:
    """[ranges]: name = { low, high, source } per fitted efficiency (FITTED_PARAMS)."""
    if not isinstance(raw, dict):
        raise UserError(f"{path}: [ranges] is not a table")
    out = []
    for name, entry in raw.items():
        where = f"{path}: ranges.{name}"
        if name not in FITTED_PARAMS:
            raise UserError(f"{where}: not a fitted efficiency ({', '.join(FITTED_PARAMS)})")
        if not isinstance(entry, dict) or set(entry) != {"low", "high", "source"}:
            raise UserError(f"{where}: expected {{ low = L, high = H, source = \"...\" }}")
        low, high = inputs.value(entry, "low", float, where), inputs.value(entry, "high", float, where)
        source = inputs.value(entry, "source", str, where)
        if not (math.isfinite(low) and math.isfinite(high) and 0 <= low <= high) or not source.strip():
            raise UserError(f"{where}: needs 0 <= low <= high and a source, got {low!r}, {high!r}")
        out.append((name, ParameterRange(low=low, high=high, source=source)))
    return tuple(out)


def _rate_table(raw: dict[str, Any], field: str, names: list[str]) -> tuple[tuple[str, float], ...]:
    """[measured] `field`: {name: seconds per parameter}, each name one of `names`
    (grad_accumulate_s_per_param by the new gradients' dtype, fsdp_sync_s_per_param by
    fsdp_sync_key); absent: not measured."""
    table = raw.get("measured", {}).get(field, {})
    if not isinstance(table, dict) or any(name not in names for name in table):
        raise UserError(f"measured.{field} is not a table of {', '.join(names)}")
    return tuple((str(name), float(v)) for name, v in table.items())


def _gelu_rates(raw: Any) -> tuple[tuple[str, float, float], ...]:
    """[measured] gelu_s_per_element: {approximation: [forward, backward]} seconds per element."""
    if not isinstance(raw, dict):
        raise UserError("measured.gelu_s_per_element is not a table of approximations")
    out = []
    for name, pair in raw.items():
        if name not in GELU_APPROXIMATIONS or not isinstance(pair, list) or len(pair) != 2:
            raise UserError(f"measured.gelu_s_per_element.{name} is not one of {', '.join(GELU_APPROXIMATIONS)} "
                             "with [forward, backward]")
        out.append((str(name), float(pair[0]), float(pair[1])))
    return tuple(out)


def _host(path: Path, raw: dict[str, Any] | None) -> HostSpec | None:
    if raw is None:
        return None
    num = partial(real, path, "host", raw)
    return HostSpec(memory_bytes=whole(path, "host", raw, "memory_bytes"),
                    memory_bandwidth_bytes_per_s=num("memory_bandwidth_bytes_per_s"),
                    memory_efficiency=num("memory_efficiency"),
                    link_bandwidth_bytes_per_s=num("link_bandwidth_bytes_per_s"),
                    link_efficiency=num("link_efficiency"), source=text(path, "host", raw, "source"))


def known_profiles() -> dict[str, DeviceProfile]:
    """Every shipped profile by name, in file-name order."""
    return {p.name: p for p in (load_profile(f) for f in sorted(profile_dir().glob("*.toml")))}


def float8_devices() -> str:
    """The shipped GPUs with float8 tensor cores (an fp8 peak in their profile), by die, slowest first:
    "H100, H200, H800, B200, ..."."""
    peaks: dict[str, float] = {}
    for p in known_profiles().values():
        if p.kind == "gpu" and p.peak_flops_per_s.get("fp8", 0) > 0:
            peaks[p.die] = max(peaks.get(p.die, 0.0), p.peak_flops_per_s["bf16"])
    return ", ".join(sorted(peaks, key=lambda die: (peaks[die], die)))


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
        raise UserError("the device name is empty (a name such as A100, `local`, or a .toml path)")
    if name_or_path.lower() == machine.LOCAL:
        return local_profile()
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.exists():
        if path.suffix != ".toml":
            raise UserError(f"device {name_or_path!r} is a path but not a .toml profile")
        return load_profile(path)
    profiles = known_profiles()
    wanted = name_or_path.lower()
    for profile in profiles.values():
        if wanted == profile.name.lower() or wanted in (a.lower() for a in profile.aliases):
            return profile
    names = ", ".join(f"{p.name} ({'/'.join(p.aliases)})" if p.aliases else p.name
                      for p in profiles.values())
    raise UserError(f"unknown device {name_or_path!r}; known: {names}, or a path to a .toml profile")
