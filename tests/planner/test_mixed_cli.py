"""A mixed cluster from the command line (issue 17): the search places pipeline stages on the
device groups, beats both uniform alternatives in prediction, shows the placement in its table,
and the plan it writes is read back, reported, refused where it cannot go (exports, a local run)
and launched with node ranks that follow the groups."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from costmodel.hardware import parse_cluster
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.cli import main
from planner.search import SearchOptions, search

MIXED = ["--model", "llama-70b", "--cluster", "4x8xA100+4x8xH100"]


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """The search's table and the plan file it wrote (one search for the whole module)."""
    path, table = tmp_path_factory.mktemp("mixed") / "plan.json", io.StringIO()
    with contextlib.redirect_stdout(table):
        assert main(["search", *MIXED, "--top", "2", "--out", str(path)]) == 0
    return path, table.getvalue()


@pytest.fixture
def mixed_plan(searched):
    return searched[0]


def test_the_mixed_search_beats_either_uniform_plan(mixed_plan, capsys):
    doc = json.loads(mixed_plan.read_text())
    assert main(["predict", "--plan", str(mixed_plan), "--json"]) == 0
    mixed_s = json.loads(capsys.readouterr().out)["estimate"]["step_time_s"]
    model, train = resolve_model("llama-70b"), TrainSpec(seq_len=4096, global_batch_size=1024)
    # only the H100s, or every device priced as an A100
    for cluster in ("4x8xH100", "8x8xA100"):
        result = search(model, train, parse_cluster(cluster), SearchOptions(top_k=1))
        assert mixed_s < result.fastest.estimate.step_time_s, cluster
    # the stages are placed on groups (pp splits at the group boundary) and the split follows them
    plan = doc["plan"]
    assert sorted(doc["cluster"]["groups"], key=str) and plan["pp"] >= 2
    assert sorted(plan.get("group_order", [0, 1])) == [0, 1]


def test_the_table_shows_where_the_stages_run(searched):
    out = searched[1]
    assert "stages on" in out and "A100:" in out and "H100:" in out
    assert "proven optimal under the cost model" in out
    groups = [line for line in out.splitlines() if line.startswith("groups")]
    assert any("on 4x8xH100-SXM5-80GB" in line for line in groups)
    assert any("batch shares" in line for line in groups)


def test_predict_takes_a_group_order(capsys):
    base = ["predict", *MIXED, "--dp", "2", "--tp", "2", "--pp", "8", "--cp", "2", "--zero", "1"]
    assert main(base + ["--group-order", "1,0", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["plan"]["group_order"] == [1, 0] and doc["estimate"]["rank_groups"] == [1] * 4 + [0] * 4


@pytest.mark.parametrize("flag", ["--group-order", "--group-mbs"])
def test_a_mixed_cluster_s_flag_on_one_group_names_the_flag(flag, capsys):
    assert main(["predict", "--model", "llama-7b", "--cluster", "1x8xH100", flag, "1,3"]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{flag} would be ignored: it is for a mixed cluster (groups joined by +), and 1x8xH100 has one group" in err


@pytest.mark.parametrize("args,message", [
    (["--group-order", "0,0"], "is not an order of the cluster's 2 groups"),
    (["--pp", "1", "--dp", "1", "--tp", "8", "--cp", "8"], "a data-parallel replica spans two device groups"),
    (["--pp", "8", "--group-mbs", "1,3"], "uneven batch shares need pp = 1"),
    (["--pp", "1", "--dp", "8", "--tp", "8", "--group-order", "1,0"], "--group-order would be ignored: it orders"),
])
def test_a_plan_that_cannot_be_placed_is_one_line(args, message, capsys):
    base = {"--dp": "2", "--tp": "2", "--pp": "8", "--cp": "2", "--zero": "1"}
    base.update(dict(zip(args[::2], args[1::2])))
    assert main(["predict", *MIXED, *[x for kv in base.items() for x in kv]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_report_shows_the_placement_and_the_slowest_rank(mixed_plan, tmp_path, capsys):
    assert main(["report", str(mixed_plan), "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "index.md").read_text()
    assert "in 2 groups (4x8xA100-SXM4-80GB+4x8xH100-SXM5-80GB)" in md
    assert "Placement on the device groups" in md and "Batch shares:" in md
    assert "(slowest)" in md and "| A100 |" in md and "| H100 |" in md


def test_exports_and_local_runs_are_refused_in_one_line(mixed_plan, capsys):
    for argv in (["export", str(mixed_plan), "--to", "megatron"], ["run", str(mixed_plan)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "mixed cluster" in err[0], argv


def test_the_launch_keeps_node_ranks_in_group_order(mixed_plan, capsys):
    assert main(["run", str(mixed_plan), "--print-launch"]) == 0
    out = capsys.readouterr().out
    assert "sbatch" not in out and "--rdzv-backend=c10d" not in out
    order = json.loads(mixed_plan.read_text())["plan"].get("group_order", [0, 1])
    first = ["A100-SXM4-80GB", "H100-SXM5-80GB"][order[0]]
    assert f"# host 0 ({first} node)" in out and "--node-rank=7" in out and "--master-addr=" in out


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["plan"].__setitem__("group_order", [0, 5]), "group_order [0, 5] is not an order"),
    (lambda d: d["cluster"]["groups"][1].__setitem__("device", "Z9"), "cluster: groups[1]: unknown device 'Z9'"),
    (lambda d: d["cluster"]["groups"][1].__setitem__("num_nodes", -4), "groups[1]: num_nodes must be a positive"),
    (lambda d: d["cluster"].__setitem__("num_nodes", 9), "num_nodes and device must be the groups' total"),
    (lambda d: d["cluster"].__setitem__("group_link_bytes_per_s", -1), "needs a positive bandwidth"),
    (lambda d: d["cluster"].__setitem__("groups", d["cluster"]["groups"][:1]), "needs groups (a list of two or more)"),
], ids=["order", "device", "nodes", "total", "link", "one-group"])
def test_a_bad_mixed_plan_file_names_the_field(mixed_plan, tmp_path, capsys, mutate, message):
    doc = json.loads(mixed_plan.read_text())
    mutate(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    assert main(["predict", "--plan", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_predict_takes_each_group_s_micro_batch_size(tmp_path, capsys):
    """Replicas on groups (--pp 1): each group's micro-batch size, shown with its share, the
    step of each group, and a plan file that reads back the same."""
    path = tmp_path / "shares.json"
    args = ["predict", "--model", "llama3-8b", "--cluster", "2x8xA100+2x8xH100", "--pp", "1", "--tp", "2", "--cp", "4",
            "--zero", "1", "--group-mbs", "1,3"]
    assert main(args + ["--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert "mbs1/3x64" in out and "micro-batch 3 x 64 = 192 sequences each, 75% of the batch" in out
    assert "step per group: A100" in out and "(slowest)" in out
    assert json.loads(path.read_text())["plan"]["micro_batch_sizes"] == [1, 3]
    assert main(["predict", "--plan", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [s["micro_batch_size"] for s in doc["estimate"]["group_shares"]] == [1, 3]


def test_nothing_fits_without_a_pipeline_names_the_closest_plan(capsys):
    """--fix pp=1 on a mixed cluster is the replicas-on-groups space: where nothing fits, the
    message is the closest plan of it, not a claim that pp=1 is impossible."""
    assert main(["search", "--model", "llama3-405b", "--cluster", "1x8xA100+1x8xH100", "--fix", "pp=1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing fits: the closest plan (" in err[0] and " pp1 " in err[0]
    assert main(["search", "--model", "llama3-8b", "--cluster", "1x8xA100+1x8xH100", "--fix", "pp=1",
                 "--fix", "tp=16"]) == 2
    err = capsys.readouterr().err
    assert "tp=16 is not possible" in err and "pp=1 is not possible" not in err
