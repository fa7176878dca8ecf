"""The search's two halves (planner.halves): the second runs in a forked process where the
platform forks, with the same answer as one after the other; its failure is raised as a bug, and
an error in the parent ends it."""
import os
import sys
import time

import pytest

from costmodel.hardware import parse_cluster
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner import halves
from planner.search import search
from planner.search_options import SearchOptions

forks = pytest.mark.skipif(not (sys.platform == "linux" and (os.cpu_count() or 1) >= 2),
                           reason="no fork or a single core: the halves run one after the other")


@pytest.fixture(autouse=True)
def two_processes(monkeypatch):
    """The suite's workers run each search in one process (tests/conftest.py); these ask for two."""
    monkeypatch.setenv("PLANNER_SEARCH_PROCESSES", "2")


@forks
def test_the_second_half_runs_in_another_process():
    got = halves.in_halves(lambda i: (i, os.getpid()))
    assert [i for i, _ in got] == [0, 1]
    assert got[0][1] == os.getpid() != got[1][1]


@forks
def test_a_failure_in_the_second_half_is_raised_with_its_traceback():
    def run(i):
        if i == 1:
            raise ZeroDivisionError("in the child")
        return i
    with pytest.raises(RuntimeError, match="second half failed:(.|\n)*ZeroDivisionError: in the child"):
        halves.in_halves(run)


@forks
def test_an_error_in_the_first_half_ends_the_second(tmp_path):
    marker = tmp_path / "child"

    def run(i):
        if i == 1:
            (tmp_path / "writing").write_text(str(os.getpid()))
            os.replace(tmp_path / "writing", marker)   # whole when the parent sees it
            time.sleep(60)
            return i
        while not marker.exists():
            time.sleep(0.01)
        raise KeyboardInterrupt
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        halves.in_halves(run)
    assert time.monotonic() - start < 30
    with pytest.raises(ProcessLookupError):   # killed and reaped
        os.kill(int(marker.read_text()), 0)


@forks
@pytest.mark.parametrize("count", [0, 1, 2, 5])
def test_a_list_mapped_in_halves_keeps_its_order(count):
    got = halves.map_in_halves(lambda x: (x * x, os.getpid()), list(range(count)))
    assert [value for value, _ in got] == [x * x for x in range(count)]
    # every other item in the child, from the second on, where there are two to share
    assert [pid == os.getpid() for _, pid in got] == [i % 2 == 0 or count < 2 for i in range(count)]


@pytest.mark.parametrize("model_name,cluster", [("llama2-13b", "4x8xH100"), ("mixtral-8x7b", "4x8xH100")])
def test_forked_halves_give_the_answer_of_one_process(monkeypatch, model_name, cluster):
    model, parsed = resolve_model(model_name), parse_cluster(cluster)
    train = TrainSpec(seq_len=4096, global_batch_size=256)
    forked = search(model, train, parsed, SearchOptions())
    monkeypatch.setattr(halves, "_forks", lambda: False)
    alone = search(model, train, parsed, SearchOptions())
    assert [(f.plan, f.estimate.step_time_s) for f in forked.plans] == [(f.plan, f.estimate.step_time_s)
                                                                         for f in alone.plans]
    assert [f.plan for f in forked.evaluated] == [f.plan for f in alone.evaluated]
    assert forked.stats.to_dict() | {"wall_s": 0} == alone.stats.to_dict() | {"wall_s": 0}
    assert forked.stats.optimal


def test_the_process_count_is_one_or_two(monkeypatch):
    from costmodel.inputs import UserError
    monkeypatch.setenv("PLANNER_SEARCH_PROCESSES", "1")
    assert not halves._forks()
    assert halves.in_halves(lambda i: (i, os.getpid())) == [(0, os.getpid()), (1, os.getpid())]
    monkeypatch.setenv("PLANNER_SEARCH_PROCESSES", "4")
    with pytest.raises(UserError, match="PLANNER_SEARCH_PROCESSES='4': the search runs in 1 or 2 processes"):
        halves.in_halves(lambda i: i)


@pytest.mark.parametrize("model_name,cluster,framework", [
    ("llama2-13b", "2x8xA100+2x8xH100", "planner"), ("llama2-7b", "1x8xA100+1x8xH100", "planner"),
    ("llama2-13b", "4x8xH100", "megatron"), ("deepseek-v2-lite", "4x8xA100", "megatron")])
def test_the_two_halves_list_the_whole_space_once(model_name, cluster, framework):
    """Each half lists every other shape at every pp: together each group of the whole listing
    once (a mixed cluster, whose degree sets often place no replicas, once made the two
    processes' shares disagree: groups lost in both, others listed twice)."""
    from planner.candidates import placement_groups
    from planner.specs import build_specs
    from planner.targets import options_for
    model, train, parsed = build_specs(model_name, cluster, framework=framework)
    options = options_for(framework, model, train, parsed, SearchOptions())

    def listed(share):
        return [(g.base, tuple(g.variants), tuple(g.orders))
                for g in placement_groups(model, train, parsed, options, lambda reason: None, share)]
    whole, first, second = listed((0, 1)), listed((0, 2)), listed((1, 2))
    assert sorted(map(repr, first + second)) == sorted(map(repr, whole)) and first and second


@forks
def test_a_report_drawn_on_two_cores_is_the_one_drawn_on_one(tmp_path, monkeypatch, capsys):
    """The report's figures are drawn half in a forked process: the same files, the same page."""
    from planner.cli import main
    plan = tmp_path / "plan.json"
    assert main(["predict", "--model", "llama-7b", "--cluster", "1x8xA100", "--pp", "2", "--tp", "2", "--dp", "2",
                 "--out", str(plan)]) == 0
    for processes in ("1", "2"):
        monkeypatch.setenv("PLANNER_SEARCH_PROCESSES", processes)
        assert main(["report", str(plan), "--out", str(tmp_path / processes)]) == 0
    one, two = tmp_path / "1", tmp_path / "2"
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in two.iterdir()) and "bubble_warmup.png" in names
    assert (one / "index.md").read_text() == (two / "index.md").read_text()
    assert all((one / n).read_bytes() == (two / n).read_bytes() for n in names if n.endswith(".png"))
