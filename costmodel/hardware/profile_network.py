"""A profile's network: its [[network]] tiers (the node's, the cluster's, and those between, each
with its collectives' kind factors) and its [fabric], read from the TOML with errors that name
the file and the field (costmodel.hardware.profile_io reads the rest)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from costmodel.hardware.fabric import FabricSpec
from costmodel.hardware.profile_fields import real, text
from costmodel.hardware.records import NetworkTier
from costmodel.inputs import UserError


def read_middle_tiers(path: Path, tiers: list[dict[str, Any]], efficiency: float) -> tuple[NetworkTier, ...]:
    """The [[network]] tiers between the node and the cluster (a rack's switch, a multi-node
    NVLink domain), smallest first, each at its own efficiency or the cluster tier's."""
    out = []
    for raw in tiers:
        if raw["scope"] in ("node", "cluster"):
            continue
        if not isinstance(raw.get("max_nodes"), int) or raw["max_nodes"] < 2:
            raise UserError(f"{path}: [[network]] scope {raw['scope']!r} needs max_nodes >= 2 (the nodes it connects)")
        tier_efficiency = real(path, f"network {raw.get('name', raw['scope'])}", raw, "efficiency", efficiency)
        out.append(replace(read_tier(path, raw, tier_efficiency), max_nodes=raw["max_nodes"]))
    return tuple(sorted(out, key=lambda t: t.max_nodes))


def read_fabric(path: Path, raw: Any) -> FabricSpec:
    """[fabric]: the cluster tier's switches (costmodel.hardware.fabric); absent, the DGX
    SuperPOD's fabric (FabricSpec's defaults), which prices every tier as the [[network]]
    entries give it. Keys left out keep their defaults; `source` is required, as every number
    in a profile has one. The values' ranges are checked with the profile (profile_problems)."""
    if raw is None:
        return FabricSpec()
    if not isinstance(raw, dict):
        raise UserError(f"{path}: [fabric] is not a table")
    default = FabricSpec()
    rail, leaf = raw.get("rail_optimized", default.rail_optimized), raw.get("nodes_per_leaf", default.nodes_per_leaf)
    ratio, source = raw.get("spine_oversubscription", default.spine_oversubscription), raw.get("source")
    if not isinstance(rail, bool):
        raise UserError(f"{path}: [fabric] rail_optimized is true or false, got {rail!r}")
    if not isinstance(leaf, int) or isinstance(leaf, bool):
        raise UserError(f"{path}: [fabric] nodes_per_leaf is a whole number of nodes, got {leaf!r}")
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool):
        raise UserError(f"{path}: [fabric] spine_oversubscription is a number (2.0 for 2:1), got {ratio!r}")
    if not isinstance(source, str) or not source.strip():
        raise UserError(f"{path}: [fabric] needs a source (where its figures come from)")
    return FabricSpec(rail_optimized=rail, nodes_per_leaf=leaf, spine_oversubscription=float(ratio), source=source)


def read_tier(path: Path, raw: dict[str, Any], efficiency: float) -> NetworkTier:
    """One [[network]] table at the given efficiency (the profile's fitted one for its scope)."""
    where = f"network {raw.get('name', raw.get('scope', '?'))}"
    p2p = raw.get("p2p_latency_s")
    return NetworkTier(name=text(path, where, raw, "name"),
                       bandwidth_bytes_per_s=real(path, where, raw, "bandwidth_bytes_per_s"),
                       latency_s=real(path, where, raw, "latency_s"), efficiency=efficiency,
                       base_latency_s=real(path, where, raw, "base_latency_s", 0.0),
                       p2p_latency_s=None if p2p is None else real(path, where, raw, "p2p_latency_s"),
                       kind_factors=_kind_factors(raw),
                       forward_bytes_per_s=real(path, where, raw, "forward_bytes_per_s", 0.0),
                       post_overhead_s=real(path, where, raw, "post_overhead_s", 0.0))


def _kind_factors(raw: dict[str, Any]) -> tuple[tuple[str, float, float], ...]:
    """A [[network]] table's kind_factors: a table of {latency, bandwidth} tables, one per kind
    (the kinds and the factors' signs are checked with the profile: profile_problems)."""
    kinds = raw.get("kind_factors", {})
    where = f"[[network]] {raw.get('name', '?')} kind_factors"
    if not isinstance(kinds, dict):
        raise UserError(f"{where} is not a table of kinds")
    out = []
    for kind, pair in kinds.items():
        if not isinstance(pair, dict) or set(pair) != {"latency", "bandwidth"}:
            raise UserError(f"{where}.{kind} needs exactly latency and bandwidth, got {pair!r}")
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in pair.values()):
            raise UserError(f"{where}.{kind}: latency and bandwidth are numbers, got {pair!r}")
        out.append((kind, float(pair["latency"]), float(pair["bandwidth"])))
    return tuple(out)


def network_scope(path: Path, net: dict[str, dict[str, Any]], scope: str) -> dict[str, Any]:
    """The [[network]] table of a scope the profile must have (node, cluster)."""
    if scope not in net:
        raise UserError(f"{path}: no [[network]] table with scope = \"{scope}\"")
    return net[scope]
