"""runtime.host_memory: with the freed memory kept, a training pass reuses the pages the last one
freed instead of touching fresh ones; CPU ranks set it (runtime.fork, runtime.worker)."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.host_memory import keep_freed_memory

# the probe's wide model (4 x 128 tokens, 4,096 words: 8 MiB of logits), forward, loss and
# backward, the pages each pass first touches; glibc as it comes kept touching thousands a pass
# after the first (2,688-4,098 in passes 3-5 here, 2026-11-28), the kept memory none
PASSES = 8
ROOT = Path(__file__).resolve().parents[2]


def faults_per_pass(keep: bool) -> list[int]:
    import resource

    import torch

    from planner.probes import WIDE
    from runtime.job import cross_entropy
    from runtime.model import Transformer
    if keep:
        assert keep_freed_memory() and keep_freed_memory()   # set again: as harmless
    torch.set_num_threads(1)
    net = Transformer(WIDE)
    net.init_weights(0)
    tokens = torch.randint(0, WIDE.vocab_size, (4, 128))
    out = []
    for _ in range(PASSES):
        net.zero_grad(set_to_none=True)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        cross_entropy(net(tokens), tokens).backward()
        out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return out


def _steady(faults: list[int]) -> float:
    return statistics.median(faults[3:])   # after the passes that grow the heap


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_is_reused_pass_after_pass():
    # in a fresh interpreter: mallopt is process-wide and cannot be undone
    code = ("import json; from tests.runtime.test_host_memory import faults_per_pass; "
            "print(json.dumps(faults_per_pass(True)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    faults = json.loads(proc.stdout.strip().splitlines()[-1])
    assert _steady(faults) < 100, faults   # 8 MiB of logits alone are 2,048 pages


KEPT: list[bool] = []


def _mark() -> bool:
    KEPT.append(True)
    return True


def _kept_here() -> bool:
    return KEPT == [True]


def test_a_forked_cpu_rank_keeps_its_freed_memory(monkeypatch):
    """runtime.fork._worker sets it in each CPU rank (a fork of this process, whose heap's history
    already hides glibc's behaviour: hence the check of the call, not of the pages)."""
    import runtime.fork
    monkeypatch.setattr(runtime.fork, "keep_freed_memory", _mark)
    assert runtime.fork.run_forked(1, _kept_here) == [True]


def test_no_glibc_no_setting(monkeypatch):
    import runtime.host_memory as hm
    monkeypatch.setattr(hm.os, "confstr", lambda name: None)   # musl: no CS_GNU_LIBC_VERSION
    assert hm.glibc_version() == "" and hm.keep_freed_memory() is False
