"""Multi-head latent attention (DeepSeek-V2, arXiv 2405.04434 Sec. 2.1), in its training form.

The layer input goes down to a query latent (`wq_a`, q_lora_rank wide, RMSNorm'd; none without
query compression: `wq` then reads the input) and to a key/value latent plus one RoPE key for all
heads (`wkv_a`, kv_lora_rank + qk_rope_head_dim wide, the latent part RMSNorm'd). Each head's query
(qk_nope_head_dim + qk_rope_head_dim) comes up from the query latent (`wq_b`), its no-RoPE key and
its value (v_head_dim) from the key/value latent (`wkv_b`); RoPE turns the query's RoPE part and
the shared key, which every head's key ends with. Causal attention over those heads, scaled by
1/sqrt(qk head dim), and `wo` back to hidden. transformers' DeepseekV3Attention computes the same
(its latent norms' epsilon 1e-6 whatever rms_norm_eps says; its RoPE on interleaved pairs, a
permutation of the RoPE dimensions, where rope_interleave is set). No absorption: training keeps
each head's K and V, as costmodel.flops counts them.

Under tensor parallelism (costmodel.layout's MLA rows) the heads are split: `wq_b`, `wkv_b` hold
their heads' rows, `wo` its heads' columns; the down-projections and the latent norms are whole on
every TP rank. What the heads read (the query latent or the input, the key/value latent, the RoPE
key) is joined into one tensor and goes through `heads_in`: under sequence parallelism an
all-gather of every rank's sequence shard (a reduce-scatter of its gradient: each rank's heads
add their part), so each rank runs the down-projections on its own shard and their gradients are
summed over TP (runtime.job.sync_replicated_over_tp; costmodel tp_replica_sync_s prices it);
without it, the whole sequence on every rank and its gradient all-reduced, as Megatron-Core's
column-parallel input, leaving the down-projections' gradients equal on every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from costmodel.specs import AttentionKernel, ModelSpec
from runtime.model import Attention
from runtime.sequence_parallel import GatheredColumns, gather_sequence, scatter_sequence

LATENT_NORM_EPS = 1e-6   # transformers' DeepseekV3RMSNorm default, which q_a_layernorm / kv_a_layernorm keep


class _GatherSequence(torch.autograd.Function):
    """The whole sequence from the TP ranks' shards; backward, the summed gradient's shard."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return scatter_sequence(grad, ctx.group), None


class _SumGradient(torch.autograd.Function):
    """Identity; backward, the gradient summed over the TP ranks (each holds some heads)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class HeadsInput:
    """`LatentAttention.heads_in` under tensor parallelism (runtime.parallel sets it)."""

    def __init__(self, group, sequence_parallel: bool) -> None:
        self.group, self.sequence_parallel = group, sequence_parallel

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return (_GatherSequence if self.sequence_parallel else _SumGradient).apply(t, self.group)

    def project(self, block: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
        """A column-parallel projection of the layer input itself (the query without its
        latent): under SP the shard kept, gathered again in backward (runtime.sequence_parallel)."""
        if self.sequence_parallel:
            return GatheredColumns(self.group)(block, x, (name,))[0]
        return _project(getattr(block, name), self(x))


def _project(lin: nn.Linear, t: torch.Tensor) -> torch.Tensor:
    """`lin` on `t`; a TP-sharded weight (ColwiseWeights: no hooks) as this rank's rows."""
    if isinstance(lin.weight, DTensor):
        return F.linear(t, lin.weight.to_local())
    return lin(t)


class _Whole:
    """`heads_in` without tensor parallelism: every head is here."""

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def project(self, block: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
        return getattr(block, name)(x)


class LatentAttention(Attention):
    """MLA as above (its projections from costmodel.layout's MLA rows, built by Attention);
    forward, recomputation and context parallelism are Attention's."""

    def __init__(self, model: ModelSpec, kernel: AttentionKernel) -> None:
        super().__init__(model, kernel)
        self.q_rank, self.kv_rank = model.q_lora_rank, model.kv_lora_rank
        self.nope, self.rope_dims, self.v_dim = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
        if self.q_rank:
            self.q_latent_norm = nn.RMSNorm(self.q_rank, eps=LATENT_NORM_EPS)
        self.kv_latent_norm = nn.RMSNorm(self.kv_rank, eps=LATENT_NORM_EPS)
        self.heads_in: HeadsInput | _Whole = _Whole()

    def down_parameters(self) -> list[nn.Parameter]:
        """The down-projections and latent norms: whole on every TP rank, which under sequence
        parallelism trains them on its own shard."""
        down = ("wq_a", "q_latent_norm", "wkv_a", "kv_latent_norm")
        return [p for name in down if hasattr(self, name) for p in getattr(self, name).parameters()]

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        latent, k_rope = self.wkv_a(x).split((self.kv_rank, self.rope_dims), dim=-1)
        latent = self.kv_latent_norm(latent)
        if self.q_rank:   # both latents in one collective; the up-projections keep views of it
            joined = self.heads_in(torch.cat((self.q_latent_norm(self.wq_a(x)), latent), dim=-1))
            q_latent, latent = joined.split((self.q_rank, self.kv_rank), dim=-1)
            q = _project(self.wq_b, q_latent)
        else:
            q, latent = self.heads_in.project(self, "wq", x), self.heads_in(latent)
        k_rope = self.heads_in(k_rope)   # apart: RoPE's backward keeps none of it
        b, s = q.shape[0], q.shape[1]
        q = q.view(b, s, -1, self.nope + self.rope_dims)
        kv = _project(self.wkv_b, latent).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split((self.nope, self.v_dim), dim=-1)
        q_nope, q_rope = q.split((self.nope, self.rope_dims), dim=-1)
        k_rope = self._rope(k_rope.view(b, s, 1, self.rope_dims)).expand(-1, -1, k_nope.shape[2], -1)
        return torch.cat((q_nope, self._rope(q_rope)), dim=-1), torch.cat((k_nope, k_rope), dim=-1), v

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Values zero-padded to the query/key head size for a fused kernel (FlashAttention and
        torch's CPU flash kernel take one head size; a narrower V sends SDPA to its math path,
        which keeps the s x s probabilities), the output cut back to v_head_dim."""
        if self.kernel is not AttentionKernel.FLASH or v.shape[-1] == q.shape[-1]:
            return super()._core(q, k, v)
        return super()._core(q, k, F.pad(v, (0, q.shape[-1] - v.shape[-1])))[..., :self.v_dim]

