"""Expert parallelism's token exchange on its own: a rank whose experts get no token still joins
both all-to-alls forward and backward (else its peers wait forever), and the layer's output and
gradients equal one process holding every expert."""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from costmodel.registry import resolve_model
from runtime.fork import run_forked
from runtime.moe import MoE
from runtime.parallel import apply_expert_parallel

TOKENS = 6


def _layer() -> tuple[MoE, torch.Tensor]:
    """debug-moe's mixture with a router that sends every token to experts 0 and 1 (the first
    EP rank's under ep2)."""
    torch.manual_seed(0)
    moe = MoE(resolve_model("debug-moe"))
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[:2] = 1.0
    x = torch.rand(TOKENS, moe.router.in_features) + 0.1   # positive: logits of experts 0, 1 win
    return moe, x


def _expert_grads(moe: MoE) -> torch.Tensor:
    return torch.cat([w.grad.flatten() for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2)])


def _rank_part(ep: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's output, input gradient and its experts' gradients."""
    moe, x = _layer()
    mesh = init_device_mesh("cpu", (1, ep), mesh_dim_names=("edp", "ep"))   # ep ranks of dp, one replica each
    apply_expert_parallel(moe, mesh, SimpleNamespace(ep=ep, etp=1, dp=ep, cp=1))
    x = x.clone().requires_grad_(True)
    out = moe(x)
    out.sum().backward()
    grads = torch.cat([w.grad.to_local().flatten() for w in (moe.experts.w1, moe.experts.w3, moe.experts.w2)])
    return out.detach(), x.grad, grads, torch.tensor(dist.get_rank())


def test_a_rank_without_tokens_joins_the_exchange_and_the_layer_equals_one_process():
    moe, x = _layer()
    x = x.clone().requires_grad_(True)
    out = moe(x)
    out.sum().backward()
    ref_out, ref_dx = out.detach(), x.grad
    local = moe.num_experts // 2
    full = {name: w.grad for name, w in (("w1", moe.experts.w1), ("w3", moe.experts.w3), ("w2", moe.experts.w2))}
    for got_out, got_dx, got_grads, rank in run_forked(2, _rank_part, 2):
        assert torch.allclose(got_out, ref_out, rtol=1e-5, atol=1e-6)   # same tokens on every rank
        assert torch.allclose(got_dx, ref_dx, rtol=1e-5, atol=1e-6)
        r = int(rank)
        want = torch.cat([full[n][r * local:(r + 1) * local].flatten() for n in ("w1", "w3", "w2")])
        # both ranks route the same tokens: rank 0's experts get both ranks' rows, and their
        # gradient, scaled by 1/ep, is the single process's; rank 1's get none (zero, not a hang)
        assert torch.allclose(got_grads, want, rtol=1e-5, atol=1e-6)
    assert not full["w1"][local:].any()
