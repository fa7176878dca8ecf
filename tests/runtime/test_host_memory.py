"""runtime.host_memory: with the freed memory kept, glibc serves a large block from its heap and
keeps it when freed, where it would map fresh pages and hand them back; CPU ranks set it
(runtime.fork, runtime.worker). What that saves a training pass: `python benchmarks/memory.py
host PLAN.json` prints the pages each pass first touches, glibc as it comes against with the
freed memory kept."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.host_memory import glibc_version

ROOT = Path(__file__).resolve().parents[2]
BLOCK_BYTES = 16 << 20   # a 2,048 x 2,048 fp32 tensor: above glibc's first mmap threshold (128 KiB)

# in a fresh interpreter (mallopt is process-wide and cannot be undone): whether a block is
# mapped on its own while held (mallinfo2's hblks, before and after) and how much the heap keeps once it is freed
# (keepcost: the top chunk, which a trim would hand back)
GLIBC_ACCOUNTS = """
import ctypes, json, sys
from runtime.host_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory() and keep_freed_memory()   # set again: as harmless
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                      "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype = Info, ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = (ctypes.c_size_t,), (ctypes.c_void_p,)
before = libc.mallinfo2().hblks
block = libc.malloc(int(sys.argv[2]))
mapped = libc.mallinfo2().hblks - before
libc.free(block)
print(json.dumps([mapped, libc.mallinfo2().keepcost]))
"""


def _accounts(mode: str) -> tuple[int, int]:
    proc = subprocess.run([sys.executable, "-c", GLIBC_ACCOUNTS, mode, str(BLOCK_BYTES)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    mapped, kept_bytes = json.loads(proc.stdout.strip().splitlines()[-1])
    return mapped, kept_bytes


@pytest.mark.skipif(not glibc_version(), reason="glibc's mallopt")
def test_a_large_block_comes_from_the_heap_and_stays_there():
    assert _accounts("as-is")[0] == 1   # glibc as it comes: mapped on its own, unmapped on free
    mapped, kept_bytes = _accounts("keep")
    assert mapped == 0 and kept_bytes >= BLOCK_BYTES


KEPT: list[bool] = []


def _mark() -> bool:
    KEPT.append(True)
    return True


def _kept_here() -> bool:
    return KEPT == [True]


def test_a_forked_cpu_rank_keeps_its_freed_memory(monkeypatch):
    """runtime.fork._worker sets it in each CPU rank (a fork of this process, whose heap's history
    already hides glibc's behaviour: hence the check of the call)."""
    import runtime.fork
    monkeypatch.setattr(runtime.fork, "keep_freed_memory", _mark)
    assert runtime.fork.run_forked(1, _kept_here) == [True]


def test_no_glibc_no_setting(monkeypatch):
    import runtime.host_memory as hm
    monkeypatch.setattr(hm.os, "confstr", lambda name: None)   # musl: no CS_GNU_LIBC_VERSION
    assert hm.glibc_version() == "" and hm.keep_freed_memory() is False
