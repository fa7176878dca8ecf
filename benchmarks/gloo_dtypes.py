"""gloo's collectives in fp32 and bf16 at equal element counts, two ranks on this machine, one
thread each (as `planner run` gives a CPU rank): does a collective here cost per byte, per
element or per call? (README, closed loop: "Two passes".)

    python benchmarks/gloo_dtypes.py [--reps 15]

Reduce-scatter, all-gather and all-reduce over 256K-4M elements (the closed loop's hidden model
moves 393K per TP collective: 1,024 tokens x 384), the dtypes and operations alternating call by
call so a drift of the machine weighs on each alike; each call after a barrier; medians of all
but the first three calls, and the best of all calls. Two ranks (the shards are halves).
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ELEMENTS = (1 << 18, 393_216, 1 << 20, 1 << 22)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, reps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for elems in ELEMENTS:
        bufs = {d: (torch.randn(elems, dtype=t), torch.empty(elems // 2, dtype=t)) for d, t in DTYPES.items()}
        ops = {"reduce_scatter": lambda b: dist.reduce_scatter_tensor(b[1], b[0]),
               "all_gather": lambda b: dist.all_gather_into_tensor(b[0], b[1]),
               "all_reduce": lambda b: dist.all_reduce(b[0])}
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(reps):
            for op, fn in ops.items():
                for d, b in bufs.items():
                    dist.barrier()
                    start = time.perf_counter()
                    fn(b)
                    times.setdefault((op, d), []).append(time.perf_counter() - start)
        if rank == 0:
            cells = []
            for op in ops:
                f, b = times[(op, "fp32")], times[(op, "bf16")]
                cells.append(f"{op} {1e3 * statistics.median(f[3:]):6.2f} / {1e3 * statistics.median(b[3:]):6.2f} "
                             f"(best {1e3 * min(f):5.2f} / {1e3 * min(b):5.2f})")
            print(f"{elems:>9,} elements   " + "   ".join(cells), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="calls per dtype, operation and size (default 15)")
    args = parser.parse_args()
    if args.reps < 4:
        parser.error("--reps must be at least 4 (the first three are warm-up)")
    print("median ms fp32 / bf16 (best fp32 / bf16), two gloo ranks, one thread each")
    mp.spawn(_worker, args=(_free_port(), args.reps), nprocs=2)


if __name__ == "__main__":
    main()
