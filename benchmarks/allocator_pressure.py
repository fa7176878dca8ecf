"""What a training step costs as its peak nears the device's memory: one workload run with the
caching allocator's limit (torch.cuda.set_per_process_memory_fraction) set so its natural peak
allocation is a given share of the limit.

    python benchmarks/allocator_pressure.py --out pressure.json [--shares 0.7,0.85,0.9,0.95,0.98]
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/allocator_pressure.py --out ...
    python benchmarks/allocator_pressure.py --replay pressure.json

The workload is FSDP's pattern on one device, as the MPT benchmark runs trained (Composer's FSDP,
fp32 master weights, bf16 compute, every layer checkpointed): Llama-style layers whose fp32
weights are cast to a new bf16 copy at each use (forward, and again in the backward's
recomputation), that copy freed after the layer, so the allocator sees a layer's weights come and
go beside the checkpoints and the gradients. Per share: the median step of --steps after two
warm-up steps, the peak allocated and reserved bytes, and the allocator's retries
(torch.cuda.memory_stats' num_alloc_retries: a cudaMalloc that failed, after which the allocator
frees its cached blocks, synchronising the device, and tries again). --replay prints a file's
table. Needs CUDA."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from runtime.profiler.timing import best_s

SHARES = (0.7, 0.85, 0.9, 0.95, 0.98)


def build(layers: int, hidden: int, ffn: int, heads: int):
    import torch
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Parameter(torch.randn(3 * hidden, hidden) * hidden ** -0.5)
            self.out = torch.nn.Parameter(torch.randn(hidden, hidden) * hidden ** -0.5)
            self.up = torch.nn.Parameter(torch.randn(2 * ffn, hidden) * hidden ** -0.5)
            self.down = torch.nn.Parameter(torch.randn(hidden, ffn) * ffn ** -0.5)

        def forward(self, x):
            # the bf16 copies a gather makes, freed once the layer is done
            qkv, out, up, down = (w.to(torch.bfloat16) for w in (self.qkv, self.out, self.up, self.down))
            b, s, _ = x.shape
            h = F.rms_norm(x, (hidden,))
            q, k, v = F.linear(h, qkv).view(b, s, 3, heads, hidden // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, hidden)
            x = x + F.linear(a, out)
            gate, lin = F.linear(F.rms_norm(x, (hidden,)), up).chunk(2, dim=-1)
            return x + F.linear(F.silu(gate) * lin, down)

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(layers))

        def forward(self, x):
            for layer in self.layers:
                x = checkpoint(layer, x, use_reentrant=False)
            return x

    return Stack().cuda()


def step(model, tokens: int, hidden: int) -> None:
    import torch
    x = torch.randn(1, tokens, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    model(x).float().square().mean().backward()


def measure(model, share: float, natural_bytes: float, steps: int, tokens: int, hidden: int) -> dict:
    """The workload at a limit where its natural peak is `share` of it."""
    import torch
    total = torch.cuda.get_device_properties(0).total_memory
    model.zero_grad(set_to_none=True)
    torch.cuda.empty_cache()
    limit = natural_bytes / share
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total))
    torch.cuda.reset_peak_memory_stats()
    retries0 = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    one = lambda: step(model, tokens, hidden)  # noqa: E731
    try:   # two warm-up steps (one here, one in best_s), then the median of `steps`
        one()
        step_s = best_s(one, repeat=steps, sync=torch.cuda.synchronize, pick=statistics.median)
    except torch.cuda.OutOfMemoryError:
        return {"share": share, "limit_bytes": limit, "oom": True}
    return {"share": share, "limit_bytes": limit, "oom": False, "step_s": step_s,
            "allocated_bytes": torch.cuda.max_memory_allocated(), "reserved_bytes": torch.cuda.max_memory_reserved(),
            "alloc_retries_per_step": (torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries0) / (steps + 2)}


def run(args) -> dict:
    import torch
    model = build(args.layers, args.hidden, args.ffn, args.heads)
    for _ in range(2):
        step(model, args.tokens, args.hidden)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(model, args.tokens, args.hidden)
    natural = torch.cuda.max_memory_allocated()
    rows = [measure(model, share, natural, args.steps, args.tokens, args.hidden) for share in args.shares]
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "natural_allocated_bytes": natural,
            "workload": {k: getattr(args, k) for k in ("layers", "hidden", "ffn", "heads", "tokens")}, "rows": rows}


def table(doc: dict) -> str:
    gib = 2 ** 30
    lines = [f"{doc['device']}, torch {doc['torch']}, PYTORCH_CUDA_ALLOC_CONF={doc['alloc_conf'] or '(unset)'}; "
             f"natural peak {doc['natural_allocated_bytes'] / gib:.2f} GiB allocated; workload {doc['workload']}",
             "share  limit GiB  step s  vs first  alloc GiB  resv GiB  retries/step"]
    base = next((r["step_s"] for r in doc["rows"] if not r["oom"]), None)
    for r in doc["rows"]:
        if r["oom"]:
            lines.append(f"{r['share']:5.2f}  {r['limit_bytes'] / gib:9.2f}  out of memory")
            continue
        lines.append(f"{r['share']:5.2f}  {r['limit_bytes'] / gib:9.2f}  {r['step_s']:6.3f}  {r['step_s'] / base:8.3f}"
                     f"  {r['allocated_bytes'] / gib:9.2f}  {r['reserved_bytes'] / gib:8.2f}  {r['alloc_retries_per_step']:12.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="JSON file to write (not overwritten)")
    p.add_argument("--replay", type=Path, help="print a stored file's table")
    p.add_argument("--shares", type=lambda s: tuple(float(v) for v in s.split(",")), default=SHARES,
                   help="natural peak over the limit, each in (0, 1] (default %(default)s)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--tokens", type=int, default=8192)
    args = p.parse_args(argv)
    if args.replay:
        print(table(json.loads(args.replay.read_text())))
        return 0
    if args.out is None or args.out.exists():
        print("allocator_pressure: --out FILE is needed and must not exist", file=sys.stderr)
        return 2
    if not all(0 < s <= 1 for s in args.shares):
        print("allocator_pressure: --shares are each in (0, 1]", file=sys.stderr)
        return 2
    import torch
    if not torch.cuda.is_available():
        print("allocator_pressure: needs CUDA (--replay reads a stored file anywhere)", file=sys.stderr)
        return 2
    doc = run(args)
    args.out.write_text(json.dumps(doc, indent=1))
    print(table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
