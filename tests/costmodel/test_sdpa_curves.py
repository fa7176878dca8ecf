"""A CPU profile's measured SDPA points price the runtime's attention core: forward and backward
each at its own points, per head at each call's sequence and head dim, the dtype's own points,
with dropout the dropout points (torch's math path), context parallelism as its two chunk calls;
without points (datasheets,
GPUs) nothing changes."""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.hardware import ClusterSpec, load_profile, profile_problems, sdpa_key
from costmodel.inputs import UserError
from costmodel.kernels import cp_chunk_scores, layer_kernel_times, sdpa_head_s
from costmodel.registry import gpt_spec, llama_spec
from costmodel.specs import DType, TrainSpec
from planner.space import Choice, build_plan

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"
GPT = gpt_spec("t-gpt", layers=2, hidden=320, heads=4, vocab=5000, max_pos=512, ffn=1280, source="test")
LLAMA = llama_spec("t-llama", layers=2, hidden=384, heads=6, kv_heads=2, ffn=1024, vocab=6000, max_pos=512,
                   source="test")
# seconds per query-key pair at (sequence, head dim) 128 and 512 x 16 and 64, per (dropout, backward)
PAIR_S = {(False, False): {(128, 16): 4e-9, (128, 64): 10e-9, (512, 16): 2e-9, (512, 64): 8e-9},
          (False, True): {(128, 16): 18e-9, (128, 64): 23e-9, (512, 16): 5e-9, (512, 64): 9e-9},
          (True, False): {(128, 16): 12e-9, (128, 64): 30e-9, (512, 16): 9e-9, (512, 64): 24e-9},
          (True, True): {(128, 16): 20e-9, (128, 64): 40e-9, (512, 16): 15e-9, (512, 64): 30e-9}}
BF16_SCALE = 2.0   # bf16's times over fp32's


def _points(pair_s: dict, scale: float = 1.0) -> tuple:
    return tuple(sorted((float(s), float(d), scale * p * s * s) for (s, d), p in pair_s.items()))


def _device(scale_backward: float = 1.0, curves: bool = True):
    dev = load_profile(PROFILE)
    # no per-kernel cost, so the times are the points' alone
    dev = replace(dev, efficiency=replace(dev.efficiency, kernel_overhead_s=0.0), dtype_efficiency=())
    if not curves:
        return dev
    return replace(dev, sdpa_curves=tuple(
        (sdpa_key(dtype, drop, back), _points(pair_s, s * (scale_backward if back else 1.0)))
        for (drop, back), pair_s in PAIR_S.items() for dtype, s in (("fp32", 1.0), ("bf16", BF16_SCALE))))


def _times(model, dev, cpu: bool = True, tp: int = 1, cp: int = 1, mbs: int = 2, dtype: DType = DType.FP32):
    train = TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=dtype)
    cluster = ClusterSpec(device=dev, num_nodes=1, devices_per_node=tp * cp)
    plan = build_plan(model, train, cluster, Choice(tp=tp, cp=cp, micro_batch_size=mbs))
    return layer_kernel_times(model, train, plan, dev, False, False, cpu)


def _pair_s(pair_s: dict, seq: float, dim: float, short: int = 128) -> float:
    """By hand: linear in the head dim at `short` and at 512, then log-linear in the sequence."""
    at = {s: pair_s[s, 16] + (dim - 16) * (pair_s[s, 64] - pair_s[s, 16]) / 48 for s in (short, 512)}
    w = (math.log(seq) - math.log(short)) / (math.log(512) - math.log(short))
    return at[short] + w * (at[512] - at[short])


@pytest.mark.parametrize("model", [LLAMA, GPT], ids=["flash", "dropout"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("dtype", [DType.FP32, DType.BF16])
def test_each_pass_is_priced_per_head_at_the_call_s_sequence_and_head_dim(model, tp, dtype):
    scale = 1.0 if dtype is DType.FP32 else BF16_SCALE
    heads = 2 * model.num_heads // tp                       # micro-batch x local heads
    t = _times(model, _device(), tp=tp, dtype=dtype)
    forward = heads * 256 * 256 * scale * _pair_s(PAIR_S[model.dropout, False], 256, model.head_dim)
    assert t.attention_forward_s == pytest.approx(forward)
    # the backward reads its own points: half their time takes half of it off the layer's backward
    faster = _times(model, _device(scale_backward=0.5), tp=tp, dtype=dtype)
    backward = heads * 256 * 256 * scale * _pair_s(PAIR_S[model.dropout, True], 256, model.head_dim)
    assert t.backward_input_s - faster.backward_input_s == pytest.approx(backward / 2)
    assert faster.forward_s == t.forward_s


def test_the_head_dim_moves_a_pair_s_time_along_the_measured_dims_not_in_proportion():
    """bf16's backward at a 128 sequence: 18 ns a pair at head dim 16, 23 at 64 (not 4x)."""
    points = _points(PAIR_S[False, True])
    assert sdpa_head_s(points, 128, 16) == pytest.approx(18e-9 * 128 ** 2)
    assert sdpa_head_s(points, 128, 32) == pytest.approx((18 + 16 * 5 / 48) * 1e-9 * 128 ** 2)
    assert sdpa_head_s(points, 128, 80) == pytest.approx((18 + 64 * 5 / 48) * 1e-9 * 128 ** 2)   # beyond: the line
    # below the smallest dim the line, never under the smallest dim's time in proportion
    steep = ((128.0, 16.0, 1e-9 * 128 ** 2), (128.0, 64.0, 10e-9 * 128 ** 2))
    assert sdpa_head_s(steep, 128, 8) == pytest.approx(0.5e-9 * 128 ** 2)
    # one dim measured at a sequence: in proportion
    assert sdpa_head_s(((128.0, 32.0, 1e-5),), 128, 64) == pytest.approx(2e-5)


def test_three_head_dims_are_read_piecewise_and_a_noisy_dip_is_kept_not_carried_on():
    pair = {16: 4e-9, 32: 8e-9, 64: 6e-9}   # the 64 faster than the 32: the machine's noise
    points = tuple((128.0, float(d), p * 128 ** 2) for d, p in pair.items())
    for d, p in pair.items():            # every measured point as measured
        assert sdpa_head_s(points, 128, d) == pytest.approx(p * 128 ** 2)
    assert sdpa_head_s(points, 128, 24) == pytest.approx(6e-9 * 128 ** 2)
    assert sdpa_head_s(points, 128, 48) == pytest.approx(7e-9 * 128 ** 2)
    assert sdpa_head_s(points, 128, 80) == pytest.approx(6e-9 * 128 ** 2)   # no further down than the last


def test_sequences_between_beyond_and_below_the_measured_ones():
    points = _points(PAIR_S[False, False])
    assert sdpa_head_s(points, 256, 64) == pytest.approx(_pair_s(PAIR_S[False, False], 256, 64) * 256 ** 2)
    # longer than the longest: the longest's time per pair
    assert sdpa_head_s(points, 2048, 64) == pytest.approx(8e-9 * 2048 ** 2)
    # shorter than the shortest: that one's whole call (its own cost), not its pair time x fewer pairs
    assert sdpa_head_s(points, 32, 64) == pytest.approx(10e-9 * 128 ** 2)


def test_context_parallel_prices_its_two_chunk_calls_each_as_the_causal_call_of_its_pairs():
    pairs = cp_chunk_scores(256, 2) / 2                  # 10,240 a head: a causal call of 101 queries
    seq = math.sqrt(pairs)
    # the shorter sequence at 64, so the chunks' equivalent falls between the measured ones
    short = {(64 if s == 128 else s, d): p for (s, d), p in PAIR_S[False, False].items()}
    dev = replace(_device(), sdpa_curves=tuple((k, _points(short) if k == sdpa_key("fp32", False, False) else c)
                                               for k, c in _device().sdpa_curves))
    per_call = 2 * LLAMA.num_heads * pairs * _pair_s(short, seq, LLAMA.head_dim, short=64)
    assert _times(LLAMA, dev, cp=2).attention_forward_s == pytest.approx(2 * per_call)


@pytest.mark.parametrize("model", [LLAMA, GPT], ids=["flash", "dropout"])
def test_without_points_or_off_the_cpu_kernels_nothing_changes(model):
    bare = _device(curves=False)
    assert _times(model, _device(), cpu=False) == _times(model, bare, cpu=False)
    assert _times(model, _device()) != _times(model, bare)


def test_a_forward_without_its_backward_or_a_bad_point_is_a_profile_problem():
    dev = _device()
    lone = replace(dev, sdpa_curves=tuple((k, c) for k, c in dev.sdpa_curves if k != sdpa_key("bf16", True, True)))
    assert profile_problems(dev) == []
    assert profile_problems(lone) == [f"measured.{sdpa_key('bf16', True, False)} is not one of a non-empty "
                                      "forward and backward pair of SDPA curves"]
    key, points = dev.sdpa_curves[0]
    zero = replace(dev, sdpa_curves=((key, ((128.0, 0.0, 1e-5),) + points[1:]),) + dev.sdpa_curves[1:])
    assert profile_problems(zero) == [f"measured.{key} has a point that is not a sequence and a head dim from 1 to "
                                      "16,777,216 and a time up to 10 s"]


@pytest.mark.parametrize("point,why", [("[256, 2e9]", "point 0"), ('[128, 64, "fast"]', "point 0"),
                                       ("[128, 64, 0.0]", "point 0")])
def test_a_version_3_point_that_is_not_three_positive_numbers_is_refused_by_key_and_point(tmp_path, point, why):
    if "[measured]" in PROFILE.read_text():
        pytest.skip("the committed profile has a [measured] table of its own")
    text = PROFILE.read_text()
    text += f"\n[measured]\nsdpa_fp32_forward = [{point}]\nsdpa_fp32_backward = [[128, 64, 1e-4]]\n"
    (tmp_path / "v3.toml").write_text(text)
    with pytest.raises(UserError, match=rf"v3.toml: \[measured\] sdpa_fp32_forward {why} .* is not \[sequence"):
        load_profile(tmp_path / "v3.toml")
