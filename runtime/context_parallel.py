"""Context parallelism: a sequence split over the ranks of the CP group, attention by all-gather.

Causal attention makes late tokens dearer than early ones, so the sequence is cut into 2·cp
chunks and CP rank r holds chunks r and 2·cp-1-r (Megatron-Core's and Llama 3's load balance):
every rank then has the same attention work, as the cost model assumes. Before attention each
rank all-gathers K and V over the CP group (Llama 3, Dubey et al. 2024 Sec. 3.3.2: with GQA the
K/V are small beside Q, and one all-gather is simpler to get right than a ring), and its local
queries attend the keys up to their own positions; the backward pass reduce-scatters the K/V
gradients (funcol's autograd collectives). The cost model prices exactly this
(costmodel.frameworks `cp_all_gather_kv`).

Positions (RoPE, learned embeddings) are the tokens' places in the whole sequence, so the
model is told them; the loss is a mean over this rank's tokens, and since every CP rank has as
many, the mean over the CP group (FSDP averages gradients over dp x cp) is the sequence's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol


@dataclass(frozen=True)
class CpShard:
    """This rank's place in its CP group."""
    rank: int
    size: int
    group: object   # the CP process group

    @property
    def chunks(self) -> tuple[int, int]:
        """The two chunk indices this rank holds (of 2·cp)."""
        return self.rank, 2 * self.size - 1 - self.rank

    def positions(self, seq_len: int) -> torch.Tensor:
        c = seq_len // (2 * self.size)
        return torch.cat([torch.arange(i * c, (i + 1) * c) for i in self.chunks])

    def attention_shapes(self, seq_len: int) -> list[tuple[int, int]]:
        """(queries, keys) of each chunk's attention: c queries against the keys up to its end."""
        c = seq_len // (2 * self.size)
        return [(c, (i + 1) * c) for i in self.chunks]

    def local(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of whole sequences along `dim`."""
        parts = x.chunk(2 * self.size, dim=dim)
        return torch.cat([parts[i] for i in self.chunks], dim=dim)


def gather_kv(k: torch.Tensor, v: torch.Tensor, shard: CpShard) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the whole sequence, in sequence order, from every rank's two chunks
    ((batch, heads, local seq, head_dim) in, (batch, heads, seq, head_dim) out)."""
    kv = torch.stack((k, v)).contiguous()                      # one collective for both
    every = funcol.all_gather_single_autograd(kv, gather_dim=0, group=shard.group)
    every = every.view(shard.size, *kv.shape)                  # (cp, 2, b, h, 2c, d)
    halves = every.chunk(2, dim=4)                             # chunk r and chunk 2cp-1-r
    order = [halves[0][r] for r in range(shard.size)] + [halves[1][r] for r in reversed(range(shard.size))]
    whole = torch.cat(order, dim=3)                            # (2, b, h, s, d)
    return whole[0], whole[1]


def cp_attention(attend, q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                 shard: CpShard) -> torch.Tensor:
    """Causal attention of this rank's two query chunks against the keys before them;
    `attend(q, k, v)` is causal attention whose queries are the last of the keys' positions."""
    c = q.shape[2] // 2   # this rank's two chunks of c queries each
    outs = []
    for j, (_, end) in enumerate(shard.attention_shapes(k_all.shape[2])):
        outs.append(attend(q[:, :, j * c:(j + 1) * c], k_all[:, :, :end], v_all[:, :, :end]))
    return torch.cat(outs, dim=2)
