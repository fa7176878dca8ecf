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
    trace = (Use(0, 10, 1.0), Use(1, 10, 1.0), Use(0, 10, 1.0))
    kept, _ = walk(trace, GATHER, 0, 100, 10)    # 10 weights between A's uses: kept, no second gather
    again, _ = walk(trace, GATHER, 0, 100, 9)    # beyond the distance: released and gathered again
    assert kept == pytest.approx(4.0) and again == pytest.approx(6.0)


def test_a_layer_s_modules_are_its_projections_and_its_attention_core():
    from costmodel.params import layer_params
    from costmodel.registry import resolve_model
    model = resolve_model("gpt3-175b")
    modules = layer_modules(model, 1, 1, 2048)
    assert [p == 0 for p, _ in modules] == [False, True, False, False, False]   # qkv, core, proj, fc1, fc2
    assert sum(p for p, _ in modules) == layer_params(model) - 2 * 2 * model.hidden_size   # less the two LayerNorms


def test_weights_whose_next_use_a_prefetch_passed_stay_for_it():
    """DeepSpeed's __params_to_release keeps a module's weights when the prefetcher skipped their
    next use (they were there): A's second use needs no second gather, whatever the distance."""
    trace = (Use(0, 10, 1.0), Use(1, 10, 1.0), Use(0, 10, 1.0))
    wait, peak = walk(trace, GATHER, 30, 100, 0)   # A's start prefetches B and passes A's next use
    assert wait == pytest.approx(3.0) and peak == 20   # A on demand (2), B lands at 4 against 3 (1)
