"""Where a rank's recomputed layers sit under interleaving: our runtime recomputes its first
layers in model order (first chunk first); Megatron's block method the first k of every chunk
(costmodel.frameworks `recompute_each_chunk`), which the simulation prices."""
from dataclasses import replace

from costmodel.estimate import estimate
from costmodel.frameworks import framework_traits
from costmodel.hardware import parse_cluster, run_by
from costmodel.plan import Recompute
from costmodel.registry import MODELS
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan

TRAIN = TrainSpec(seq_len=4096, global_batch_size=64)


def _plan(layers, recomputed):
    model, cluster = MODELS["llama3-8b"], parse_cluster("1x8xH100")
    plan = build_plan(model, TRAIN, cluster, Choice(tp=2, pp=2, vpp=2, zero_stage=1, recompute=Recompute.FULL))
    return replace(plan, layers_per_stage=layers, recompute_num_layers=recomputed)


def test_a_ranks_count_goes_first_chunk_first_or_to_every_chunk():
    # virtual stage j of rank j % 2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3
    plan = _plan((8, 8, 8, 8), (4, 6))
    assert plan.recompute_per_stage() == (4, 6, 0, 0)
    assert plan.recompute_per_stage(each_chunk=True) == (2, 3, 2, 3)
    # a short chunk takes what it holds, the rest goes to the others
    short = _plan((1, 8, 15, 8), (5, 4))
    assert short.recompute_per_stage() == (1, 4, 4, 0)
    assert short.recompute_per_stage(each_chunk=True) == (1, 2, 4, 2)


def test_megatron_prices_its_chunks_recomputation():
    """The same plan under Megatron-Core's traits with and without the trait: the first chunk,
    whose micro-batches are in flight longest, keeps more when the count is spread."""
    model, cluster = MODELS["llama3-8b"], parse_cluster("1x8xH100")
    plan = _plan((4, 4, 4, 4), (4, 4))   # the block method's first 2 of every chunk
    megatron = framework_traits("megatron-core")
    assert megatron.recompute_each_chunk and not framework_traits("planner").recompute_each_chunk
    spread = estimate(model, TRAIN, run_by(cluster, megatron), plan)
    first = estimate(model, TRAIN, run_by(cluster, replace(megatron, recompute_each_chunk=False)), plan)
    assert spread.peak_memory_bytes[0] > first.peak_memory_bytes[0]
