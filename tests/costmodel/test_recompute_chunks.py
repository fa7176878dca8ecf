"""Where a rank's recomputed layers sit under interleaving (costmodel.frameworks
`recompute_placement`), which the simulation prices: our runtime recomputes its first layers in
model order (first chunk first); Megatron's block method the first k of every chunk; torchtitan
every n-th layer counted across the rank's chunks."""
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
    assert plan.recompute_per_stage("each_chunk") == (2, 3, 2, 3)
    # a short chunk takes what it holds, the rest goes to the others
    short = _plan((1, 8, 15, 8), (5, 4))
    assert short.recompute_per_stage() == (1, 4, 4, 0)
    assert short.recompute_per_stage("each_chunk") == (1, 2, 4, 2)
    # a count above what a rank holds is what it holds (a plan check refuses such a plan)
    assert _plan((2, 2, 2, 2), (9, 0)).recompute_per_stage("each_chunk") == (2, 0, 2, 0)


def test_torchtitan_recomputes_every_nth_layer_across_a_ranks_chunks():
    """One counter over the blocks a process builds (torchtitan `_apply_layer_sac`): the n-th,
    2n-th, ... layer of the rank, counted across its chunks (n the least that says the counts,
    as the export writes it)."""
    # 8 layers a rank, 2 recomputed: n = 3, layers 3 and 6; rank 0's chunks hold 5 and 3 layers
    # (one in each), rank 1's 6 and 2 (both in the first)
    plan = _plan((5, 6, 3, 2), (2, 2))
    assert plan.recompute_per_stage("every_nth") == (1, 2, 1, 0)
    plan = _plan((5, 6, 4, 3), (3, 3))   # 9 layers a rank, n = 3: layers 3, 6 and 9
    assert plan.recompute_per_stage("every_nth") == (1, 2, 2, 1)
    # counts no n says (1 and 3 of 8 layers) are placed as our runtime places them
    odd = _plan((4, 4, 4, 4), (1, 3))
    assert odd.recompute_per_stage("every_nth") == odd.recompute_per_stage()


def test_megatron_prices_its_chunks_recomputation():
    """The same plan under Megatron-Core's traits with and without the trait: the first chunk,
    whose micro-batches are in flight longest, keeps more when the count is spread."""
    model, cluster = MODELS["llama3-8b"], parse_cluster("1x8xH100")
    plan = _plan((4, 4, 4, 4), (4, 4))   # the block method's first 2 of every chunk
    megatron = framework_traits("megatron-core")
    assert (megatron.recompute_placement, framework_traits("torchtitan").recompute_placement,
            framework_traits("planner").recompute_placement) == ("each_chunk", "every_nth", "first")
    spread = estimate(model, TRAIN, run_by(cluster, megatron), plan)
    first = estimate(model, TRAIN, run_by(cluster, replace(megatron, recompute_placement="first")), plan)
    assert spread.peak_memory_bytes[0] > first.peak_memory_bytes[0]
