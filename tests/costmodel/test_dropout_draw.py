"""Torch's dropout, measured by the profile per element, is priced on every mask the runtime
draws: both branches of each layer, the attention probabilities on a CPU (SDPA with dropout runs
the math path there; with context parallelism each chunk against the keys before it) and the
embeddings; a model without dropout is unchanged."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.hardware import ClusterSpec, load_profile
from costmodel.kernels import cp_chunk_scores, embedding_kernel_times, layer_kernel_times
from costmodel.registry import gpt_spec, llama_spec
from costmodel.specs import DType, TrainSpec
from planner.space import Choice, build_plan

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"
RATE = 8e-9
TRAIN = TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=DType.FP32)
GPT = gpt_spec("t-gpt", layers=2, hidden=320, heads=4, vocab=5000, max_pos=512, ffn=1280, source="test")
LLAMA = llama_spec("t-llama", layers=2, hidden=384, heads=6, kv_heads=2, ffn=1024, vocab=6000, max_pos=512,
                   source="test")


def _times(model, rate: float, tp: int = 1):
    dev = replace(load_profile(PROFILE), dropout_s_per_element=rate)
    cluster = ClusterSpec(device=dev, num_nodes=1, devices_per_node=tp)
    plan = build_plan(model, TRAIN, cluster, Choice(tp=tp, micro_batch_size=2))
    return (layer_kernel_times(model, TRAIN, plan, dev, False, False, True),   # no ring, casts unfused, CPU kernels
            embedding_kernel_times(model, TRAIN, plan, dev))


@pytest.mark.parametrize("tp", [1, 2])
def test_each_mask_the_runtime_draws_is_priced_at_the_measured_rate(tp):
    assert GPT.dropout
    (layer0, emb0), (layer1, emb1) = _times(GPT, 0.0, tp), _times(GPT, RATE, tp)
    tokens, heads = 2 * 256, 4 // tp
    branches = 2 * tokens * 320 / tp          # sequence parallel with TP: each rank its shard
    scores = 2 * heads * 256 * 256            # the attention probabilities of the local heads
    assert layer1.forward_s - layer0.forward_s == pytest.approx((branches + scores) * RATE)
    assert layer1.attention_forward_s - layer0.attention_forward_s == pytest.approx(scores * RATE)
    assert layer1.recompute_forward_s - layer0.recompute_forward_s == pytest.approx((branches + scores) * RATE)
    assert layer1.backward_input_s == layer0.backward_input_s   # backward multiplies by the kept mask
    assert emb1.forward_s - emb0.forward_s == pytest.approx(tokens * 320 * RATE)


def test_a_model_without_dropout_is_priced_as_before():
    assert not LLAMA.dropout
    assert _times(LLAMA, 0.0) == _times(LLAMA, RATE)


def test_context_parallel_chunks_draw_over_the_keys_before_them():
    # cp 2: chunks of 64 tokens; rank 1 holds chunks 1 and 2, against 128 and 192 keys
    assert cp_chunk_scores(256, 2) == 64 * 128 + 64 * 192 == 64 * 64 * 5
    assert cp_chunk_scores(256, 1) == 256 * 256
