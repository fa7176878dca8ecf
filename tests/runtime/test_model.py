"""The runtime's module tree against the cost model's analytical counts (meta device: no memory)."""
from __future__ import annotations

import pytest
import torch
from parity import plan_file

from costmodel.inputs import UserError
from costmodel.layout import layer_blocks
from costmodel.params import embedding_params, head_params, layer_params, rank_params_at, trained_params
from costmodel.registry import MODELS
from planner.space import Choice
from runtime.context_parallel import CpShard
from runtime.model import Transformer, count_params


@pytest.mark.parametrize("name", sorted(MODELS))
def test_parameter_count_equals_costmodel(name):
    """Every registry model, DeepSeek-V3's MTP module included (its own parameters: the
    embedding and output head are the model's)."""
    spec = MODELS[name]
    with torch.device("meta"):
        model = Transformer(spec)
    assert count_params(model) == trained_params(spec)


@pytest.mark.parametrize("name", ["deepseek-v3", "debug-mla"])
def test_deepseek_modules_are_the_mechanisms_costmodel_counts(name):
    """Latent attention, dense first layers, routed and shared experts, the MTP module (an expert
    layer after the model's): the sigmoid router's balancing bias is a buffer, not counted."""
    spec = MODELS[name]
    with torch.device("meta"):
        model = Transformer(spec)
    dense, moe = model.layers["0"].mlp, model.layers[str(spec.first_k_dense)].mlp
    assert not hasattr(dense, "router") and hasattr(moe, "expert_bias")
    assert len(model.mtp) == spec.mtp_depth and hasattr(model.layers[str(spec.num_layers)].mlp, "expert_bias")


def test_mtp_stages_hold_what_costmodel_counts():
    """Pipelined, the last stage holds the MTP modules and its own copy of the embedding."""
    pf = plan_file(Choice(pp=2), world=2, model="debug-mla")
    spec, plan = pf.model, pf.plan
    (n_first, n_last), num = plan.layers_per_stage, spec.num_layers
    with torch.device("meta"):
        first, last = Transformer(spec), Transformer(spec)
    first.keep_only(list(range(n_first)), first=True, last=False)
    last.keep_only(list(range(n_first, num)), first=False, last=True)
    assert count_params(first) == rank_params_at(spec, plan, n_first, True, False).total
    assert count_params(last) == rank_params_at(spec, plan, n_last, False, True).total
    assert first.mtp is None and last.mtp is not None and not last.embeds_tokens


def test_mtp_under_context_parallelism_is_refused():
    with pytest.raises(UserError, match=r"multi-token prediction \(mtp_depth\) under context parallelism"):
        Transformer(MODELS["debug-mla"]).set_context_parallel(CpShard(0, 2, None), 32)


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
