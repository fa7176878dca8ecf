import json
import os
import re
import tomllib
from pathlib import Path

import pytest

from costmodel.check import check_plan
from costmodel.estimate import memory_per_rank
from costmodel.groups import rank_views
from costmodel.hardware import PROFILE_FORMAT_VERSION, known_profiles, parse_cluster
from costmodel.placement import axis_span
from costmodel.plan import PlanFile
from costmodel.schedules import Schedule
from costmodel.units import GIB
from planner.space import Choice, build_plan

PROFILES = Path(__file__).resolve().parents[2] / "profiles"


def test_plan_file_round_trip(tmp_path, llama70b, a100_64, train_4k):
    plan = build_plan(llama70b, train_4k, a100_64, Choice(tp=8, pp=4, vpp=2))
    path = tmp_path / "plan.json"
    PlanFile(plan=plan, model=llama70b, train=train_4k, cluster=a100_64).save(path)
    loaded = PlanFile.load(path)
    assert loaded.plan == plan and loaded.model == llama70b and loaded.train == train_4k
    assert loaded.cluster.name == a100_64.name


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["plan"].update(extra=1), "unknown keys"),
    (lambda d: d["plan"].pop("vpp"), "missing keys"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d["model"].update(bogus=True), "unknown keys"),
    (lambda d: d["plan"].update(schedule="round-robin"), "round-robin"),
])
def test_plan_file_is_loaded_strictly(tmp_path, llama70b, a100_64, train_4k, mutate, message):
    plan = build_plan(llama70b, train_4k, a100_64, Choice(tp=8))
    doc = PlanFile(plan=plan, model=llama70b, train=train_4k, cluster=a100_64).to_dict()
    mutate(doc)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        PlanFile.load(path)


def test_cluster_strings():
    c = parse_cluster("8x8xA100")
    assert (c.num_nodes, c.devices_per_node, c.world_size, c.device.name) == (8, 8, 64, "A100-SXM4-80GB")
    assert parse_cluster(f"1x2x{PROFILES / 'xeon-amx.toml'}").device.name == "xeon-amx"
    for bad in ("8xA100", "axbxA100", "0x8xA100", "8x8x"):
        with pytest.raises(ValueError, match="malformed cluster"):
            parse_cluster(bad)
    with pytest.raises(ValueError, match="unknown device 'Z80'.*H100-SXM5-80GB"):
        parse_cluster("1x8xZ80")
    # a device count without nodes: the same devices in nodes of the device's NVLink domain
    with pytest.raises(ValueError, match="; 2048 H100 are 256x8xH100$"):
        parse_cluster("2048xH100")
    with pytest.raises(ValueError, match=r"\(4x8xA100\+4x8xH100\)$"):
        parse_cluster("12xA100")   # not a whole number of 8-GPU nodes: no hint


def test_every_profile_number_cites_its_source():
    """Each numeric datasheet line carries a comment; efficiencies say how they were obtained."""
    for path in sorted(PROFILES.glob("*.toml")):
        raw = tomllib.loads(path.read_text())
        assert raw["efficiency"]["source"], path
        section = None
        for line in path.read_text().splitlines():
            if line.startswith("["):
                section = line
            number = re.match(r"^\s*\w+\s*=\s*[\d{]", line)
            if number and section in ("[device]", "[[network]]"):
                assert "#" in line, f"{path.name}: no source for: {line}"
    assert {"A100-SXM4-40GB", "A100-SXM4-80GB", "H100-SXM5-80GB", "H100-HBM2e-96GB", "H200-SXM-141GB", "B200",
            "V100-SXM2-32GB", "xeon-amx"} <= set(known_profiles())


def test_placement_tp_inside_node_dp_across():
    order, degrees = ("pp", "dp", "cp", "tp"), (4, 2, 1, 8)
    tp = axis_span(order, degrees, "tp", 8)
    dp = axis_span(order, degrees, "dp", 8)
    assert (tp.members_per_node, tp.num_nodes) == (8, 1)
    assert (dp.members_per_node, dp.num_nodes) == (1, 2)


@pytest.mark.parametrize("choice,message", [
    (Choice(tp=16, dp=4), "tp=16 does not divide the model's num_kv_heads"),
    (Choice(tp=8, pp=4, vpp=2, schedule=Schedule.ONE_F_ONE_B), "runs one stage per rank"),
    (Choice(tp=8, pp=4, vpp=2, micro_batch_size=256), "divisible by pp"),
    (Choice(tp=8, pp=3, dp=1), "does not equal the cluster's 64 devices"),
])
def test_check_plan_names_the_problem(llama70b, a100_64, train_4k, choice, message):
    try:
        plan = build_plan(llama70b, train_4k, a100_64, choice)
    except ValueError as exc:
        assert re.search(message, str(exc)) or "does not" in str(exc)
        return
    assert any(re.search(message, p) for p in check_plan(llama70b, train_4k, a100_64, plan))


def test_plan_over_memory_says_by_how_much(llama70b, a100_64, train_4k):
    plan = build_plan(llama70b, train_4k, a100_64, Choice(tp=1, pp=1, zero_stage=0))
    problems = check_plan(llama70b, train_4k, a100_64, plan)
    assert problems and re.search(r"stage 0 needs [\d.]+ GiB per device, [\d.]+ GiB over", problems[0])


def test_a_deep_pipeline_over_memory_is_one_line_naming_the_worst_stage(llama70b, a100_64, train_4k):
    plan = build_plan(llama70b, train_4k, a100_64, Choice(tp=1, pp=8, zero_stage=0))
    problems = check_plan(llama70b, train_4k, a100_64, plan)
    worst = max(m.total_bytes - v.memory_budget_bytes
                for m, v in zip(memory_per_rank(llama70b, train_4k, a100_64, plan), rank_views(plan, a100_64)))
    assert len(problems) == 1 and "of 8 pipeline stages are over" in problems[0]
    assert f"{worst / GIB:.1f} GiB over" in problems[0]


def test_a_profile_with_a_misspelt_or_cut_key_is_one_line(tmp_path, capsys):
    from planner.cli import main
    text = (PROFILES / "A100-SXM4-80GB.toml").read_text()
    for name, body, why in (("typo.toml", text.replace("\ngemm =", "\ngemm_efficiency =", 1), "unknown key(s) gemm_efficiency"),
                            ("cut.toml", text[: len(text) // 3] + "\n[efficiency\n", "truncated"),
                            ("new.toml", f"format_version = {PROFILE_FORMAT_VERSION + 1}\n" + text,
                             f"format version {PROFILE_FORMAT_VERSION + 1}")):
        (tmp_path / name).write_text(body)
        assert main(["predict", "--model", "llama2-7b", "--cluster", f"1x8x{tmp_path / name}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and why in err and name in err


def test_a_third_network_tier_is_a_profile_change(tmp_path):
    """A rack tier between node and cluster prices the groups it spans, and only those."""
    from costmodel.comm import Collective, collective_time_s
    from costmodel.placement import AxisSpan
    text = (PROFILES / "A100-SXM4-80GB.toml").read_text()
    rack = ('\n[[network]]\nscope = "rack"\nname = "leaf switch"\nmax_nodes = 4\n'
            'bandwidth_bytes_per_s = 100e9  # a test figure\nlatency_s = 5e-6\n')
    (tmp_path / "racked.toml").write_text(text + rack)
    plain, racked = parse_cluster("16x8xA100"), parse_cluster(f"16x8x{tmp_path / 'racked.toml'}")
    assert racked.device.middle_tiers[0].max_nodes == 4
    within, across = AxisSpan(size=32, members_per_node=8, num_nodes=4), AxisSpan(size=64, members_per_node=8, num_nodes=8)
    t = lambda c, span: collective_time_s(Collective.ALL_REDUCE, 1e9, span, c)  # noqa: E731
    assert t(racked, within) < t(plain, within)        # the rack's faster links
    assert t(racked, across) == t(plain, across)       # beyond the rack: the cluster tier, as before
    (tmp_path / "bad.toml").write_text(text + rack.replace("max_nodes = 4\n", ""))
    with pytest.raises(ValueError, match="max_nodes"):
        parse_cluster(f"16x8x{tmp_path / 'bad.toml'}")


def test_a_cpu_profile_s_ram_is_divided_among_the_cluster_s_ranks_per_node():
    """xeon-amx's 12 GiB is half the machine's RAM (memory_ranks 2): one rank has all of it,
    four a quarter each; a GPU's memory is its own whatever the count."""
    from costmodel.hardware import parse_cluster
    shares = {n: parse_cluster(f"1x{n}xxeon-amx").device.memory_bytes for n in (1, 2, 4)}
    assert shares[1] == 2 * shares[2] == 4 * shares[4] == 24 * 2**30
    assert parse_cluster("1x4xH100").device.memory_bytes == parse_cluster("1x8xH100").device.memory_bytes


def test_memory_ranks_belong_to_a_cpu(tmp_path):
    from costmodel.hardware import load_profile
    from costmodel.inputs import UserError
    text = (Path(__file__).parents[2] / "profiles" / "A100-SXM4-80GB.toml").read_text()
    bad = tmp_path / "gpu.toml"
    bad.write_text(text.replace("[device]\n", "[device]\nmemory_ranks = 2\n", 1))
    with pytest.raises(UserError, match="memory_ranks = 2 is out of range"):
        load_profile(bad)


def test_a_profile_rewritten_in_place_is_read_as_it_now_is(tmp_path):
    """Profiles are parsed once per text (costmodel.hardware.profile_io.parse_profile): the same
    path with other text is parsed again, and a refused text stays refused however often it is read."""
    from costmodel.hardware import load_profile
    from costmodel.inputs import UserError
    text = (PROFILES / "A100-SXM4-80GB.toml").read_text()
    path = tmp_path / "edited.toml"
    path.write_text(text)
    before = load_profile(path).efficiency.gemm
    path.write_text(re.sub(r"\ngemm = [0-9.]+", "\ngemm = 0.5", text, count=1))
    assert load_profile(path).efficiency.gemm == 0.5 != before
    path.write_text(text.replace("[device]\n", "[device]\nmemory_ranks = 2\n", 1))
    for _ in range(2):
        with pytest.raises(UserError, match="memory_ranks = 2 is out of range"):
            load_profile(path)
    path.write_text(text)
    assert load_profile(path).efficiency.gemm == before


def test_a_plan_file_keeps_the_cpu_ram_division(tmp_path):
    """The division is the cluster's, whichever path builds it: a saved plan read back too."""
    from planner.cli import main
    out = tmp_path / "p4.json"
    assert main(["predict", "--model", "debug-small", "--cluster", "1x4xxeon-amx", "--dtype", "fp32",
                 "--out", str(out)]) == 0
    assert PlanFile.load(out).cluster.device.memory_bytes == 6 * 2**30


def test_only_megatron_core_runs_stages_that_hold_the_embedding_or_the_loss_alone(train_4k):
    """32 layers + the embedding and the loss on pp 2 x vpp 17: one unit a virtual stage, the
    first and the last without a layer (Megatron-Core's account-for-embedding/loss split). Other
    frameworks need a layer in every stage, and Megatron-Core too anywhere but at the ends."""
    from dataclasses import replace

    from costmodel.frameworks import FRAMEWORKS
    from costmodel.hardware import run_by
    from costmodel.registry import resolve_model
    model, cluster = resolve_model("llama3-8b"), parse_cluster("1x8xH100")
    plan = build_plan(model, train_4k, cluster, Choice(tp=4, pp=2, vpp=17, zero_stage=1))
    assert plan.layers_per_stage == (0,) + (1,) * 32 + (0,)
    assert check_plan(model, train_4k, run_by(cluster, FRAMEWORKS["megatron-core"]), plan) == []
    assert any("needs at least one layer under planner" in p for p in check_plan(model, train_4k, cluster, plan))
    middle_empty = replace(plan, layers_per_stage=(1,) * 16 + (0,) + (1,) * 16 + (0,))
    assert any("needs at least one layer" in p
               for p in check_plan(model, train_4k, run_by(cluster, FRAMEWORKS["megatron-core"]), middle_empty))
    # an explicit layout's last stage holding the loss alone (Megatron-Bridge's DeepSeek-V3: ...|mL)
    two = build_plan(model, train_4k, cluster, Choice(tp=4, pp=2, zero_stage=1))
    loss_alone = replace(two, layers_per_stage=(32, 0))
    assert check_plan(model, train_4k, run_by(cluster, FRAMEWORKS["megatron-core"]), loss_alone) == []
    assert any("needs at least one layer" in p for p in check_plan(model, train_4k, cluster, loss_alone))


def test_one_unit_a_chunk_is_an_interleaving_only_where_the_ends_may_hold_no_layer():
    from costmodel.plan import embedding_loss_split, virtual_stage_options
    assert 3 not in virtual_stage_options(94, 32)
    assert 3 in virtual_stage_options(94, 32, empty_ends=True)   # the model zoo's Qwen3-235B
    assert embedding_loss_split(94, 96) == (0,) + (1,) * 94 + (0,)
    # Llama 3.1 405B on pp 8: 2, 4 and 8 chunks of equal units, and 16 of one
    assert virtual_stage_options(126, 8) == [2, 4, 8] and virtual_stage_options(126, 8, empty_ends=True) == [2, 4, 8, 16]


def test_an_mtp_module_counts_as_a_unit_of_the_last_chunk():
    """DeepSeek-V3's 61 layers split equally on no pp x vpp that divides a power of two, until its
    MTP module counts beside the embedding and the loss: 64 units, NVIDIA's H100 layout
    "Et|(tt|)*30mL" on pp 8 x vpp 4 (and --ep-overlap, which needs an interleaving, has a space)."""
    from costmodel.plan import virtual_stage_options
    assert virtual_stage_options(61, 8, empty_ends=True) == []
    # two units a chunk leave the last chunk the MTP module and the loss alone: an empty end
    assert virtual_stage_options(61, 8, empty_ends=True, mtp_depth=1) == [2, 4]
    assert virtual_stage_options(61, 8, mtp_depth=1) == [2]
    assert virtual_stage_options(61, 16, mtp_depth=1) == []
    assert virtual_stage_options(61, 16, empty_ends=True, mtp_depth=1) == [2]


def test_a_user_profile_given_relative_is_written_absolute(tmp_path, monkeypatch):
    """A plan made with `--cluster 1x8xmy.toml` in one directory loads from any other."""
    from costmodel.hardware.clusters import cluster_from_dict, parse_cluster
    text = (Path(__file__).resolve().parents[2] / "profiles" / "A100-SXM4-80GB.toml").read_text()
    (tmp_path / "my.toml").write_text(text.replace('name = "A100-SXM4-80GB"', 'name = "my-gpu"', 1)
                                      .replace('aliases = ["A100", "A100-80GB"]', "aliases = []", 1))
    monkeypatch.chdir(tmp_path)
    written = parse_cluster("1x8xmy.toml").to_dict()
    assert written["device"] == os.path.join(os.getcwd(), "my.toml")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert cluster_from_dict(written).device.name == "my-gpu"
