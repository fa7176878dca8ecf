"""What a full recomputation runs again, as the runtime checkpoints a layer, against what the cost
model prices (costmodel.kernels.final_linear_forward_s, the `recompute_early_stop` trait).

torch's non-reentrant checkpoint stops recomputing once every tensor the backward needs is saved
again. A dispatch mode counts the GEMMs of a layer's forward and of its backward with and
without the checkpoint: the backward's extra GEMMs are the recomputation's, and the forward's
GEMMs it does not run are what the early stop skipped.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from parity import plan_file
from torch.utils._python_dispatch import TorchDispatchMode

from costmodel.estimate import estimate
from costmodel.flops import stops_before_final_linear
from costmodel.frameworks import FRAMEWORKS
from costmodel.hardware import parse_cluster
from costmodel.kernels import layer_kernel_times
from costmodel.plan import Recompute
from costmodel.registry import resolve_model
from planner.space import Choice
from runtime.model import Transformer
from runtime.parallel import apply_recompute

GEMMS = {"mm", "addmm", "bmm"}


class _Gemms(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._schema.name.split("::")[-1] in GEMMS
        return func(*args, **(kwargs or {}))


def _gemms(model_name: str, recompute: bool) -> tuple[int, int]:
    """(forward, backward) GEMMs of one layer of `model_name` as the runtime builds it."""
    pf = plan_file(Choice(micro_batch_size=2, recompute=Recompute.FULL), world=1, model=model_name)
    spec = replace(pf.model, num_layers=1)
    torch.manual_seed(0)
    model = Transformer(spec, pf.train.attention_kernel)
    model.init_weights(0)
    if recompute:
        apply_recompute(model, pf.plan, [0])
    layer = model.layers["0"]
    x = torch.randn(2, 16, spec.hidden_size, requires_grad=True)
    forward, backward = _Gemms(), _Gemms()
    with forward:
        y = layer(x)
    with backward:
        y.sum().backward()
    return forward.count, backward.count


@pytest.mark.parametrize("model_name", ["debug-tiny", "debug-tiny-gpt", "debug-moe"])
def test_the_recomputation_skips_what_the_model_leaves_out(model_name):
    forward, plain = _gemms(model_name, recompute=False)
    _, checkpointed = _gemms(model_name, recompute=True)
    recomputed = checkpointed - plain
    assert 0 < recomputed <= forward
    pf = plan_file(Choice(micro_batch_size=2, recompute=Recompute.FULL), world=1, model=model_name)
    # debug-tiny (Llama-style, no dropout): the MLP's down projection; debug-tiny-gpt ends its
    # MLP in a dropout, whose mask needs the GEMM's output; debug-moe's combine saves the routing
    assert forward - recomputed == (1 if model_name == "debug-tiny" else 0)
    assert stops_before_final_linear(pf.model, pf.plan) == (model_name == "debug-tiny")


def test_only_a_framework_that_stops_early_prices_it():
    model = resolve_model("debug-small")
    pf = plan_file(Choice(micro_batch_size=2, recompute=Recompute.FULL), world=1, model="debug-small")
    device = parse_cluster("1x1xa100").device
    how = (True, False, False, True)
    early = layer_kernel_times(model, pf.train, pf.plan, device, *how, True)
    whole = layer_kernel_times(model, pf.train, pf.plan, device, *how, False)
    assert whole.recompute_forward_s == whole.forward_s
    assert early.recompute_forward_s < early.forward_s
    assert FRAMEWORKS["planner"].recompute_early_stop and not FRAMEWORKS["megatron-lm"].recompute_early_stop


def test_hardware_flops_count_what_the_recomputation_runs():
    """HFU's numerator leaves out the projection an early stop skips: w2 is 1024 x 384 of the
    layer's 4 x 384^2 + 3 x 384 x 1024 projection weights here (no attention term: it is the same)."""
    pf = plan_file(Choice(micro_batch_size=2, recompute=Recompute.FULL), world=1, model="debug-tiny",
                   hidden_size=384, num_heads=6, num_kv_heads=6, ffn_hidden_size=1024)
    ours = estimate(pf.model, pf.train, pf.cluster, pf.plan)
    megatron = estimate(pf.model, pf.train, replace(pf.cluster, framework=FRAMEWORKS["megatron-lm"]), pf.plan)
    skipped = 2 * pf.train.global_batch_size * pf.train.seq_len * 1024 * 384 * pf.model.num_layers
    assert ours.model_flops == megatron.model_flops
    assert megatron.executed_flops - ours.executed_flops == skipped
