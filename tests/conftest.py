"""Shared fixtures: small, named specs so tests read like the formulas they check."""
from __future__ import annotations

import fcntl
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

from costmodel.hardware import parse_cluster
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec


@pytest.fixture
def group():
    """A one-rank gloo process group in this process (a HashStore: no port), for FSDP2 and the
    profiler's collectives."""
    import torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def llama70b():
    return resolve_model("llama-70b")


@pytest.fixture
def a100_64():
    return parse_cluster("8x8xA100")


@pytest.fixture
def train_4k():
    return TrainSpec(seq_len=4096, global_batch_size=1024)


# --- The machine shared by test workers ------------------------------------------------------
# The suite runs on pytest-xdist's workers (pyproject's addopts). A test marked `alone` measures
# the machine or bounds a wall-clock time (a profile, a watchdog, a signal answered within 5 s):
# it runs with no other test at once. The others share. A turnstile lock keeps a waiting `alone`
# test from being starved by the other worker's stream of shared ones.
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")


@contextmanager
def machine_alone(alone: bool = True):
    if _RUN is None:   # one process: nothing runs beside this test anyway
        yield
        return
    base = Path(tempfile.gettempdir()) / f"planner-tests-{_RUN}"
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.room", "a") as room:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(room, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(room, fcntl.LOCK_UN)


def pytest_configure(config):
    config.addinivalue_line("markers", "alone: measures the machine or bounds a wall-clock time; "
                                       "no other test runs beside it")


@pytest.fixture(autouse=True)
def _share_the_machine(request):
    # autouse fixtures are set up before the test's other function-scoped fixtures; a
    # module-scoped fixture that measures takes machine_alone() itself
    with machine_alone(request.node.get_closest_marker("alone") is not None):
        yield


@pytest.fixture(scope="session")
def machine_lock():
    """machine_alone, for a module-scoped fixture that measures the machine."""
    return machine_alone
