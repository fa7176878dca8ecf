"""benchmarks/gemm_neighbours.py: each loop reports its own rate, pinned where asked; bad lists are
refused by name."""
from __future__ import annotations

import argparse
import os

import pytest

from tests.benchmarks.benchmark_loader import load_benchmark

bench = load_benchmark("gemm_neighbours")


def test_one_rate_per_loop_in_core_order():
    cores = sorted(os.sched_getaffinity(0))[:2]
    rates = bench.rates(cores, 0.2, 1.0, sleep_ms=1.0)
    assert len(rates) == len(cores) and all(r > 0 for r in rates)


def test_a_list_that_is_not_numbers_or_is_negative_is_refused():
    assert bench._floats("2,24.5") == [2.0, 24.5]
    for bad in ("2,x", "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            bench._floats(bad)
