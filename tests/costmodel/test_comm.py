"""Collective times across nodes: NCCL's ring latency over every rank, and its tree for
small all-reduces (costmodel.comm; NCCL src/graph/tuning.cc)."""
from dataclasses import replace

import pytest

from costmodel.comm import Collective, all_reduce_algorithms_s, collective_time_s
from costmodel.hardware import parse_cluster
from costmodel.placement import AxisSpan

CLUSTER = parse_cluster("64x8xH100")
INTRA, INTER = CLUSTER.device.intra_node, CLUSTER.device.inter_node
BASE = max(INTRA.base_latency_s, INTER.base_latency_s)   # once per collective (NCCL's base latency)


def latency_s(kind: Collective, span: AxisSpan) -> float:
    """The byte-independent part: time is affine in the buffer's size."""
    one, two = (collective_time_s(kind, b, span, CLUSTER) for b in (1e6, 2e6))
    return one - (two - one)


@pytest.mark.parametrize("kind", [Collective.ALL_GATHER, Collective.REDUCE_SCATTER])
def test_a_ring_across_nodes_pays_a_step_per_rank(kind):
    """512 ranks on 64 nodes: the base latency and 511 steps, 63 of them across nodes; the in-node
    part of each node is walked on every node, not once (walked once, the latency would grow with
    the nodes only)."""
    assert BASE > 0
    span = AxisSpan(size=512, members_per_node=8, num_nodes=64)
    expected = BASE + (511 - 63) * INTRA.latency_s + 63 * INTER.latency_s
    assert latency_s(kind, span) == pytest.approx(expected, rel=1e-6)
    small = AxisSpan(size=128, members_per_node=8, num_nodes=16)
    assert latency_s(kind, small) == pytest.approx(BASE + (127 - 15) * INTRA.latency_s + 15 * INTER.latency_s,
                                                   rel=1e-6)


def test_an_all_reduce_across_nodes_takes_the_tree_for_small_buffers_and_the_ring_for_large():
    """NCCL's tuner: the tree's 2 (in-node steps + floor(log2 nodes)) steps against the ring's
    twice n-1, at 0.92 of the ring's bandwidth. A small buffer takes the tree, 10 GB the ring."""
    span = AxisSpan(size=512, members_per_node=8, num_nodes=64)
    tree = BASE + 2 * (7 * INTRA.latency_s + 6 * INTER.latency_s)
    ring = BASE + 2 * ((511 - 63) * INTRA.latency_s + 63 * INTER.latency_s)
    assert tree < ring and latency_s(Collective.ALL_REDUCE, span) == pytest.approx(tree, rel=1e-6)
    ring_s, tree_s = all_reduce_algorithms_s(10e9, span, CLUSTER)
    assert ring_s < tree_s and collective_time_s(Collective.ALL_REDUCE, 10e9, span, CLUSTER) == ring_s
    # 48 nodes: NCCL's log2i rounds down (5 network steps, not 6)
    odd = AxisSpan(size=384, members_per_node=8, num_nodes=48)
    assert latency_s(Collective.ALL_REDUCE, odd) == pytest.approx(BASE + 2 * (7 * INTRA.latency_s + 5 * INTER.latency_s))
    one_per_node = AxisSpan(size=2, members_per_node=1, num_nodes=2)
    assert latency_s(Collective.ALL_REDUCE, one_per_node) == pytest.approx(BASE + 2 * INTER.latency_s, rel=1e-6)


def test_a_group_uneven_over_its_nodes_pays_a_step_per_rank_it_has():
    """12 ranks as 8 + 4 on two nodes (members_per_node is the largest count): 11 steps, 1 across."""
    span = AxisSpan(size=12, members_per_node=8, num_nodes=2)
    assert latency_s(Collective.ALL_GATHER, span) == pytest.approx(BASE + 10 * INTRA.latency_s + INTER.latency_s)


def test_the_bandwidth_part_stays_hierarchical():
    """Doubling the buffer adds the in-node ring's and the 1/m shard's inter-node transfer, both:
    the published runs' collectives move slower than nccl-tests' peak, where NCCL pipelines the
    two (costmodel.comm._cross_node_transfer_s)."""
    span = AxisSpan(size=64, members_per_node=8, num_nodes=8)
    extra = (collective_time_s(Collective.ALL_GATHER, 2e9, span, CLUSTER)
             - collective_time_s(Collective.ALL_GATHER, 1e9, span, CLUSTER))
    expected = 7 / 8 * 1e9 / INTRA.effective_bandwidth_bytes_per_s + 7 / 8 * 1e9 / 8 / INTER.effective_bandwidth_bytes_per_s
    assert extra == pytest.approx(expected, rel=1e-9)
    assert collective_time_s(Collective.ALL_GATHER, 0.0, span, CLUSTER) == 0.0


def _ring_samples(alphas: dict[str, float], betas: dict[str, float], world: int = 2) -> dict:
    """Microbenchmark samples as collective_worker writes them, each kind from its own alpha-beta."""
    out = {"p2p": [(8.0, 5e-5)] * 4}
    for kind, a in alphas.items():
        passes = 2 if kind == "all_reduce" else 1
        out[kind] = [(b, passes * (world - 1) * (a + b / world / betas[kind])) for b in (1e3, 1e4, 1e5, 1e6, 4e6)]
    return out


def test_each_collective_kind_keeps_its_own_measured_speed():
    """gloo's reduce-scatter runs at about twice its all-gather's latency and half its bandwidth:
    one alpha-beta pair over all kinds priced both at a mean. kind_factors gives each kind its own
    fit over the joint one, and a tier holding them prices each kind as measured."""
    from costmodel.comm import fit_alpha_beta, kind_factors, ring_time_s
    alphas = {"all_reduce": 2e-4, "all_gather": 2e-4, "reduce_scatter": 4e-4}
    betas = {"all_reduce": 2e9, "all_gather": 2e9, "reduce_scatter": 1e9}
    samples = _ring_samples(alphas, betas)
    alpha, beta, _, _ = fit_alpha_beta(samples, 2)
    factors = {k: (lat, bw) for k, lat, bw in kind_factors(samples)}
    assert set(factors) == set(alphas)
    tier = replace(INTRA, latency_s=alpha, base_latency_s=0.0, bandwidth_bytes_per_s=beta, efficiency=1.0,
                   kind_factors=tuple((k, lat, bw) for k, (lat, bw) in factors.items()))
    for kind, a in alphas.items():
        assert tier.latency_for(kind) == pytest.approx(a, rel=1e-3)
        assert tier.bandwidth_for(kind) == pytest.approx(betas[kind], rel=1e-3)
        measured = dict(samples[kind])[1e6]
        assert ring_time_s(Collective(kind), 1e6, 2, tier) == pytest.approx(measured, rel=1e-3)
    # a tier without factors (every datasheet profile) prices every kind at its own figures
    assert INTRA.latency_for("reduce_scatter") == INTRA.latency_s
    assert INTRA.bandwidth_for("all_gather") == INTRA.effective_bandwidth_bytes_per_s


def test_a_profiles_kind_factors_are_read_and_checked(tmp_path):
    """kind_factors in a [[network]] table: read onto the tier; an unknown kind or a factor that
    is not positive is refused in one line naming the file and the field."""
    from pathlib import Path

    from costmodel.hardware import load_profile
    from costmodel.inputs import UserError
    text = (Path(__file__).parents[2] / "profiles" / "A100-SXM4-80GB.toml").read_text()
    node = text.index("[[network]]")
    cut = text.index("\nlatency_s", node)

    def with_line(line: str) -> Path:
        path = tmp_path / "k.toml"
        path.write_text(text[:cut] + "\n" + line + text[cut:])
        return path
    dev = load_profile(with_line("kind_factors = {reduce_scatter = {latency = 2.0, bandwidth = 0.5}}"))
    assert dev.intra_node.kind_factors == (("reduce_scatter", 2.0, 0.5),)
    for line, why in (("kind_factors = {all_to_all = {latency = 1.0, bandwidth = 1.0}}", "all_to_all"),
                      ("kind_factors = {all_gather = {latency = 1.0, bandwidth = 0.0}}", "kind_factors.all_gather.bandwidth"),
                      ("kind_factors = {all_gather = {latency = 1.0}}", "kind_factors.all_gather needs exactly"),
                      ("kind_factors = {all_gather = {latency = 1.0, latancy = 2.0, bandwidth = 1.0}}",
                       "kind_factors.all_gather needs exactly"),
                      ("kind_factors = {reduce_scatter = 2.0}", "kind_factors.reduce_scatter needs exactly"),
                      ('kind_factors = {all_gather = {latency = "x", bandwidth = 1.0}}', "are numbers"),
                      ("kind_factors = 1", "not a table of kinds")):
        with pytest.raises(UserError, match=why) as exc:
            load_profile(with_line(line))
        assert "k.toml" in str(exc.value) and "\n" not in str(exc.value)


def test_a_profile_from_before_the_kinds_is_refitted_with_them():
    """A profile written before kind_factors (PROBE_FIT_VERSION 12) holds the microbenchmark
    samples: the probes' refit (planner.measure.probes.unfitted) derives the kinds' factors from them, so
    it prices collectives as a new profile would; a tier that has them keeps its own."""
    import tomllib
    from pathlib import Path

    from costmodel.comm import kind_factors
    from costmodel.hardware import load_profile
    from planner.measure.probes import unfitted
    path = Path(__file__).parents[2] / "benchmarks" / "results" / "cpu-epyc-2026-11-28-DA.toml"
    measured = tomllib.loads(path.read_text())["measured"]
    dev = load_profile(path)
    assert dev.intra_node.kind_factors == ()
    samples = {k: measured[f"collective_{k}"] for k in ("all_reduce", "all_gather", "reduce_scatter", "p2p")}
    derived = unfitted(dev, measured).intra_node.kind_factors
    assert derived == kind_factors(samples)
    rs = dict((k, (lat, bw)) for k, lat, bw in derived)["reduce_scatter"]
    assert rs[0] > 1 and rs[1] < 1   # gloo's reduce-scatter: slower than the joint fit both ways
    own = (("all_gather", 2.0, 0.5),)
    assert unfitted(replace(dev, intra_node=replace(dev.intra_node, kind_factors=own)), measured).intra_node.kind_factors == own


@pytest.mark.parametrize("kind", [Collective.ALL_GATHER, Collective.REDUCE_SCATTER])
def test_one_rank_a_node_gathers_with_pat_where_it_is_faster(kind):
    """NCCL 2.23+ runs PAT for an all-gather or reduce-scatter with one rank a node (tuning.cc:
    8 us, the tree's network latency / 3.5 a doubling of the nodes, 2.8 us a rank, 0.75 of the
    ring's bandwidth): over 512 nodes its latency is 1.5 ms where the ring's 511 network steps
    take 7.2 ms, so it is taken up to large buffers; over 8 nodes a 100 MB buffer, and with 8 ranks
    a node any, goes by the ring. Gloo has no PAT."""
    from costmodel.comm import gather_algorithms_s
    cluster = parse_cluster("512x8xH100")
    span = AxisSpan(size=512, members_per_node=1, num_nodes=512)
    ring, pat = gather_algorithms_s(kind, 1e6, span, cluster)
    transfer = 511 / 512 * 1e6 / INTER.effective_bandwidth_bytes_per_s
    assert pat == pytest.approx(8e-6 + 9 * INTER.latency_s / 3.5 + 512 * 2.8e-6 + transfer / 0.75)
    assert pat < ring and collective_time_s(kind, 1e6, span, cluster) == pat
    huge = 1e12   # transfer-bound: the ring's bandwidth wins
    assert collective_time_s(kind, huge, span, cluster) == gather_algorithms_s(kind, huge, span, cluster)[0]
    eight = AxisSpan(size=8, members_per_node=1, num_nodes=8)
    assert min(gather_algorithms_s(kind, 1e8, eight, cluster)) == gather_algorithms_s(kind, 1e8, eight, cluster)[0]
    dense = AxisSpan(size=4096, members_per_node=8, num_nodes=512)
    assert len(set(gather_algorithms_s(kind, 1e6, dense, cluster))) == 1
    cpu = parse_cluster("4x1xxeon-amx")
    assert len(set(gather_algorithms_s(kind, 1e6, AxisSpan(size=4, members_per_node=1, num_nodes=4), cpu))) == 1


def test_an_in_node_step_of_a_ring_across_nodes_costs_at_least_the_network_s_post_overhead():
    """NCCL charges every step of a ring that crosses nodes at least its network post overhead
    (getNetOverhead x 3 under Simple): 6 us on the AMD hosts of a DGX A100, above NVLink's 3.4 us
    step; 3 us on the Intel hosts of a DGX H100, below it."""
    a100 = parse_cluster("64x8xA100")
    assert a100.device.inter_node.post_overhead_s == 6e-6 and INTER.post_overhead_s == 3e-6
    span = AxisSpan(size=512, members_per_node=8, num_nodes=64)
    one, two = (collective_time_s(Collective.ALL_GATHER, b, span, a100) for b in (1e6, 2e6))
    base = max(a100.device.intra_node.base_latency_s, a100.device.inter_node.base_latency_s)
    assert one - (two - one) == pytest.approx(base + (511 - 63) * 6e-6 + 63 * a100.device.inter_node.latency_s)
    assert latency_s(Collective.ALL_GATHER, span) == pytest.approx(BASE + (511 - 63) * INTRA.latency_s
                                                                    + 63 * INTER.latency_s)
