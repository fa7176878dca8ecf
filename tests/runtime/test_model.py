"""The runtime's module tree against the cost model's analytical counts (meta device: no memory)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from costmodel.deepseek import unbuilt_mechanisms
from costmodel.inputs import UserError
from costmodel.layout import layer_blocks
from costmodel.params import embedding_params, head_params, layer_params, total_params
from costmodel.registry import MODELS
from runtime.model import Transformer, count_params


@pytest.mark.parametrize("name", sorted(n for n in MODELS if not unbuilt_mechanisms(MODELS[n])))
def test_parameter_count_equals_costmodel(name):
    spec = MODELS[name]
    with torch.device("meta"):
        model = Transformer(spec)
    assert count_params(model) == total_params(spec)


@pytest.mark.parametrize("name", ["deepseek-v3", "debug-mla"])
def test_mechanisms_the_runtime_does_not_build_are_refused_by_name(name):
    with pytest.raises(UserError, match=r"does not build multi-token prediction \(mtp_depth\)"):
        Transformer(MODELS[name])


@pytest.mark.parametrize("name", ["deepseek-v3", "debug-mla"])
def test_deepseek_without_its_mtp_module_counts_as_costmodel(name):
    """Latent attention, dense first layers, routed and shared experts: the runtime's modules
    hold what costmodel counts (the sigmoid router's balancing bias is a buffer, not counted)."""
    spec = replace(MODELS[name], mtp_depth=0)
    with torch.device("meta"):
        model = Transformer(spec)
    assert count_params(model) == total_params(spec)
    dense, moe = model.layers["0"].mlp, model.layers[str(spec.first_k_dense)].mlp
    assert not hasattr(dense, "router") and hasattr(moe, "expert_bias")


def test_stage_pieces_equal_costmodel_pieces():
    """A pipelined tied model: the last stage holds its own output weight, as costmodel counts."""
    spec = MODELS["megatron-1.7b"]
    with torch.device("meta"):
        first, last = Transformer(spec), Transformer(spec)
    first.keep_only([0, 1], first=True, last=False)
    last.keep_only([spec.num_layers - 1], first=False, last=True)
    assert count_params(first) == embedding_params(spec) + 2 * layer_params(spec)
    assert count_params(last) == layer_params(spec) + head_params(spec, pipelined=True)


def test_projection_names_come_from_the_layout_table():
    for spec in (MODELS["debug-tiny"], MODELS["debug-tiny-gpt"]):
        layer = Transformer(spec).layers["0"]
        for block in layer_blocks(spec):
            owner = layer.attention if block.name == "attention" else layer.mlp
            for lin in block.linears:
                weight = getattr(owner, lin.name).weight
                assert tuple(weight.shape) == (lin.out_features, lin.in_features)


def test_initialisation_does_not_depend_on_what_a_rank_holds():
    spec = MODELS["debug-tiny"]
    whole, stage = Transformer(spec), Transformer(spec)
    stage.keep_only([2, 3], first=False, last=True)
    whole.init_weights(3)
    stage.init_weights(3)
    for name, p in stage.named_parameters():
        assert torch.equal(p, dict(whole.named_parameters())[name])
