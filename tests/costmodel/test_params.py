import pytest

from costmodel.params import layer_params, total_params
from costmodel.registry import MODELS, resolve_model

PUBLISHED_TOTALS = {  # from the models' Hugging Face configs / model cards
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
}


@pytest.mark.parametrize("name,expected", sorted(PUBLISHED_TOTALS.items()))
def test_llama_totals_match_published(name, expected):
    assert total_params(MODELS[name]) == expected


@pytest.mark.parametrize("name", [n for n in MODELS if n.startswith("megatron-") or n == "gpt3-175b"])
def test_gpt_matches_megatron_formula(name):
    """SC'21 Eq. 2: P = 12 l h^2 (1 + 13/12h + (V + s)/12lh); Megatron's formula leaves out the
    final LayerNorm (2h), which the module tree has."""
    m = MODELS[name]
    l, h, v, s = m.num_layers, m.hidden_size, m.vocab_size, m.max_position_embeddings
    assert total_params(m) == 12 * l * h * h + 13 * l * h + (v + s) * h + 2 * h


def test_megatron_table_sizes_are_the_published_ones():
    """SC'21 Table 1 lists sizes in billions to one decimal."""
    published_billions = {"megatron-1.7b": 1.7, "megatron-3.6b": 3.6, "megatron-7.5b": 7.5,
                          "megatron-18b": 18.4, "megatron-39b": 39.1, "megatron-76b": 76.1,
                          "megatron-145b": 145.6, "megatron-310b": 310.1, "megatron-530b": 529.6,
                          "megatron-1t": 1008.0}
    for name, billions in published_billions.items():
        assert round(total_params(MODELS[name]) / 1e9, 1) == billions


def test_tensor_parallel_shards_the_projections_exactly():
    m = resolve_model("llama3-8b")
    norms = 2 * m.hidden_size
    assert layer_params(m, 8) - norms == (layer_params(m, 1) - norms) // 8


def test_alias_and_unknown_model():
    assert resolve_model("llama-70b") is MODELS["llama2-70b"]
    with pytest.raises(ValueError, match="unknown model 'gpt5'.*llama3-8b"):
        resolve_model("gpt5")


def test_hf_config_is_read(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, '
                   '"num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, '
                   '"vocab_size": 128256, "max_position_embeddings": 8192, "hidden_act": "silu"}')
    assert total_params(resolve_model(str(cfg))) == PUBLISHED_TOTALS["llama3-8b"]


def test_hf_config_errors(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text('{"model_type": "llama", "hidden_size": 64}')
    with pytest.raises(ValueError, match="config.json: num_attention_heads is missing"):
        resolve_model(str(cfg))
    cfg.write_text('{"model_type": "t5"}')
    with pytest.raises(ValueError, match="not supported"):
        resolve_model(str(cfg))
