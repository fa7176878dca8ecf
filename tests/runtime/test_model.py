"""The runtime's module tree against the cost model's analytical counts (meta device: no memory)."""
from __future__ import annotations

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


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "debug-mla"])
def test_mechanisms_the_runtime_does_not_build_are_refused_by_name(name):
    with pytest.raises(UserError, match="does not build latent attention .*dense first layers"):
        Transformer(MODELS[name])


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
