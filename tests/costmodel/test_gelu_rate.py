"""A CPU profile's measured GeLU rates price the MLP's activation: forward and backward over the
MLP's width on one TP rank, the approximation the model's MLP runs; SwiGLU and profiles without
rates (datasheets, GPUs) are unchanged."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.hardware import ClusterSpec, load_profile
from costmodel.inputs import UserError
from costmodel.kernels import layer_kernel_times
from costmodel.registry import gpt_spec, llama_spec
from costmodel.specs import DType, FfnKind, TrainSpec
from planner.space import Choice, build_plan

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"
TRAIN = TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=DType.FP32)
GPT = gpt_spec("t-gpt", layers=2, hidden=320, heads=4, vocab=5000, max_pos=512, ffn=1280, source="test")
LLAMA = llama_spec("t-llama", layers=2, hidden=384, heads=6, kv_heads=2, ffn=1024, vocab=6000, max_pos=512,
                   source="test")
RATES = (("tanh", 2e-9, 3e-9), ("none", 5e-9, 7e-9))


def _times(model, rates=(), tp: int = 1):
    dev = replace(load_profile(PROFILE), gelu_s_per_element=rates)
    cluster = ClusterSpec(device=dev, num_nodes=1, devices_per_node=tp)
    plan = build_plan(model, TRAIN, cluster, Choice(tp=tp, micro_batch_size=2))
    return layer_kernel_times(model, TRAIN, plan, dev, False, False, True)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind, forward, backward", [(FfnKind.GELU, 2e-9, 3e-9), (FfnKind.GELU_ERF, 5e-9, 7e-9)])
def test_the_activation_is_priced_at_its_approximation_s_rate(tp, kind, forward, backward):
    model = replace(GPT, ffn_kind=kind)
    bare, timed = _times(model, (), tp), _times(model, RATES, tp)
    elements = 2 * 256 * 1280 / tp      # micro-batch x seq x the MLP's width on this rank
    assert timed.forward_s - bare.forward_s == pytest.approx(elements * forward)
    assert timed.recompute_forward_s - bare.recompute_forward_s == pytest.approx(elements * forward)
    assert timed.backward_input_s - bare.backward_input_s == pytest.approx(elements * backward)
    assert timed.backward_weight_s == bare.backward_weight_s


def test_swiglu_is_unchanged():
    assert _times(LLAMA, RATES) == _times(LLAMA, ())


def test_a_gated_gelu_mlp_is_priced_at_tanh_s_rate_over_its_width():
    model = replace(LLAMA, ffn_kind=FfnKind.GEGLU)
    bare, timed = _times(model, ()), _times(model, RATES)
    assert timed.forward_s - bare.forward_s == pytest.approx(2 * 256 * 1024 * 2e-9)


@pytest.mark.parametrize("entry", ["{tanh = [1e-9]}", "{sigmoid = [1e-9, 2e-9]}", "[1e-9, 2e-9]"])
def test_a_malformed_gelu_entry_is_one_line_naming_it(tmp_path, entry):
    text = PROFILE.read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text + ("" if "[measured]" in text else "\n[measured]\n") + f"gelu_s_per_element = {entry}\n")
    with pytest.raises(UserError, match="gelu_s_per_element"):
        load_profile(bad)
