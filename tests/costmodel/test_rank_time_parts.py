"""rank_time_model is assembled from parts cached on what each reads (costmodel.rank_time.parts):
a plan priced after others that share its parts gets what it gets priced alone."""
import itertools
from dataclasses import replace

import pytest

from costmodel.deepseek import dense_layer_model
from costmodel.frameworks import framework_traits
from costmodel.hardware.clusters import parse_cluster
from costmodel.kernels import embedding_kernel_times, head_kernel_times, layer_kernel_times
from costmodel.plan import Recompute
from costmodel.rank_time import rank_time_model, spans
from costmodel.rank_time.parts import rank_time_parts
from costmodel.registry import default_recipe, resolve_model
from costmodel.specs import TrainSpec
from planner.space import degrees_plan


def _plans(model):
    for tp, cp, ep, pp, order, rc, mbs, sp in itertools.product(
            (1, 2, 8), (1, 2), (1, 8), (1, 4), (("pp", "dp", "cp", "tp"), ("dp", "pp", "tp", "cp")),
            tuple(Recompute), (1, 2), (False, True)):
        dp = 512 // (tp * cp * pp)
        if dp % ep or (sp and tp == 1):
            continue
        plan = degrees_plan(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, num_layers=model.num_layers, mesh_axis_order=order)
        yield replace(plan, recompute=rc, micro_batch_size=mbs, sequence_parallel=sp)


@pytest.mark.parametrize("framework", ["planner", "megatron-core"])   # all-gathered K/V; ring attention
def test_a_plan_priced_after_others_that_share_its_parts_is_priced_as_alone(framework):
    cluster = replace(parse_cluster("64x8xH100"), framework=framework_traits(framework))
    for name in ("deepseek-v3", "llama-70b"):
        model = resolve_model(name)
        seq, batch = default_recipe(model)
        train = TrainSpec(seq_len=seq, global_batch_size=batch)
        plans = list(_plans(model))
        rank_time_parts.cache_clear()
        shared = [rank_time_model(model, train, p, cluster, spans(p, cluster)) for p in plans]
        alone = []
        for p in plans:
            rank_time_parts.cache_clear()
            alone.append(rank_time_model(model, train, p, cluster, spans(p, cluster)))
        assert shared == alone
        assert len(set(shared)) > len(plans) // 4   # placements and shapes that price differently


def test_the_kernels_of_a_model_without_experts_read_no_ep():
    """RankTimeParts shares such a model's kernel parts across ep (deepseek-v3's dense first
    layers are one: costmodel.deepseek.dense_layer_model)."""
    cluster = parse_cluster("64x8xH100")
    for model in (resolve_model("llama-70b"), dense_layer_model(resolve_model("deepseek-v3"))):
        assert not model.is_moe
        train = TrainSpec(seq_len=4096, global_batch_size=512)
        for tp, cp, sp, mbs in itertools.product((1, 4), (1, 2), (False, True), (1, 2)):
            plans = [replace(degrees_plan(dp=512 // (tp * cp), tp=tp, pp=1, cp=cp, ep=ep), sequence_parallel=sp,
                             micro_batch_size=mbs) for ep in (1, 8)]
            for kernels, how in ((layer_kernel_times, (True,)), (layer_kernel_times, (False,)),
                                 (embedding_kernel_times, ()), (head_kernel_times, ())):
                one, eight = (kernels(model, train, p, cluster.device, *how) for p in plans)
                assert one == eight


def test_the_embedding_and_head_read_no_expert_layout_sp_or_float8():
    """Their caches key on tp, cp and the micro-batch alone (KernelKey.edge_of): the uncached
    kernels of a mixture under every expert layout, SP and float8 choice are one shape's."""
    model, cluster = resolve_model("deepseek-v3"), parse_cluster("64x8xH100")
    train, dev = TrainSpec(seq_len=4096, global_batch_size=512, float8=True), cluster.device
    for kernels, how in ((embedding_kernel_times, ()), (head_kernel_times, ()), (head_kernel_times, (False, True))):
        for tp, cp, mbs in itertools.product((1, 4), (1, 2), (1, 2)):
            base = degrees_plan(dp=512 // (tp * cp), tp=tp, pp=1, cp=cp)
            times = {kernels.__wrapped__(model, train, replace(base, ep=ep, etp=etp, sequence_parallel=sp and tp > 1,
                                                               fp8_linears=fp8, micro_batch_size=mbs), dev, *how)
                     for ep, etp, sp, fp8 in itertools.product((1, 8), (1, 2), (False, True), (False, True))}
            assert len(times) == 1
