"""The search is exact under the cost model (its closed-form pipeline): on spaces small enough to enumerate, brute force
over every plan (all degrees, micro-batches, schedules including the ones the search prunes as
dominated, ZeRO stages with and without offloaded states, SP on and off, every mesh order, every layer split, every per-rank
recompute count) finds the same best step time."""
import dataclasses
import itertools

import pytest

from costmodel.check import check_structure
from costmodel.estimate import estimate
from costmodel.groups import group_orders, group_replicas, replica_groups
from costmodel.hardware import DeviceGroup, mixed_cluster, parse_cluster
from costmodel.plan import Plan, Recompute
from costmodel.registry import gpt_spec, llama_spec
from costmodel.schedules import Schedule
from costmodel.specs import TrainSpec
from planner.candidates import replica_counts
from planner.mesh_orders import shards_whole_nodes
from planner.search import SearchOptions, search
from planner.space import divisors


def compositions(total, parts):
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in compositions(total - first, parts - 1):
            yield (first,) + rest


def _distinct_orders(degrees: dict[str, int]) -> list[tuple[str, ...]]:
    """Every mesh order that lays ranks out differently: where an axis of one rank sits in the
    order changes no group, so orders equal but for those are one layout (one representative)."""
    seen: dict[tuple[str, ...], tuple[str, ...]] = {}
    for order in itertools.permutations(("pp", "dp", "cp", "tp")):
        seen.setdefault(tuple(a for a in order if degrees[a] > 1), order)
    return list(seen.values())


ON_DEVICE = [(z, False) for z in range(4)]
OFFLOADED = [(z, True) for z in range(1, 4)]


def brute_force_best(model, train, cluster, states=ON_DEVICE, acts=(False,), group_orders=((),), keep=None):
    """`group_orders`: a mixed cluster's orders of its groups along the ranks (Plan.group_order);
    `keep`: only the plans it accepts (a framework's, planner.targets)."""
    world, best = cluster.world_size, None
    for tp, cp, pp in itertools.product(divisors(world), repeat=3):
        if tp * cp * pp > world or world % (tp * cp * pp):
            continue
        dp = world // (tp * cp * pp)
        if train.global_batch_size % dp:
            continue
        # hybrid sharding's replica counts: the space's own (planner.candidates.replica_counts), every
        # one of them searched exactly
        per_replica = train.global_batch_size // dp
        for ep, mbs, rep in ((e, b, r) for e, b in itertools.product(divisors(dp), divisors(per_replica))
                             for r in replica_counts(model, cluster, SearchOptions(), tp, cp, dp, e, pp)):
            m = train.global_batch_size // dp // mbs
            for vpp, sched in [(1, s) for s in (Schedule.GPIPE, Schedule.ONE_F_ONE_B, Schedule.ZB_H1)] + \
                              [(v, Schedule.INTERLEAVED) for v in (2, 4)]:
                for order in [o for o in _distinct_orders({"pp": pp, "dp": dp, "cp": cp, "tp": tp})
                              if shards_whole_nodes(o, {"pp": pp, "dp": dp, "cp": cp, "tp": tp, "dp_replicate": rep})]:
                    for (zero, offload), act, sp, mode in itertools.product(states, acts, (False, True), list(Recompute)):
                        for layers in compositions(model.num_layers, pp * vpp) if pp * vpp <= model.num_layers else []:
                            base = Plan(dp=dp, tp=tp, pp=pp, cp=cp, zero_stage=zero, recompute=mode,
                                        recompute_num_layers=(0,) * pp, sequence_parallel=sp,
                                        micro_batch_size=mbs, num_micro_batches=m, schedule=sched, vpp=vpp,
                                        layers_per_stage=layers, mesh_axis_order=order, ep=ep,
                                        offload_optimizer=offload, offload_activations=act, dp_replicate=rep)
                            ranges = [range(base.layers_on_rank(r) + 1) if mode is not Recompute.NONE else [0]
                                      for r in range(pp)]
                            for counts, groups in itertools.product(itertools.product(*ranges), group_orders):
                                plan = dataclasses.replace(base, recompute_num_layers=counts, group_order=groups)
                                if keep is None or keep(plan):
                                    best = _better(model, train, cluster, plan, best)
    for plan in _share_plans(model, train, cluster, states, acts) if cluster.is_mixed else ():
        best = _better(model, train, cluster, plan, best)
    return best


def _offloading_best(model, train, cluster):
    """Every plan that offloads something (states, activations or both): what is left once no
    plan fits with everything on the devices, enumerated without those plans a second time."""
    found = [brute_force_best(model, train, cluster, ON_DEVICE, (True,)),
             brute_force_best(model, train, cluster, OFFLOADED, (False, True))]
    return min((f for f in found if f), key=lambda f: f[0], default=None)


def _better(model, train, cluster, plan, best):
    if check_structure(model, train, cluster, plan):
        return best
    est = estimate(model, train, cluster, plan, simulate=False)
    if est.fits and (best is None or est.step_time_s < best[0]):
        return est.step_time_s, plan
    return best


def _share_plans(model, train, cluster, states, acts):
    """A mixed cluster without a pipeline: every layout whose replicas lie in groups, every
    micro-batch size per group that adds up to the global batch, every recompute count."""
    world, batch, L = cluster.world_size, train.global_batch_size, model.num_layers
    for tp, cp in itertools.product(divisors(world), repeat=2):
        if world % (tp * cp):
            continue
        dp = world // (tp * cp)
        for order in _distinct_orders({"pp": 1, "dp": dp, "cp": cp, "tp": tp}):
            probe = Plan(dp=dp, tp=tp, pp=1, cp=cp, zero_stage=0, recompute=Recompute.NONE, recompute_num_layers=(0,),
                         sequence_parallel=False, micro_batch_size=1, num_micro_batches=1,
                         schedule=Schedule.ONE_F_ONE_B, vpp=1, layers_per_stage=(L,), mesh_axis_order=order)
            if None in replica_groups(probe, cluster):
                continue
            replicas = group_replicas(probe, cluster)
            for sizes in itertools.product(range(1, batch + 1), repeat=len(replicas)):
                per = sum(r * s for r, s in zip(replicas, sizes))
                if batch % per:
                    continue
                for (zero, offload), act, sp, mode in itertools.product(states, acts, (False, True), list(Recompute)):
                    for count in range(L + 1) if mode is not Recompute.NONE else [0]:
                        yield dataclasses.replace(probe, zero_stage=zero, offload_optimizer=offload,
                                                  offload_activations=act, sequence_parallel=sp, recompute=mode,
                                                  recompute_num_layers=(count,), micro_batch_size=max(sizes),
                                                  micro_batch_sizes=sizes, num_micro_batches=batch // per)


def _tight(cluster, memory_bytes, host=True):
    """A device of exactly `memory_bytes` for plans: no headroom, no fragmentation margin
    (`host=False`: and nowhere to offload to)."""
    device = dataclasses.replace(cluster.device, memory_bytes=memory_bytes, reported_memory_bytes=memory_bytes,
                                 efficiency=dataclasses.replace(cluster.device.efficiency, allocator_fragmentation=0.0),
                                 host=cluster.device.host if host else None)
    return dataclasses.replace(cluster, device=device, memory_headroom=0.0)


# (model, cluster, global batch, device memory). The caps sit below the unconstrained winner's
# peak (2 GiB reserved + 3.07 MB / 4.74 MB), so memory binds: the Llama case's cap below the
# least any plan without recomputation needs (1.124 MB, found by bisecting brute_force_best's
# cap) and above the least DeepSpeed runs (1.043 MB: test_framework_search), so without
# offloading the optimum recomputes, and ZeRO-3 with full recomputation for the GPT one; at
# these sizes moving the states to the host costs less.
CASES = [
    (llama_spec("tiny-llama", layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, max_pos=64,
                source="test"), "1x4xA100", 4, 2**31 + 1_100_000),
    (gpt_spec("tiny-gpt", layers=4, hidden=64, heads=4, vocab=512, max_pos=64, source="test"),
     "2x2xA100", 4, 2**31 + 2_134_899),
    # a mixture of experts: unconstrained the winner is dp4 ep4 (4.57 MB); at 3.00 MB it is
    # ep4 with full recomputation (expert parallelism is an axis of the space, exactly searched)
    (llama_spec("tiny-moe", layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, max_pos=64,
                source="test", num_experts=4, experts_per_token=2, moe_ffn_hidden_size=128),
     "1x4xA100", 4, 2**31 + 3_000_000),
]


# the least any plan of the Llama case needs with its states on the devices (found by bisecting
# the cap of brute_force_best, and checked by the test at a cap on each side of it): below it,
# only offloaded plans fit (the other cases' caps are above their on-device plans' needs)
OFFLOAD_BELOW = 2**31 + 988_672


@pytest.mark.parametrize("model,cluster_name,batch,memory,host",
                         [*((*c, True) for c in CASES), (*CASES[0], False), (*CASES[0][:3], 2**31 + 970_000, True)],
                         ids=["llama-1x4", "gpt-2x2", "moe-1x4", "llama-1x4-no-host", "llama-1x4-only-offloaded"])
def test_search_matches_brute_force(model, cluster_name, batch, memory, host):
    cluster = _tight(parse_cluster(cluster_name), memory, host)
    train = TrainSpec(seq_len=64, global_batch_size=batch)
    # the search keeps the states on the devices, and offloads them only when nothing fits there
    expected = brute_force_best(model, train, cluster) or (_offloading_best(model, train, cluster) if host else None)
    result = search(model, train, cluster, SearchOptions(top_k=1, max_tp=4))
    assert result.stats.optimal
    if expected is None:
        assert not result.plans
        return
    # exact under the closed-form pipeline the search reasons with (the shown plans are then
    # re-priced by simulation)
    best = min(result.evaluated, key=lambda f: f.estimate.closed_form_step_time_s)
    got = best.estimate.closed_form_step_time_s
    assert got == pytest.approx(expected[0], rel=1e-6), (best.plan.short(), expected[1].short())
    # the cap really binds: the winner recomputes, or keeps its states on the host
    assert best.plan.recompute is not Recompute.NONE or best.plan.offload_optimizer, best.plan.short()
    assert best.plan.offload_optimizer == (memory < OFFLOAD_BELOW)
    assert best.plan.ep > 1 or not model.is_moe


def test_search_is_deterministic():
    model, cluster_name, batch, memory = CASES[0]
    cluster = _tight(parse_cluster(cluster_name), memory)
    train = TrainSpec(seq_len=64, global_batch_size=batch)
    first = search(model, train, cluster, SearchOptions(top_k=3, max_tp=4))
    second = search(model, train, cluster, SearchOptions(top_k=3, max_tp=4))
    assert [f.plan for f in first.plans] == [f.plan for f in second.plans]


def _mixed(memory_a: int, memory_b: int):
    """One node of two A100s and one of two H100s, each device of exactly the given memory, both
    at the H100's per-kernel host cost: this tiny model's kernels are host-bound, and at the
    A100's own cost its layouts would be chosen by that alone (fewer kernels a device: a pipeline)."""
    h100 = _tight(parse_cluster("1x2xH100"), memory_b).device
    a100 = _tight(parse_cluster("1x2xA100"), memory_a).device
    a100 = a100.with_efficiency(kernel_overhead_s=h100.efficiency.kernel_overhead_s)
    return mixed_cluster([DeviceGroup(device=a100, num_nodes=1), DeviceGroup(device=h100, num_nodes=1)],
                         2, memory_headroom=0.0)


# (A100 memory, H100 memory, the winner's micro-batch sizes per group): with room on the H100s
# the winner is a pipeline whose H100 stage takes three of the four layers; with both caps tight
# it is a pipeline-free plan whose replicas take uneven shares of the batch, the H100's three of
# four sequences (ZeRO-3, full recomputation, CP over each group's two devices)
@pytest.mark.parametrize("memory_a,memory_b,sizes", [(2**31 + 1_347_008, 2**31 + 10**7, ()),
                                                     (2**31 + 1_250_000, 2**31 + 1_650_000, (1, 3))],
                         ids=["stages-on-groups", "uneven-shares"])
def test_search_matches_brute_force_on_a_mixed_cluster(memory_a, memory_b, sizes):
    model, train = CASES[0][0], TrainSpec(seq_len=64, global_batch_size=4)
    cluster = _mixed(memory_a, memory_b)
    expected = brute_force_best(model, train, cluster, group_orders=group_orders(cluster))
    result = search(model, train, cluster, SearchOptions(top_k=1, max_tp=4))
    assert result.stats.optimal
    best = min((f for f in result.evaluated if f.estimate.closed_form_step_time_s is not None),
               key=lambda f: f.estimate.closed_form_step_time_s)
    assert best.estimate.closed_form_step_time_s == pytest.approx(expected[0], rel=1e-6), \
        (best.plan.short(), best.plan.group_order, expected[1].short(), expected[1].group_order)
    assert best.plan.micro_batch_sizes == sizes, best.plan.short()


def test_share_vectors_are_every_vector_that_adds_up():
    """planner.shares solves the share vectors group by group: the same set as the whole product."""
    from planner.shares import share_vectors
    cases = [([2, 3], [range(1, 6), range(2, 5)], 24), ([1, 1, 2, 4], [range(1, 9)] * 4, 96), ([4, 4], [range(1, 1), range(1, 5)], 8)]
    for replicas, sizes, batch in cases:
        whole = sorted((v, batch // sum(r * s for r, s in zip(replicas, v))) for v in itertools.product(*sizes)
                       if batch % sum(r * s for r, s in zip(replicas, v)) == 0)
        assert sorted(share_vectors(replicas, batch, sizes)) == whole
