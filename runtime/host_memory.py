"""Host memory that a CPU rank frees stays with the process, so the next tensor of its size does
not touch fresh pages.

glibc's malloc serves a large request (above a threshold it raises as blocks are freed, up to
32 MiB) with a fresh mmap and hands it back to the kernel on free; a block freed at the heap's
top goes back too past the trim threshold. A training step allocates and frees the same large
tensors every micro-batch (a 512 x 6,000 fp32 loss's logits, their gradient, FSDP's gathered
parameters), and each fresh mapping is paid page by page on first touch: with glibc as it
comes a pass's loss kernels take several times what they take with the freed memory kept
(`python benchmarks/memory.py host PLAN.json` times both, pass by pass, in fresh processes). The
microbenchmarks the cost model prices from (runtime.profiler) time kernels on warm, reused
memory: a step that keeps its pages runs the way they were measured.
"""
from __future__ import annotations

import ctypes
import os

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_BYTES = 32 << 20      # glibc's ceiling for it on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)
TRIM_THRESHOLD_BYTES = (1 << 31) - 1  # a C int's largest: freed heap memory stays


def keep_freed_memory() -> bool:
    """Fix glibc's mmap threshold at its ceiling and its trim threshold out of reach, for this
    process (a forked child inherits them). False where the C library is not glibc (another
    one's allocator keeps its own policy) or glibc refuses the values. Blocks above the ceiling
    are still fresh mappings; the process's resident memory stays at its peak, as a training
    step's does anyway."""
    if not glibc_version():
        return False
    mallopt = ctypes.CDLL(None).mallopt   # the process's own C library, glibc's here
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mapped = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    return bool(mapped) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def glibc_version() -> str:
    """"glibc 2.36" where this process runs on glibc, else "" (musl, macOS: no such confstr)."""
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError, AttributeError):
        return ""
