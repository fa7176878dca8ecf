import pytest

from costmodel.flops import executed_flops_per_step, model_flops_per_step, recompute_flops_per_step
from costmodel.hardware import parse_cluster
from costmodel.plan import Recompute
from costmodel.registry import MODELS
from costmodel.specs import TrainSpec
from planner.space import Choice, build_plan


def test_gpt_model_flops_are_megatron_eq7():
    """Narayanan et al. SC'21 Eq. 7 (no recompute): 72 B s l h^2 (1 + s/6h + V/12lh)."""
    m = MODELS["megatron-145b"]
    train = TrainSpec(seq_len=2048, global_batch_size=2304)
    b, s, l, h, v = 2304, 2048, m.num_layers, m.hidden_size, m.vocab_size
    expected = 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))
    assert model_flops_per_step(m, train) == pytest.approx(expected, rel=1e-12)


def test_full_recompute_is_megatron_eq3():
    """SC'21 Eq. 3 with full recomputation: 96 B s l h^2 (1 + s/6h + V/16lh)."""
    m = MODELS["megatron-18b"]
    train = TrainSpec(seq_len=2048, global_batch_size=1024)
    plan = build_plan(m, train, parse_cluster("32x8xA100"),
                      Choice(tp=8, recompute=Recompute.FULL, micro_batch_size=8))
    b, s, l, h, v = 1024, 2048, m.num_layers, m.hidden_size, m.vocab_size
    expected = 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    assert executed_flops_per_step(m, train, plan) == pytest.approx(expected, rel=1e-12)


def test_llama_model_flops_close_to_6N_plus_attention():
    """PaLM appendix B: 6N per token + 12 l h s for attention (N: non-embedding + head)."""
    m = MODELS["llama3-8b"]
    train = TrainSpec(seq_len=8192, global_batch_size=1)
    n = m.num_layers * (4 * m.hidden_size**2 - 2 * m.hidden_size * (m.hidden_size - m.kv_hidden_size)
                        + 3 * m.hidden_size * m.ffn_hidden_size) + m.vocab_size * m.hidden_size
    expected = 8192 * (6 * n + 12 * m.num_layers * m.hidden_size * 8192)
    assert model_flops_per_step(m, train) == pytest.approx(expected, rel=1e-9)


def test_selective_recompute_adds_only_the_attention_core():
    m = MODELS["llama2-7b"]
    train = TrainSpec(seq_len=4096, global_batch_size=8)
    plan = build_plan(m, train, parse_cluster("1x8xH100"),
                      Choice(tp=8, recompute=Recompute.SELECTIVE, micro_batch_size=1))
    assert recompute_flops_per_step(m, train, plan) == 4 * 8 * 4096**2 * 4096 * 32
