"""The runtime's eager layer on torch's CPU kernels, counted op by op, against the cost model's
count of its memory-bound work (costmodel.kernels.eager_elementwise_traffic).

A dispatch mode sees every aten op of one layer's forward and backward; the GEMM-like ones
(matmuls, attention) are priced elsewhere, views and allocations move nothing. Of the rest it sums
the bytes of inputs and outputs and the number of kernels. The model counts the same ops (RMSNorm
composite in fp32 with its casts, RoPE rotate-half with its tables, SwiGLU, residual adds, the
gradient sums where projections share an input); small tensors it leaves out (the 1/rms rows, the
cos / sin tables' bytes, broadcast weights) keep the measured bytes a little above it.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from parity import plan_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from costmodel.kernels import eager_elementwise_traffic
from costmodel.registry import llama_spec
from costmodel.specs import DType
from planner.space import Choice
from runtime.layer_ops import GEMM_OPS, MOVES_NOTHING, SDPA_OPS
from runtime.model import Transformer

PRICED_ELSEWHERE = GEMM_OPS | SDPA_OPS


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.bytes, self.kernels = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.split("::")[-1]
        if name not in MOVES_NOTHING | PRICED_ELSEWHERE:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            self.kernels += 1
        return out


# a Llama-style layer with GQA and an FFN width apart from the hidden size
MODEL = llama_spec("traffic", layers=1, hidden=128, heads=4, kv_heads=2, ffn=352, vocab=512, max_pos=64,
                   source="test")


@pytest.mark.parametrize("dtype", [DType.FP32, DType.BF16])
def test_the_layer_moves_what_the_model_counts(dtype):
    pf = plan_file(Choice(micro_batch_size=2), world=1, seq_len=64, compute_dtype=dtype)
    pf = replace(pf, model=MODEL)
    torch_dtype = torch.float32 if dtype is DType.FP32 else torch.bfloat16
    model = Transformer(MODEL, pf.train.attention_kernel)
    model.init_weights(0)
    layer = model.layers["0"].to(torch_dtype)
    x = torch.randn(2, 64, MODEL.hidden_size, dtype=torch_dtype, requires_grad=True)
    with _Count() as forward:
        y = layer(x)
    with _Count() as backward:
        y.backward(torch.ones_like(y))
    tokens = 2 * 64
    fwd_b, fwd_k, bwd_b, bwd_k = eager_elementwise_traffic(MODEL, pf.train, pf.plan, tokens, a=dtype.num_bytes)
    assert (forward.kernels, backward.kernels) == (fwd_k, bwd_k)
    assert 1.0 <= forward.bytes / fwd_b <= 1.12, (forward.bytes, fwd_b)
    assert 0.95 <= backward.bytes / bwd_b <= 1.05, (backward.bytes, bwd_b)
