"""One-off measurement behind profiles/xeon-amx.toml (`planner profile` measures more, into the `local` cache).

    OMP_NUM_THREADS=1 python scripts/measure_cpu.py

One thread per rank, as the runtime runs ranks on CPU: best-of-N matmul FLOP/s per dtype at a
transformer-like size, copy bandwidth, and a 2-rank gloo all-reduce over loopback.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.profiler import best_s  # best of N after a warm-up, as `planner profile` times


def matmul_flops_per_s(dtype: torch.dtype, n: int = 1024) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / best_s(lambda: a @ b, 5)


def copy_bytes_per_s(num_bytes: int = 256 * 2**20) -> float:
    src = torch.empty(num_bytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * num_bytes / best_s(lambda: dst.copy_(src), 5)


def _allreduce_worker(rank: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    small, big = torch.ones(1), torch.ones(16 * 2**20 // 4)
    lat = best_s(lambda: dist.all_reduce(small), 20)
    t_big = best_s(lambda: dist.all_reduce(big), 5)
    if rank == 0:
        # ring all-reduce moves 2(n-1)/n = 1x the buffer per rank for n = 2
        out["latency_s"], out["bus_bytes_per_s"] = lat, big.numel() * 4 / t_big
    dist.destroy_process_group()


def main() -> None:
    torch.set_num_threads(1)
    print(f"fp32 matmul 1024^3: {matmul_flops_per_s(torch.float32) / 1e9:.1f} GFLOP/s")
    print(f"bf16 matmul 1024^3: {matmul_flops_per_s(torch.bfloat16) / 1e9:.1f} GFLOP/s")
    print(f"copy bandwidth: {copy_bytes_per_s() / 1e9:.2f} GB/s (read + write)")
    out = mp.Manager().dict()
    mp.start_processes(_allreduce_worker, args=(out,), nprocs=2, start_method="spawn")
    print(f"gloo all-reduce, 2 ranks: latency {out['latency_s'] * 1e6:.0f} us, "
          f"bandwidth {out['bus_bytes_per_s'] / 1e9:.2f} GB/s per rank per direction")


if __name__ == "__main__":
    main()
