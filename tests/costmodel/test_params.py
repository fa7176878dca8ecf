import json

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
    assert resolve_model("Llama-405B") is MODELS["llama3-405b"]
    assert resolve_model("llama-8b") is MODELS["llama3-8b"]
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


def _hf(tmp_path, **changes):
    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 160, "vocab_size": 256, "max_position_embeddings": 4096}
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({k: v for k, v in {**base, **changes}.items() if v is not ...}))
    return str(cfg)


def test_hf_numerics_are_read(tmp_path):
    """Llama 3.1's numerics, both as transformers 4 writes them and as transformers 5 does."""
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    for changes in ({"rope_theta": 5e5, "rope_scaling": scaling, "rms_norm_eps": 1e-5},
                    {"rope_parameters": {"rope_theta": 5e5, **scaling}, "rms_norm_eps": 1e-5}):
        spec = resolve_model(_hf(tmp_path, **changes))
        assert (spec.rope_theta, spec.norm_eps, spec.rope_scaling_factor, spec.rope_original_max_positions) == \
            (5e5, 1e-5, 8.0, 8192)
    spec = resolve_model(_hf(tmp_path))
    assert (spec.rope_theta, spec.norm_eps, spec.rope_scaling_factor) == (1e4, 1e-6, 1.0)   # transformers' defaults
    assert resolve_model("llama3-8b").rope_theta == 5e5 and resolve_model("llama3-405b").rope_scaling_factor == 8.0


@pytest.mark.parametrize("changes, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
    ({"head_dim": 33}, "head_dim must be a positive even number"),   # 32 is read: explicit_head_dim
    ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}}, "partial_rotary_factor 0.5"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "beta_fast": 32}}, "keys this planner does not know: beta_fast"),
    ({"attention_bias": True}, "with biases are not supported"),
    ({"moe_intermediate_size": 64, "num_experts": 8}, "keys this planner does not know, which may change the cost: "
                                                      "moe_intermediate_size, num_experts"),
])
def test_hf_config_fields_the_planner_does_not_model_are_named(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        resolve_model(_hf(tmp_path, **changes))


def test_a_sequence_beyond_the_sliding_window_is_refused(tmp_path, capsys):
    from planner.cli import main
    config = _hf(tmp_path, model_type="mistral", sliding_window=64)
    assert main(["predict", "--model", config, "--cluster", "1x1xxeon-amx", "--seq-len", "128",
                 "--global-batch", "2"]) == 2
    assert "longer than the model's attention window 64" in capsys.readouterr().err
    assert main(["predict", "--model", config, "--cluster", "1x1xxeon-amx", "--seq-len", "64",
                 "--global-batch", "2"]) == 0


def test_mixtures_of_experts_are_counted_exactly():
    """Published totals and active parameters (Mixtral paper, Mistral's 8x22B announcement, the
    Qwen1.5-MoE blog), from the registry's config fields."""
    from costmodel.params import active_params
    for name, total, active in (("mixtral-8x7b", 46.7e9, 12.9e9), ("mixtral-8x22b", 141e9, 39e9),
                                ("qwen1.5-moe-a2.7b", 14.3e9, 2.7e9)):
        spec = resolve_model(name)
        assert total_params(spec) == pytest.approx(total, rel=0.005)
        assert active_params(spec) == pytest.approx(active, rel=0.01)
    assert total_params(resolve_model("mixtral-8x7b")) == 46_702_792_704   # transformers' count (test_hf)


def test_bad_mixtures_of_experts_are_one_line(tmp_path, capsys):
    from planner.cli import main
    base = {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 256, "num_local_experts": 4}
    for changes, message in (({"num_experts_per_tok": 5}, "num_experts_per_tok 5 must be between 1 and num_experts 4"),
                             ({"num_experts_per_tok": 2, "router_jitter_noise": 0.1}, "router_jitter_noise"),
                             ({"num_experts_per_tok": 2}, "with experts needs sequence parallelism")):
        cfg = tmp_path / "config.json"
        cfg.write_text(json.dumps({**base, **changes}))
        assert main(["predict", "--model", str(cfg), "--cluster", "1x8xH100", "--tp", "2", "--no-sp"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1


def test_a_mixture_of_experts_is_planned_as_the_runtime_runs_it(capsys):
    """Experts priced as runtime.moe runs them: FLOPs of the active parameters, every expert's
    states, tensor parallelism only with sequence parallelism (the mixture routes each TP rank's
    shard), so the search offers no TP without it; Mixtral's plans shard the experts (EP); the
    zero-bubble schedules and DualPipeV run with experts (tests/runtime/test_parity.py)."""
    from costmodel.flops import layer_linear_forward_flops
    from planner.cli import main
    m = resolve_model("mixtral-8x7b")
    h, kv, f, tokens = m.hidden_size, m.kv_hidden_size, m.moe_ffn_hidden_size, 1000
    attention = 2 * h * h + 2 * h * kv
    assert layer_linear_forward_flops(m, tokens) == 2 * tokens * (attention + h * 8 + 2 * 3 * h * f)
    assert main(["search", "--model", "mixtral-8x7b", "--cluster", "8x8xH100", "--json", "--top", "10"]) == 0
    import json as _json
    plans = [p["plan"] for p in _json.loads(capsys.readouterr().out)["plans"]]
    assert plans and all(p["tp"] == 1 or p["sequence_parallel"] for p in plans)
    assert all(p["ep"] > 1 for p in plans)
    for flags, message in ((["--ep", "3"], "ep=3 does not divide the model's 8 experts"),
                           (["--tp", "2", "--no-sp"], "with experts needs sequence parallelism")):
        assert main(["predict", "--model", "mixtral-8x7b", "--cluster", "8x8xH100", *flags]) == 2
        assert message in capsys.readouterr().err
    for flags in (["--schedule", "zb-h1"], ["--vpp", "2", "--schedule", "dualpipev"]):
        flags += ["--pp", "2", "--ep", "8", "--zero", "1"]
        assert main(["predict", "--model", "mixtral-8x7b", "--cluster", "8x8xH100", *flags]) == 0, flags
        capsys.readouterr()
