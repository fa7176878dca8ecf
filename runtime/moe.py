"""A mixture-of-experts MLP (Mixtral, Qwen-MoE, DeepSeek-V2/V3): router, top-k, experts, shared expert.

Each token's router logits (a linear map, one per expert) go through a softmax in fp32; the
`experts_per_token` largest probabilities pick its experts, renormalised to sum to one where the
model says so (Mixtral) or kept (Qwen2-MoE); every routed expert is a SwiGLU MLP and the token's
output is their weighted sum (dropless: an expert takes every token sent to it). DeepSeek-V3
(arXiv 2412.19437 Sec. 2.1.2) scores experts by sigmoids instead and picks by score plus a
per-expert bias that no gradient trains: after each step every bias moves by BIAS_UPDATE_RATE
towards balance (up for an expert that got fewer than the mean of the step's routed slots, down
for one that got more), the gating weights taken from the unbiased scores (aux-loss-free
balancing). Where the model groups its experts (DeepSeek's node-limited routing) a token chooses
only within its best `topk_groups` groups, a group scored by its best expert (V2's
group_limited_greedy) or, under sigmoid scoring, its best two (V3's noaux_tc); the gating weights
are then scaled by `routed_scaling_factor` (transformers' DeepseekV3TopkRouter). A shared SwiGLU
MLP, where the model has one, adds to every token, scaled by a sigmoid of one projection where
the model gates it (Qwen2-MoE). Expert weights are stacked per layer ((experts, out, in), as
transformers 5 stores them) in an `Experts` module of their own.

Routing sorts the k·tokens routed rows by expert (stable: each expert's rows stay in token
order), so each expert's rows are one slice. Under expert parallelism (Plan.ep) a device holds
num_experts/ep consecutive experts (a DTensor sharded on dim 0 over the EP group, runtime.parallel)
and the sorted rows go to their experts' devices in one all-to-all, preceded by one of the
per-expert counts; the device reorders what it got by local expert, runs its experts, restores
the order and sends the outputs back in a second all-to-all (the backward pass runs the same two
in reverse). This is Megatron-Core's all-to-all token dispatcher,
dropless. Under expert tensor parallelism (Plan.etp) each expert is split over etp ranks (its
gate and up projections by rows, its down projection by columns: column- then row-parallel),
each of which routes its own tokens (its sequence shard under SP, its replica's micro-batch over
dp): after the all-to-all the rows every etp rank received are gathered on each of them, each
computes its share of their outputs, and the shares are summed back to the rank that received
the rows (a reduce-scatter) before the return all-to-all, as Megatron-Core's dispatcher does
around TEGroupedMLP over its expert-TP group (dispatch_postprocess, combine_preprocess).

The load-balancing loss (Switch Transformer, Fedus et al. 2022: E * sum_e f_e * P_e over this
micro-batch's tokens, f_e the share of routed slots expert e got and P_e its mean probability;
under sigmoid scoring the scores normalised to sum to one, as DeepSeek-V3's complementary loss)
enters training the way Megatron-Core adds it: its gradient, scaled by `router_aux_loss_coef`,
joins the backward pass through the layer output, while the reported loss stays the language
model's.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from costmodel.specs import ModelSpec, RouterScoring

# DeepSeek-V3 Sec. 4.2: the bias update speed gamma, 0.001 for the first 14.3T tokens (Megatron-Core's
# moe_router_bias_update_rate default)
BIAS_UPDATE_RATE = 1e-3


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


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor, num_experts: int,
                        group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """E * sum_e f_e P_e for (tokens, experts) fp32 probabilities and (tokens, k) choices. With
    `group` (context parallelism: the micro-batch's tokens split over its ranks, equally) f is the
    whole micro-batch's (the routed counts summed over the group) and the result is this rank's
    share of the whole micro-batch's loss: the shares sum to it, and each one's gradient is the
    whole loss's gradient with respect to this rank's probabilities."""
    counts = torch.zeros(num_experts, device=probs.device, dtype=probs.dtype)
    counts.index_add_(0, chosen.flatten(), torch.ones(chosen.numel(), device=probs.device, dtype=probs.dtype))
    ranks = 1
    if group is not None:
        dist.all_reduce(counts, group=group)
        ranks = dist.get_world_size(group)
    share = counts / (chosen.numel() * ranks)
    return num_experts * (share * probs.sum(0)).sum() / (probs.shape[0] * ranks)


@contextmanager
def counted_routes(module: nn.Module):
    """Within: `module`'s sigmoid routers count their routes toward the step's bias update.
    runtime.pipeline counts only in a micro-batch's forward: torch's pipeline stages run their
    module once more, on the first step, to learn its outputs' shapes."""
    routers = [m for m in module.modules() if isinstance(m, MoE)]
    for m in routers:
        m.count_routes = True
    try:
        yield
    finally:
        for m in routers:
            m.count_routes = False


class _AllToAll(torch.autograd.Function):
    """Rows to the EP group's ranks, `send[j]` of them to rank j, `recv[j]` from it; backward the
    same the other way (every EP rank must reach both: see Experts.forward's empty case)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = rows.new_empty(sum(recv), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class Experts(nn.Module):
    """A layer's routed experts, stacked: this device's num_experts/ep of them, each its 1/etp of
    the width under expert TP. Under expert parallelism their gradient sums the contributions of
    all ep (and etp) ranks' tokens, while data parallelism averages over the edp ranks holding
    them: `grad_scale` (edp/(dp x cp),
    runtime.parallel.apply_expert_parallel) makes that the mean over all dp x cp replicas, as for
    every other weight (FSDP2's own divide factor would need PREMUL_SUM, which gloo lacks)."""

    # the dim of each weight that holds the expert's width (its ffn dim), split over expert TP
    WIDTH_DIM = {"w1": 1, "w3": 1, "w2": 2}

    def __init__(self, num_experts: int, ffn: int, hidden: int) -> None:
        super().__init__()
        self.grad_scale = 1.0
        self.w1 = nn.Parameter(torch.empty(num_experts, ffn, hidden))   # gate projection of each expert
        self.w3 = nn.Parameter(torch.empty(num_experts, ffn, hidden))   # up projection
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, ffn))   # down projection

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """`rows` sorted by local expert, `counts[e]` of them for expert e."""
        w1, w3, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2))
        if self.grad_scale != 1.0:
            w1, w3, w2 = (_ScaleGrad.apply(w, self.grad_scale) for w in (w1, w3, w2))
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                t = rows[start:start + n]
                outs.append(F.linear(F.silu(F.linear(t, w1[e])) * F.linear(t, w3[e]), w2[e]))
                start += n
        if not outs:
            # no rows here this time: the (empty) output still depends on the rows and weights, so
            # the backward pass reaches the all-to-all that brought them (every EP rank must join
            # it) and gives the weights a zero gradient, as on the ranks that got some
            return rows * 0 + 0 * (w1.sum() + w2.sum() + w3.sum())
        return torch.cat(outs)


class MoE(nn.Module):
    def __init__(self, model: ModelSpec) -> None:
        super().__init__()
        h, f, e = model.hidden_size, model.moe_ffn_hidden_size, model.num_experts
        self.top_k, self.normalise, self.aux_coef = model.experts_per_token, model.moe_norm_topk_prob, \
            model.router_aux_loss_coef
        self.num_experts = e
        self.router = nn.Linear(h, e, bias=False)
        self.sigmoid = model.router_scoring is RouterScoring.SIGMOID
        self.groups, self.topk_groups = model.num_expert_groups, model.topk_groups
        self.scaling = model.routed_scaling_factor
        self.count_routes = True   # off but within a micro-batch's forward under pipelining (counted_routes)
        if self.sigmoid:   # the balancing bias (a buffer: checkpointed, never given a gradient)
            self.register_buffer("expert_bias", torch.zeros(e))
            self.register_buffer("routed_counts", torch.zeros(e), persistent=False)   # this step's, this rank's
        self.experts = Experts(e, f, h)
        fs = model.shared_expert_ffn_hidden_size
        self.shared = nn.ModuleDict({"w1": nn.Linear(h, fs, bias=False), "w3": nn.Linear(h, fs, bias=False),
                                     "w2": nn.Linear(fs, h, bias=False)}) if fs else None
        self.shared_gate = nn.Linear(h, 1, bias=False) if model.shared_expert_gate else None
        self.aux_grad_scale = 1.0   # runtime.job: 1/micro-batches, or 1 under pipelining (which scales at the end)
        self.ep_group: dist.ProcessGroup | None = None   # runtime.parallel.apply_expert_parallel
        self.ep = 1
        self.etp_group: dist.ProcessGroup | None = None   # the expert-TP group (Plan.etp), likewise
        self.etp = 1
        self.token_group: dist.ProcessGroup | None = None   # the CP group: a micro-batch's tokens split over it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs, weights, chosen = self._route(self.router(tokens))
        order = chosen.flatten().argsort(stable=True)   # routed slots, expert by expert
        rows = order // self.top_k                       # the token of each
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts)
        routed = tokens[rows]
        y = (self.experts(routed, counts.tolist()) if self.ep_group is None and self.etp_group is None
             else self._exchange(routed, counts))
        out = torch.zeros_like(tokens).index_add(0, rows, y * weights.to(x.dtype).flatten()[order, None])
        if self.shared is not None:
            s = self.shared["w2"](F.silu(self.shared["w1"](tokens)) * self.shared["w3"](tokens))
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(tokens)) * s
            out = out + s
        if self.training and self.aux_coef > 0 and torch.is_grad_enabled():
            aux = self.aux_coef * load_balancing_loss(probs, chosen, self.num_experts, self.token_group)
            out = _AddAuxLossGrad.apply(out, aux, self.aux_grad_scale)
        return out.view_as(x)

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores for the balancing loss, gating weights, chosen experts) of each token, in fp32."""
        if not self.sigmoid:
            probs = F.softmax(logits, dim=-1, dtype=torch.float32)
            weights, chosen = self._within_groups(probs).topk(self.top_k, dim=-1)
            if self.normalise:
                weights = weights / weights.sum(-1, keepdim=True)
            return probs, weights * self.scaling, chosen
        scores = torch.sigmoid(logits.float())
        chosen = self._within_groups(scores.detach() + self.expert_bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.normalise:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)   # transformers' guard
        if self.count_routes and self.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            # counted once per forward: not again where recomputation reruns it inside backward
            self.routed_counts.index_add_(0, chosen.flatten(), torch.ones(chosen.numel(), device=chosen.device))
        return scores / scores.sum(-1, keepdim=True), weights * self.scaling, chosen

    def _within_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """`choice` with every expert outside the token's best `topk_groups` groups at -inf."""
        if self.groups == 1:
            return choice
        grouped = choice.view(choice.shape[0], self.groups, -1)
        best = 2 if self.sigmoid and grouped.shape[-1] > 1 else 1
        group_scores = grouped.topk(best, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(self.topk_groups, dim=-1).indices, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """DeepSeek-V3's step-end bias update from the step's routed slots per expert over every
        token of the batch (`counts`: routed_counts summed over the ranks, runtime.job)."""
        self.expert_bias += BIAS_UPDATE_RATE * torch.sign(counts.mean() - counts).to(self.expert_bias.dtype)

    def _exchange(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert -> their experts' devices (and under expert TP every rank of their
        etp group) -> outputs back in the same order."""
        ep, local = self.ep, self.num_experts // self.ep
        if self.ep_group is None:
            got, received = counts.view(1, local), routed
        else:
            got = torch.empty_like(counts)
            dist.all_to_all_single(got, counts, group=self.ep_group)   # (source, local expert) counts
            got = got.view(ep, local)
            send = counts.view(ep, local).sum(1).tolist()
            recv = got.sum(1).tolist()
            received = _AllToAll.apply(routed, recv, send, self.ep_group)
        if self.etp_group is not None:
            got, received, gathered = self._gather_over_etp(got, received)
        # source-major -> expert-major: segment (s, e) starts at starts[s, e] in `received`
        sources = got.shape[0]
        sizes = got.t().flatten()
        starts = (got.flatten().cumsum(0) - got.flatten()).view(sources, local).t().flatten()
        perm = torch.arange(int(sizes.sum())) + torch.repeat_interleave(starts - (sizes.cumsum(0) - sizes), sizes)
        y = self.experts(received[perm], got.sum(0).tolist())
        back = torch.empty_like(perm)
        back[perm] = torch.arange(perm.numel())
        y = y[back]
        if self.etp_group is not None:
            y = self._reduce_scatter_over_etp(y, gathered)
        if self.ep_group is None:
            return y
        return _AllToAll.apply(y, send, recv, self.ep_group)

    def _gather_over_etp(self, got: torch.Tensor,
                         received: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Every etp rank's received rows on each of them (Megatron-Core's all-gather over the
        expert-TP group after the dispatch; each rank routed its own tokens): their (etp x
        sources, local expert) counts, the rows rank by rank, and each rank's row count. An
        all-to-all of this rank's rows to every member: backward, each member's gradient of them
        comes back and the copies' sum is the reduce-scatter."""
        parts = [torch.empty_like(got) for _ in range(self.etp)]
        dist.all_gather(parts, got.contiguous(), group=self.etp_group)
        gathered = [int(p.sum()) for p in parts]
        mine = received.shape[0]
        rows = _AllToAll.apply(received.repeat(self.etp, 1), gathered, [mine] * self.etp, self.etp_group)
        return torch.cat(parts), rows, gathered

    def _reduce_scatter_over_etp(self, y: torch.Tensor, gathered: list[int]) -> torch.Tensor:
        """Each etp rank's partial outputs (its 1/etp of every expert's width) summed for the rows
        of the rank that received them (the reduce-scatter before the return): `gathered[j]` rows
        to rank j, this rank's from every member, summed in rank order (the same on every rank)."""
        mine = gathered[dist.get_rank(self.etp_group)]
        parts = _AllToAll.apply(y, [mine] * self.etp, gathered, self.etp_group)
        return parts.view(self.etp, mine, *y.shape[1:]).sum(0)
