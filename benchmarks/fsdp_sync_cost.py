"""What FSDP2's once-a-step work costs on one rank (costmodel.rank_time.one_replica_fsdp_s prices
it; the profile measures it as runtime.profiler.fsdp_sync_s_per_param): the last micro-batch's
backward with gradient sync on (FSDP2's reduce: copy-in to the reduce dtype's flat buffer,
copy-out into the fp32 sharded gradients; no collective runs on one rank) against one with it
off, and the first forward after the parameters were resharded (the cast to the compute dtype
and its copy into the buffer the parameters view) against a forward on parameters already whole.

    python benchmarks/fsdp_sync_cost.py [--hidden 320] [--layers 6] [--vocab 5000] [--dtype bf16] [--rounds 8]

FSDP2 as `runtime.parallel.apply_data_parallel` applies it to a plan with one data-parallel
replica: a unit per layer and one at the root, parameters kept whole after the forward (ZeRO-1),
parameters in the compute dtype and reductions in fp32; the layers are plain linear stacks of a
GPT-style layer's shapes (QKV, output, FFN up, GeLU, down), not the runtime's model. On a one-rank
gloo group (a HashStore: no port), one thread, freed memory kept as a run's ranks keep it
(runtime.host_memory: without it the reduce's fresh buffers pay their pages again, which had read
the bf16 reduce about twice as slow here). The runtime wraps a one-replica plan in FSDP only
for a 16-bit compute dtype (or TP or offload): an fp32 one-rank plan runs plain.

Each round runs four micro-batches as the runtime does (sync on the last only) and then reshards,
as the optimizer step's end does; the figures are medians over the rounds after the first two.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from runtime.host_memory import keep_freed_memory

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MICRO_BATCHES = 4
WARM_ROUNDS = 2
TOKENS = 256


def layer(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, 3 * hidden), nn.Linear(3 * hidden, hidden),
                         nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))


def build(hidden: int, layers: int, vocab: int, dtype: torch.dtype) -> nn.Module:
    model = nn.Sequential(*[layer(hidden) for _ in range(layers)], nn.Linear(hidden, vocab))
    mesh = init_device_mesh("cpu", (1,))
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for block in model[:layers]:
        fully_shard(block, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    return model


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def one_round(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    """Seconds of the first and a later forward, of an unsynced and the synced backward."""
    out: dict[str, float] = {}
    for k in range(MICRO_BATCHES):
        final = k == MICRO_BATCHES - 1
        model.set_requires_gradient_sync(final)
        model.set_reshard_after_backward(final)
        holder = {}
        fwd = timed(lambda: holder.setdefault("y", model(x)))
        bwd = timed(lambda: holder["y"].float().square().mean().backward())
        if k == 0:
            out["first forward"] = fwd
        elif k == 1:
            out["later forward"], out["unsynced backward"] = fwd, bwd
        if final:
            out["synced backward"] = bwd
    model.zero_grad(set_to_none=True)
    return out


def measure(hidden: int, layers: int, vocab: int, dtype: str, rounds: int) -> tuple[int, dict[str, float]]:
    """(parameters, median seconds per part) on the process group already set up."""
    model = build(hidden, layers, vocab, DTYPES[dtype])
    x = torch.randn(TOKENS, hidden)
    kept = [one_round(model, x) for _ in range(rounds)][WARM_ROUNDS:]
    return sum(p.numel() for p in model.parameters()), {key: statistics.median(r[key] for r in kept)
                                                        for key in kept[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=320)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=5000)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    if args.rounds <= WARM_ROUNDS:
        parser.error(f"--rounds must be above the {WARM_ROUNDS} warm-up rounds")
    torch.set_num_threads(1)
    keep_freed_memory()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        params, med = measure(args.hidden, args.layers, args.vocab, args.dtype, args.rounds)
    finally:
        dist.destroy_process_group()
    print(f"{params / 1e6:.2f}M parameters, {args.dtype} compute, fp32 reduce, {TOKENS} tokens a micro-batch, "
          f"median of {args.rounds - WARM_ROUNDS} rounds")
    for key, s in med.items():
        print(f"  {key:18s} {s * 1e3:8.2f} ms")
    for what, extra in (("the reduce (synced - unsynced backward)", med["synced backward"] - med["unsynced backward"]),
                        ("the re-gather (first - later forward)", med["first forward"] - med["later forward"])):
        print(f"{what}: {extra * 1e3:.2f} ms, {extra / params * 1e9:.2f} ns a parameter")
    print("command: python benchmarks/fsdp_sync_cost.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items()))


if __name__ == "__main__":
    main()
