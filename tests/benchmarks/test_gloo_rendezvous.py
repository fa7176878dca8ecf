"""benchmarks/gloo_rendezvous.py: each compute stretch timed over the calls after the warm-up."""
from __future__ import annotations

from runtime.fork import run_forked
from tests.benchmarks.benchmark_loader import load_benchmark

bench = load_benchmark("gloo_rendezvous")


def test_every_stretch_keeps_the_calls_after_the_warm_up():
    calls = bench.WARM_CALLS + 3
    for result in run_forked(2, bench.rank_loop, 100, [0.0, 0.2], calls):
        assert list(result) == [0.0, 0.2]
        assert all(len(waits) == 3 and all(w > 0 for w in waits) for waits in result.values())
