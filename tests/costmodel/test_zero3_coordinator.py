"""DeepSpeed's ZeRO-3 coordinator (costmodel.zero3_coordinator): gathers hide only behind the
modules between their prefetch and their use, the prefetch bounded by the bucket and the live
parameters, weights kept for a use within the reuse distance."""
import pytest

from costmodel.zero3_coordinator import Use, layer_modules, walk

# three modules of 10 weights each, 1 s of compute, 2 s to gather
TRACE = (Use(0, 10, 1.0), Use(1, 10, 1.0), Use(2, 10, 1.0))
GATHER = (2.0, 2.0, 2.0)


def test_a_gather_prefetched_behind_the_module_before_waits_only_for_the_rest():
    # A on demand (2 s); B prefetched when A starts, lands at 4 s, A ends at 3: 1 s; C likewise: 1 s
    wait, peak = walk(TRACE, GATHER, 1, 100, 0)
    assert wait == pytest.approx(4.0) and peak == 20


def test_a_module_holding_max_live_weights_prefetches_nothing():
    wait, peak = walk(TRACE, GATHER, 1, 10, 0)
    assert wait == pytest.approx(6.0) and peak == 10   # every gather on demand, one module live


def test_no_prefetch_bucket_gathers_on_demand():
    assert walk(TRACE, GATHER, 0, 100, 0)[0] == pytest.approx(6.0)


def test_the_gathers_share_one_stream():
    # a bucket of all three: B and C both prefetched at A's start, one after the other (4 s, 6 s)
    wait, peak = walk(TRACE, GATHER, 30, 100, 0)
    assert wait == pytest.approx(4.0) and peak == 30


def test_weights_used_again_within_the_reuse_distance_are_kept():
    """DeepSpeed keeps them where fewer than max_reuse_distance weights run in between (its scan
    stops once it has passed that many)."""
    trace = (Use(0, 10, 1.0), Use(1, 10, 1.0), Use(0, 10, 1.0))
    kept, _ = walk(trace, GATHER, 0, 100, 11)    # 10 weights between A's uses: kept, no second gather
    again, _ = walk(trace, GATHER, 0, 100, 10)   # not fewer than the distance: released, gathered again
    assert kept == pytest.approx(4.0) and again == pytest.approx(6.0)


def test_a_layer_s_modules_are_its_hooked_modules_in_forward_order():
    """The layer, its norm and the attention block (weightless, each a hook that prefetches), QKV,
    the core, the output projection, the norm and the MLP block, fc1, fc2; the weights are the
    projections', the norms' persisting."""
    from costmodel.params import layer_params
    from costmodel.registry import resolve_model
    model = resolve_model("gpt3-175b")
    modules = layer_modules(model, 1, 1, 2048)
    assert [p > 0 for p, _ in modules] == [False, False, False, True, False, True, False, False, True, True]
    assert [f > 0 for _, f in modules] == [False, False, False, True, True, True, False, False, True, True]
    assert sum(p for p, _ in modules) == layer_params(model) - 2 * 2 * model.hidden_size   # less the two LayerNorms


def test_weights_whose_next_use_a_prefetch_passed_stay_for_it():
    """DeepSpeed's __params_to_release keeps a module's weights when the prefetcher skipped their
    next use (they were there): A's second use needs no second gather, whatever the distance."""
    trace = (Use(0, 10, 1.0), Use(1, 10, 1.0), Use(0, 10, 1.0))
    wait, peak = walk(trace, GATHER, 30, 100, 0)   # A's start prefetches B and passes A's next use
    assert wait == pytest.approx(3.0) and peak == 20   # A on demand (2), B lands at 4 against 3 (1)


def test_a_step_s_trace_is_the_forward_then_each_layer_recomputed_and_backward_from_the_last():
    """Two layers under full recomputation: the embedding, both layers' modules, the head for the
    loss and again for its backward, then per layer from the last its recomputed forward and its
    backward in reverse, and the embedding's backward last. Times are shared by FLOPs."""
    from costmodel.hardware import parse_cluster
    from costmodel.plan import Recompute
    from costmodel.registry import resolve_model
    from costmodel.specs import TrainSpec
    from costmodel.zero3_coordinator import EMBEDDING, HEAD, step_trace
    from planner.space import Choice, build_plan
    model, train = resolve_model("debug-tiny"), TrainSpec(seq_len=128, global_batch_size=2)
    plan = build_plan(model, train, parse_cluster("1x2xA100"), Choice(zero_stage=3, recompute=Recompute.FULL))
    n = len(layer_modules(model, 1, 1, 128))
    trace = step_trace(model, train, plan, 2, (1.0, 2.0, 1.0), (100, 50))
    layer = lambda i: list(range(i * n, (i + 1) * n))   # noqa: E731
    assert [u.module for u in trace] == [EMBEDDING, *layer(0), *layer(1), HEAD, HEAD, *layer(1), *reversed(layer(1)),
                                         *layer(0), *reversed(layer(0)), EMBEDDING]
    forward, backward = trace[1:1 + 2 * n], trace[2 * n + 3 + n:3 * n + 3 + n]
    assert sum(u.compute_s for u in forward) == pytest.approx(1.0)
    assert sum(u.compute_s for u in backward) == pytest.approx(1.0)   # one layer's of the two: half of 2 s
