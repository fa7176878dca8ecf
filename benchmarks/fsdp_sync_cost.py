"""What FSDP2's once-a-step work costs on one rank (costmodel.rank_time.one_replica_fsdp_s prices
it; the profile measures it as runtime.profiler.fsdp_sync_s_per_param): the last micro-batch's
backward with gradient sync on (FSDP2's reduce: copy-in to the reduce dtype's flat buffer,
copy-out into the fp32 sharded gradients; no collective runs on one rank) against one with it
off, and the first forward after the parameters were resharded (the cast to the compute dtype
and its copy into the buffer the parameters view) against a forward on parameters already whole.

    python benchmarks/fsdp_sync_cost.py [--hidden 320] [--layers 6] [--vocab 5000] [--dtype bf16] [--rounds 8]

The profile's own model and round (runtime.profiler.fsdp_stack, fsdp_round: FSDP2 as
`runtime.parallel.apply_data_parallel` applies it to a plan with one data-parallel replica, the
layers plain linear stacks of a GPT-style layer's shapes, not the runtime's model), here at a
chosen size, with an output projection and a training micro-batch of tokens. On a one-rank
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

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from runtime.host_memory import keep_freed_memory
from runtime.profiler import DTYPES, fsdp_round, fsdp_stack

MICRO_BATCHES = 4
WARM_ROUNDS = 2
TOKENS = 256


def build(hidden: int, layers: int, vocab: int, dtype: torch.dtype) -> nn.Module:
    """The profile's FSDP stack (runtime.profiler.fsdp_stack) with an output projection, on a
    one-rank CPU mesh."""
    return fsdp_stack(hidden, layers, dtype, init_device_mesh("cpu", (1,)), torch.device("cpu"), vocab=vocab)


def measure(hidden: int, layers: int, vocab: int, dtype: str, rounds: int) -> tuple[int, dict[str, float]]:
    """(parameters, median seconds per part) on the process group already set up."""
    model = build(hidden, layers, vocab, DTYPES[dtype])
    x = torch.randn(TOKENS, hidden)
    kept = [fsdp_round(model, x, torch.device("cpu"), MICRO_BATCHES) for _ in range(rounds)][WARM_ROUNDS:]
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
