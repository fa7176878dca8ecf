"""Shared fixtures: small, named specs so tests read like the formulas they check."""
from __future__ import annotations

import fcntl
import os
import shutil
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
if _RUN is not None:   # the workers keep every core busy: each search in one process (planner.halves)
    os.environ.setdefault("PLANNER_SEARCH_PROCESSES", "1")


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
    if not hasattr(config, "workerinput"):   # the session's own process: before its workers start
        _suite_temp_dir(config)


# --- The suite's temporary files ----------------------------------------------------------------
# Every temporary file of a run (its tests' tmp_path, the machine's locks above, the tracebacks of
# the bugs that the tests of planner's bug report raise on purpose, the launched ranks' files) goes
# into one directory, TMPDIR for the workers and every process they start, removed when the run
# passes and kept, named, when it does not.
def _suite_temp_dir(config) -> None:
    path = tempfile.mkdtemp(prefix="planner-tests-")
    config.stash[_TEMP_DIR] = path
    os.environ["TMPDIR"] = path
    tempfile.tempdir = None   # read TMPDIR again


_TEMP_DIR = pytest.StashKey[str]()


def pytest_unconfigure(config):
    path = config.stash.get(_TEMP_DIR, None)
    if path is None:
        return
    if config.stash.get(_FAILED, False):
        print(f"\nthe run's temporary files are kept in {path}")
    else:
        shutil.rmtree(path, ignore_errors=True)


_FAILED = pytest.StashKey[bool]()


def pytest_sessionfinish(session, exitstatus):
    if not hasattr(session.config, "workerinput"):
        session.config.stash[_FAILED] = exitstatus != 0


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


# --- How the workers share the suite ---------------------------------------------------------
# `--dist loadfile` hands a module to one worker, so its module-scoped fixtures are set up once.
# These modules are long rows of independent forked-rank runs (their own tmp_path, ports and
# ranks, nothing shared between tests), and one of them on one worker was the suite's tail while
# the other worker sat idle: their tests are handed out one by one instead. xdist orders the
# work by size (most tests first), so the whole modules start first and these single tests fill
# both workers to the end.
ONE_BY_ONE = frozenset({"tests/runtime/test_parity.py", "tests/runtime/test_run_cli.py"})


def _scope(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return nodeid if module in ONE_BY_ONE else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class OneByOneScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)
    return OneByOneScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """A module-scoped fixture in a module of ONE_BY_ONE would be set up on every worker that
    runs one of its tests: refused, so the module is taken out of ONE_BY_ONE instead."""
    users: dict[tuple[str, str], int] = {}
    for item in items:
        if item.nodeid.split("::", 1)[0] not in ONE_BY_ONE:
            continue
        for name, defs in item._fixtureinfo.name2fixturedefs.items():
            if defs[-1].scope in ("module", "class"):
                key = (item.nodeid.split("::", 1)[0], name)
                users[key] = users.get(key, 0) + 1
    shared = [f"{module}: {name}" for (module, name), count in users.items() if count > 1]
    if shared:
        raise pytest.UsageError("tests/conftest.py ONE_BY_ONE hands these modules' tests to workers one by one, "
                                f"but tests share a module-scoped fixture ({', '.join(shared)}): take the module "
                                "out of ONE_BY_ONE")
