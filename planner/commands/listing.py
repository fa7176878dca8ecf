"""`planner models` and `planner devices`: what is known."""
from __future__ import annotations

import argparse

from costmodel.hardware import known_profiles
from costmodel.params import active_params, total_params
from costmodel.registry import ALIASES, MODELS, model_names
from costmodel.units import GIB
from planner.commands.common import emit_json


def cmd_models(args: argparse.Namespace) -> int:
    rows = []
    for name in model_names():
        m = MODELS[name]
        rows.append({"name": name, "aliases": sorted(a for a, target in ALIASES.items() if target == name),
                     "params": total_params(m), "active_params": active_params(m),
                     "experts": f"{m.experts_per_token}/{m.num_experts}" if m.is_moe else "",
                     "layers": m.num_layers,
                     "hidden": m.hidden_size, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
                     "ffn": m.ffn_hidden_size, "vocab": m.vocab_size, "arch": str(m.arch),
                     "source": m.source})
    if args.json:
        emit_json({"models": rows})
        return 0
    from reports.tables import table
    print(table(("model", "params", "active", "experts", "layers", "hidden", "heads/kv", "ffn", "vocab", "source"),
                [(r["name"], _count(r["params"]), _count(r["active_params"]), r["experts"],
                  r["layers"], r["hidden"], f"{r['heads']}/{r['kv_heads']}", r["ffn"], r["vocab"], r["source"])
                 for r in rows]))
    print("\nmixtures of experts (experts: per token / in all): expert parallelism --ep N folded over the "
          "tp x cp x dp ranks (up to all of a pipeline stage's) by the included runtime and --framework megatron, "
          "carved from dp by torchtitan and deepspeed; --etp splits each expert (megatron)")
    print("\naliases: " + ", ".join(f"{a} -> {t}" for a, t in sorted(ALIASES.items()))
          + "; or --model path/to/config.json")
    return 0


def _count(params: int) -> str:
    """A parameter count as model cards say it: billions, or millions below a tenth of one."""
    return f"{params / 1e9:,.2f}B" if params >= 1e8 else f"{params / 1e6:,.1f}M"


def cmd_devices(args: argparse.Namespace) -> int:
    profiles = known_profiles()
    rows = [{"name": p.name, "aliases": list(p.aliases), "peak_flops_per_s": p.peak_flops_per_s,
             "memory_bytes": p.memory_bytes, "usable_memory_bytes": p.usable_memory_bytes,
             "memory_bandwidth_bytes_per_s": p.memory_bandwidth_bytes_per_s,
             "intra_node_bytes_per_s": p.intra_node.bandwidth_bytes_per_s,
             "inter_node_bytes_per_s": p.inter_node.bandwidth_bytes_per_s, "profile": p.path}
            for p in profiles.values()]
    if args.json:
        emit_json({"devices": rows})
        return 0
    from reports.tables import table
    print(table(("device", "aliases", "bf16 TFLOP/s", "memory GiB", "HBM GB/s", "node GB/s", "net GB/s"),
                [(r["name"], ",".join(r["aliases"]), f"{r['peak_flops_per_s'].get('bf16', 0) / 1e12:,.1f}",
                  f"{r['usable_memory_bytes'] / GIB:.1f}", f"{r['memory_bandwidth_bytes_per_s'] / 1e9:,.0f}",
                  f"{r['intra_node_bytes_per_s'] / 1e9:,.0f}", f"{r['inter_node_bytes_per_s'] / 1e9:,.1f}")
                 for r in rows]))
    print("\nmemory: what torch.cuda reports where the profile gives it (else the datasheet's), the capacity a "
          "search budgets from, before its headroom and fragmentation; bandwidths are per device, per direction; "
          "a path to a .toml profile works as a device")
    return 0
