"""A mixture-of-experts MLP (Mixtral, Qwen-MoE): router, top-k, experts, shared expert.

Each token's router logits (a linear map, one per expert) go through a softmax in fp32; the
`experts_per_token` largest probabilities pick its experts, renormalised to sum to one where the
model says so (Mixtral) or kept (Qwen2-MoE); every routed expert is a SwiGLU MLP and the token's
output is their weighted sum (dropless: an expert takes every token sent to it). A shared SwiGLU
MLP, where the model has one, adds to every token, scaled by a sigmoid of one projection where
the model gates it (Qwen2-MoE). Expert weights are stacked per layer ((experts, out, in), as
transformers 5 stores them), so that expert parallelism can later shard their first dimension.

The load-balancing loss (Switch Transformer, Fedus et al. 2022: E * sum_e f_e * P_e over this
micro-batch's tokens, f_e the share of routed slots expert e got and P_e its mean probability)
enters training the way Megatron-Core adds it: its gradient, scaled by `router_aux_loss_coef`,
joins the backward pass through the layer output, while the reported loss stays the language
model's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from costmodel.specs import ModelSpec


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on `out`; in backward the aux loss's graph also gets a gradient, `scale` (the
    factor the step applies to each micro-batch's language-model loss, 1/micro-batches)."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """E * sum_e f_e P_e for (tokens, experts) fp32 probabilities and (tokens, k) choices."""
    counts = torch.zeros(num_experts, device=probs.device, dtype=probs.dtype)
    counts.index_add_(0, chosen.flatten(), torch.ones(chosen.numel(), device=probs.device, dtype=probs.dtype))
    share = counts / chosen.numel()
    return num_experts * (share * probs.mean(0)).sum()


class MoE(nn.Module):
    def __init__(self, model: ModelSpec) -> None:
        super().__init__()
        h, f, e = model.hidden_size, model.moe_ffn_hidden_size, model.num_experts
        self.top_k, self.normalise, self.aux_coef = model.experts_per_token, model.moe_norm_topk_prob, \
            model.router_aux_loss_coef
        self.router = nn.Linear(h, e, bias=False)
        self.w1 = nn.Parameter(torch.empty(e, f, h))   # gate projection of each expert
        self.w3 = nn.Parameter(torch.empty(e, f, h))   # up projection
        self.w2 = nn.Parameter(torch.empty(e, h, f))   # down projection
        fs = model.shared_expert_ffn_hidden_size
        self.shared = nn.ModuleDict({"w1": nn.Linear(h, fs, bias=False), "w3": nn.Linear(h, fs, bias=False),
                                     "w2": nn.Linear(fs, h, bias=False)}) if fs else None
        self.shared_gate = nn.Linear(h, 1, bias=False) if model.shared_expert_gate else None
        self.aux_grad_scale = 1.0   # runtime.job: 1/micro-batches, or 1 under pipelining (which scales at the end)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(tokens), dim=-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(tokens)
        for e in range(self.w1.shape[0]):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            t = tokens[rows]
            y = F.linear(F.silu(F.linear(t, self.w1[e])) * F.linear(t, self.w3[e]), self.w2[e])
            out = out.index_add(0, rows, y * weights[rows, slot, None])
        if self.shared is not None:
            s = self.shared["w2"](F.silu(self.shared["w1"](tokens)) * self.shared["w3"](tokens))
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(tokens)) * s
            out = out + s
        if self.training and self.aux_coef > 0 and torch.is_grad_enabled():
            aux = self.aux_coef * load_balancing_loss(probs, chosen, self.w1.shape[0])
            out = _AddAuxLossGrad.apply(out, aux, self.aux_grad_scale)
        return out.view_as(x)
