"""Every fitted efficiency of a shipped GPU profile has a published range with its source
([ranges]), and lies inside it, away from its bounds: a value pinned at a bound, or outside,
means the fit hides a mechanism the model lacks."""
from __future__ import annotations

from pathlib import Path

import pytest

from costmodel.hardware import FITTED_PARAMS, known_profiles, load_profile, range_problems
from costmodel.inputs import UserError

# the fit's values (scripts/fit_published.py): one set for the A100 chip (40 and 80 GB, and the A800), one
# for the H100 chip (SXM5, the HBM2e part and the H800) that the H200 and the Blackwells borrow (Blackwell's
# attention is published)
FITTED = ("A100-SXM4-40GB", "A100-SXM4-80GB", "A800-SXM4-80GB", "H100-SXM5-80GB", "H100-HBM2e-96GB", "H800-SXM5-80GB",
          "H200-SXM-141GB", "B200", "GB200", "B300", "GB300")
PROFILES = known_profiles()


@pytest.mark.parametrize("name", FITTED)
def test_every_fitted_value_has_a_published_range(name):
    ranges = dict(PROFILES[name].ranges)
    assert set(ranges) == set(FITTED_PARAMS)
    for r in ranges.values():
        assert r.low <= r.high and len(r.source) > 40   # a citation, not a word


def test_the_a100s_share_their_ranges():
    assert PROFILES["A100-SXM4-40GB"].ranges == PROFILES["A100-SXM4-80GB"].ranges


def test_the_h100_parts_are_one_chip_to_the_fit():
    """The 96 GB HBM2e H100 at 500 W is the H100 SXM5's die: the fit groups their rows as one chip
    (planner.measure.fit.chip) and both profiles hold that chip's ranges and fitted values; what
    differs is stated apart: the clock it sustains at 500 W (its peak), its memory, its network."""
    from costmodel.hardware import parse_cluster
    from planner.measure.fit import chip, current_values
    sxm, hbm2e = (parse_cluster(f"1x8x{name}") for name in ("H100-SXM5-80GB", "H100-HBM2e-96GB"))
    assert chip(sxm) == chip(hbm2e) == "H100"
    assert hbm2e.device.ranges == sxm.device.ranges
    assert current_values(hbm2e) == current_values(sxm)
    assert hbm2e.device.peak_flops_per_s["bf16"] < 0.9 * sxm.device.peak_flops_per_s["bf16"]
    assert hbm2e.device.num_sms == sxm.device.num_sms and hbm2e.device.tp_comm_gemm_overlap


@pytest.mark.parametrize("cut,full", [("A800-SXM4-80GB", "A100-SXM4-80GB"), ("H800-SXM5-80GB", "H100-SXM5-80GB")])
def test_the_export_parts_are_their_die_with_nvlink_cut(cut, full):
    """The A800 and H800 are the A100 and H100 dies with NVLink cut to 400 GB/s both ways: one chip
    to the fit, the same ranges and fitted values; the node's NVLink is the one figure that differs."""
    from costmodel.hardware import parse_cluster
    from planner.measure.fit import chip, current_values
    a, b = (parse_cluster(f"1x8x{name}") for name in (cut, full))
    assert chip(a) == chip(b)
    assert a.device.ranges == b.device.ranges and current_values(a) == current_values(b)
    assert a.device.intra_node.bandwidth_bytes_per_s == 200e9 < b.device.intra_node.bandwidth_bytes_per_s
    assert a.device.peak_flops_per_s == b.device.peak_flops_per_s
    assert a.device.memory_bandwidth_bytes_per_s == b.device.memory_bandwidth_bytes_per_s


def test_the_gb200_is_the_b200_chip_at_a_higher_clock_in_a_rack_wide_nvlink_domain():
    """The GB200's GPU is the B200's chip at 1,200 W: the fit's values and Blackwell's published
    attention as the B200 has them, a higher peak, more memory, and its NVLink across a rack (a
    node of the cluster is the NVLink domain: 64 or 72 GPUs)."""
    from costmodel.hardware import parse_cluster
    from planner.measure.fit import KEEPS, chip, current_values
    gb, b = parse_cluster("4x64xGB200"), parse_cluster("32x8xB200")
    assert chip(gb) == chip(b) == "H100" and KEEPS["GB200"] == KEEPS["B200"]
    assert current_values(gb) == pytest.approx(current_values(b), rel=2e-3)
    assert gb.device.peak_flops_per_s["bf16"] > b.device.peak_flops_per_s["bf16"]
    assert gb.device.usable_memory_bytes > b.device.usable_memory_bytes
    assert gb.device.intra_node.bandwidth_bytes_per_s == b.device.intra_node.bandwidth_bytes_per_s
    assert (gb.devices_per_node, gb.num_nodes) == (64, 4)


def test_nodes_larger_than_any_nvlink_domain_of_the_device_are_said_to_be_priced_as_one():
    """An HGX H100 joins 8 GPUs on NVLink: 64 to a node would be priced as one NVLink domain, which no
    H100 system has; nodes of 8 or fewer, and a GB200 rack's 64, are what systems have."""
    from costmodel.hardware import parse_cluster
    assert parse_cluster("1x64xH100").node_note == (
        "H100-SXM5-80GB's NVLink joins at most 8 devices; nodes of 64 are priced as one NVLink domain, which "
        "no H100-SXM5-80GB system has (e.g. 8x8xH100-SXM5-80GB)")
    assert not any(parse_cluster(c).node_note for c in ("1x8xH100", "4x4xH100", "2x8xB300", "1x64xGB200"))
    assert all(p.nvlink_domain_devices for p in PROFILES.values() if p.kind == "gpu")


def test_gb200_nodes_smaller_than_the_nvlink_domain_are_said_to_be_priced_as_trays(capsys):
    """A GB200 cluster written as its 4-GPU trays prices them joined by InfiniBand, which the rack's
    NVLink joins: one line on stderr says so and names the layout that is the domain; a rack's 64 of
    72 GPUs (NVIDIA's multi-rack runs), one node, or a GPU without such a domain say nothing."""
    from costmodel.hardware import parse_cluster
    from planner.cli import main
    assert parse_cluster("64x4xGB200").node_note.endswith("(a node here is the NVLink domain: e.g. 4x64xGB200)")
    assert not any(parse_cluster(c).node_note for c in ("4x64xGB200", "1x8xGB200", "2x36xGB200", "32x8xB200"))
    assert main(["predict", "--model", "llama3-8b", "--cluster", "2x4xGB200", "--tp", "1", "--mbs", "1"]) == 0
    err = capsys.readouterr().err
    assert "planner predict: note: GB200's NVLink joins up to 72 devices across hosts; nodes of 4" in err
    assert "e.g. 1x8xGB200" in err


@pytest.mark.parametrize("param", FITTED_PARAMS)
@pytest.mark.parametrize("name", FITTED)
def test_fitted_values_lie_inside_their_ranges(name, param):
    dev = PROFILES[name]
    assert not [p for p in range_problems(dev) if f" {param} = " in p]


RATES = {"memory": lambda d: d.efficiency.memory * d.memory_bandwidth_bytes_per_s,
         "attention": lambda d: d.efficiency.attention * d.peak_flops_per_s["bf16"],
         "gemm": lambda d: d.efficiency.gemm * d.peak_flops_per_s["bf16"]}


@pytest.mark.parametrize("newer,older", [("H100-SXM5-80GB", "A100-SXM4-80GB"), ("B200", "H100-SXM5-80GB")])
@pytest.mark.parametrize("rate", list(RATES))
def test_a_newer_chip_is_faster_at_each_rate(newer, older, rate):
    assert RATES[rate](PROFILES[newer]) > RATES[rate](PROFILES[older])


@pytest.mark.parametrize("entry,message", [
    ('gemm_typo = { low = 0.1, high = 0.2, source = "x" }', "ranges.gemm_typo: not a fitted efficiency"),
    ('gemm = { low = 0.9, high = 0.2, source = "a source" }', "ranges.gemm: needs 0 <= low <= high"),
    ('gemm = { low = 0.1, high = 0.2 }', "ranges.gemm: expected { low = L, high = H, source"),
])
def test_a_bad_range_names_the_file_and_field(tmp_path, entry, message):
    text = Path(PROFILES["H100-SXM5-80GB"].path).read_text()
    head, _, _ = text.partition("\n[ranges]")
    bad = tmp_path / "bad.toml"
    bad.write_text(head + "\n[ranges]\n" + entry + "\n")
    with pytest.raises(UserError, match="bad.toml: " + message.replace("{", r"\{").replace("(", r"\(")):
        load_profile(bad)


def test_a_borrowed_gemm_fraction_keeps_the_lender_s_share_of_the_chip_s_best_matmul():
    """The GEMM fraction fitted on the H100 chip's rows reaches the B200 and GB200 scaled by their best
    matmuls against the H100's (the MAMF table): their GEMMs run at the H100's share of what each chip's
    best matmul reaches, so the GB200's higher peak at 1,200 W buys what its matmuls show (1,822 against
    the B200's 1,745 TFLOPS), not its peak's 11 %. A chip whose figure is unpublished (the H800, the GB300
    at 1,400 W) keeps the value."""
    from costmodel.hardware import parse_cluster
    from planner.measure.fit import current_values, gemm_scale, with_values
    h100, b200, gb200, h800, b300, gb300 = (parse_cluster(c) for c in ("1x8xH100", "1x8xB200", "1x64xGB200",
                                                                        "1x8xH800", "1x8xB300", "1x64xGB300"))
    assert gemm_scale(h100) == gemm_scale(h800) == gemm_scale(gb300) == 1.0
    assert gemm_scale(gb200) == pytest.approx(0.729 / 0.803)
    for cluster in (b200, gb200, b300, gb300):   # the shipped value is the chip's, scaled
        assert cluster.device.efficiency.gemm == pytest.approx(h100.device.efficiency.gemm * gemm_scale(cluster), abs=1e-3)
    best = {c: c.device.efficiency.gemm * c.device.peak_flops_per_s["bf16"] for c in (b200, gb200)}
    assert best[gb200] / best[b200] == pytest.approx(1822 / 1745, rel=3e-3)
    fitted = {**current_values(h100), "gemm": 0.7}
    assert with_values(gb200, fitted).device.efficiency.gemm == pytest.approx(0.7 * 0.729 / 0.803)
    assert current_values(with_values(gb200, fitted))["gemm"] == pytest.approx(0.7)
