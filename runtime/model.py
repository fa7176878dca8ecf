"""The decoder the runtime trains, built from a `ModelSpec` and the cost model's layout table.

Projection names, shapes and biases come from `costmodel.layout.layer_blocks`, the table the cost
model counts FLOPs, parameters and collectives from, so the module tree and the analytical
counts agree by construction (a test checks every registry model on the meta device).

Two variants: Llama (RMSNorm, RoPE, GQA, SwiGLU, no biases; with the spec's options also Q/K/V
biases, GeGLU with Gemma's scaled embeddings and (1 + w) norm, a mixture of experts,
runtime.moe, after DeepSeek's dense first layers, multi-head latent attention,
runtime.latent_attention, and multi-token prediction, runtime.mtp) and GPT (LayerNorm, learned positions, GeLU, biases, tied embeddings). GPT's fused QKV projection stores, per KV group, the
group's query heads then its key head and value head (Megatron-LM's layout): a contiguous split
of its output features over TP ranks then hands each rank whole groups, as column parallelism
needs.

Layers live in a ModuleDict keyed by their global index, so a pipeline stage that keeps only
some layers has the same parameter names as the whole model (stable checkpoints, parity tests).
"""
from __future__ import annotations

import functools
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.bias import causal_lower_right
from torch.utils.checkpoint import checkpoint

from costmodel.inputs import UserError
from costmodel.layout import layer_blocks
from costmodel.specs import Arch, AttentionKernel, FfnKind, ModelSpec, NormKind, PositionKind
from runtime.context_parallel import CpShard, cp_attention, gather_kv
from runtime.moe import MoE
from runtime.rope import rope, rope_frequencies

INIT_STD = 0.02         # GPT-2 / Megatron-LM default
DROPOUT_P = 0.1         # Megatron-LM's hidden and attention dropout for GPT


class UnitOffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: normalised in fp32, scaled by 1 + w (w starts at zero), cast back."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.zeros(hidden)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def _norm(model: ModelSpec) -> nn.Module:
    if model.norm_kind is NormKind.RMSNORM:
        if model.norm_unit_offset:
            return UnitOffsetRMSNorm(model.hidden_size, model.norm_eps)
        return nn.RMSNorm(model.hidden_size, eps=model.norm_eps)
    return nn.LayerNorm(model.hidden_size, eps=model.norm_eps)


def _linears(module: nn.Module, block_name: str, model: ModelSpec) -> None:
    block = next(b for b in layer_blocks(model) if b.name == block_name)
    for lin in block.linears:
        module.add_module(lin.name, nn.Linear(lin.in_features, lin.out_features, bias=lin.bias))


def each_linear(block: nn.Module, x: torch.Tensor, names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """A block's input projections, each applied to `x`. Under sequence parallelism the runtime
    puts runtime.sequence_parallel's in its place (`project_in`): one all-gather of the sequence
    shard for the block, the shard alone kept for backward."""
    return tuple(getattr(block, name)(x) for name in names)


@functools.cache
def lower_right_causal(s_q: int, s_k: int):
    """torch's bottom-right causal bias (a Tensor subclass: built once per shape, before any step,
    since creating it under runtime.memtrack's dispatch mode fails; Transformer.set_context_parallel)."""
    return causal_lower_right(s_q, s_k)


def core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: AttentionKernel,
                   dropout_p: float) -> torch.Tensor:
    """Causal attention on (batch, heads, seq, head_dim); K/V may have fewer (GQA) heads. With
    more keys than queries (context parallelism) the queries are the keys' last positions."""
    s_q, s_k = q.shape[2], k.shape[2]
    if kernel is AttentionKernel.FLASH:
        causal = dict(is_causal=True) if s_q == s_k else dict(attn_mask=lower_right_causal(s_q, s_k))
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, enable_gqa=k.shape[1] != q.shape[1],
                                              **causal)
    group = q.shape[1] // k.shape[1]   # eager: the s x s scores are materialised
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).triu(1 + s_k - s_q)
    probs = F.dropout(scores.masked_fill(mask, float("-inf")).softmax(-1), dropout_p)
    return probs @ v


class Attention(nn.Module):
    def __init__(self, model: ModelSpec, kernel: AttentionKernel) -> None:
        super().__init__()
        _linears(self, "attention", model)
        self.arch, self.head_dim, self.kernel = model.arch, model.head_dim, kernel
        self.group = model.num_heads // model.num_kv_heads
        self.rope = model.position_kind is PositionKind.ROPE
        self.inv_freq = rope_frequencies(model) if self.rope else None   # not a parameter or buffer
        self.rotary_dims = model.rotary_dims
        if model.qk_norm:   # Qwen3: per head, before RoPE (whole on every TP rank: runtime.job)
            self.q_norm = nn.RMSNorm(model.head_dim, eps=model.norm_eps)
            self.k_norm = nn.RMSNorm(model.head_dim, eps=model.norm_eps)
        self.qk_norm = model.qk_norm
        self.dropout_p = DROPOUT_P if model.dropout else 0.0
        self.selective_recompute = False   # set by the runtime from the plan
        self.cp: CpShard | None = None       # context parallelism (Transformer.set_context_parallel)
        self.positions: torch.Tensor | None = None
        self.project_in = each_linear

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # the projections' sequence length: the whole sequence where x is a sequence shard (SP)
        d = self.head_dim
        if self.arch is Arch.LLAMA:   # -1: local head counts under tensor parallelism
            q, k, v = (t.view(t.shape[0], t.shape[1], -1, d) for t in self.project_in(self, x, ("wq", "wk", "wv")))
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            return q, k, v
        (fused,) = self.project_in(self, x, ("qkv",))
        b, s = fused.shape[0], fused.shape[1]
        groups = fused.view(b, s, -1, (self.group + 2) * d)
        q, k, v = groups.split((self.group * d, d, d), dim=-1)
        return q.reshape(b, s, -1, d), k, v

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(batch, seq, heads, head_dim) queries, keys and values, RoPE applied."""
        q, k, v = self._qkv(x)
        if self.rope:
            q, k = self._rope(q), self._rope(k)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in self._heads(x))
        if self.cp is not None:   # the whole sequence's K and V (kept for backward, as priced)
            k, v = gather_kv(k, v, self.cp)
        if self.selective_recompute:   # Korthikanti et al. 2022: recompute the attention core only
            out = checkpoint(self._core, q, k, v, use_reentrant=False)
        else:
            out = self._core(q, k, v)
        out = out.transpose(1, 2).flatten(2)
        return self.wo(out) if self.arch is Arch.LLAMA else self.proj(out)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        """RoPE on the first rotary_dims of each head (all of them but for GPT-NeoX)."""
        if self.rotary_dims == x.shape[-1]:
            return rope(x, self.inv_freq, self.positions)
        turned, kept = x.split((self.rotary_dims, x.shape[-1] - self.rotary_dims), dim=-1)
        return torch.cat((rope(turned, self.inv_freq, self.positions), kept), dim=-1)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout_p if self.training else 0.0
        if self.cp is None:
            return core_attention(q, k, v, self.kernel, p)
        return cp_attention(lambda *qkv: core_attention(*qkv, self.kernel, p), q, k, v, self.cp)


class Mlp(nn.Module):
    def __init__(self, model: ModelSpec) -> None:
        super().__init__()
        _linears(self, "mlp", model)
        self.kind = model.ffn_kind
        self.project_in = each_linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind is FfnKind.SWIGLU:
            gate, up = self.project_in(self, x, ("w1", "w3"))
            return self.w2(F.silu(gate) * up)
        if self.kind is FfnKind.GEGLU:
            gate, up = self.project_in(self, x, ("w1", "w3"))
            return self.w2(F.gelu(gate, approximate="tanh") * up)
        (hidden,) = self.project_in(self, x, ("fc1",))
        return self.fc2(F.gelu(hidden, approximate="none" if self.kind is FfnKind.GELU_ERF else "tanh"))


def _attention(model: ModelSpec, kernel: AttentionKernel) -> nn.Module:
    if model.is_mla:   # imported here: runtime.latent_attention builds on this module's Attention
        from runtime.latent_attention import LatentAttention
        return LatentAttention(model, kernel)
    return Attention(model, kernel)


class Layer(nn.Module):
    """Pre-norm transformer layer; dropout on each branch's output when the model has it."""

    def __init__(self, model: ModelSpec, kernel: AttentionKernel, index: int) -> None:
        super().__init__()
        self.attention_norm, self.attention = _norm(model), _attention(model, kernel)
        if not model.shared_norm:   # Falcon-7B's one norm feeds both branches
            self.mlp_norm = _norm(model)
        # DeepSeek's first `first_k_dense` layers have a dense MLP (ffn_hidden_size) before the mixtures
        self.mlp = MoE(model) if model.is_moe and index >= model.first_k_dense else Mlp(model)
        self.dropout = nn.Dropout(DROPOUT_P if model.dropout else 0.0)
        self.parallel, self.shared_norm = model.parallel_residual, model.shared_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_norm:
            n = self.attention_norm(x)
            return x + self.dropout(self.attention(n)) + self.dropout(self.mlp(n))
        if self.parallel:   # GPT-NeoX: both branches read the layer input
            return (x + self.dropout(self.attention(self.attention_norm(x)))
                    + self.dropout(self.mlp(self.mlp_norm(x))))
        x = x + self.dropout(self.attention(self.attention_norm(x)))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class Embedding(nn.Module):
    """Token embedding plus, for GPT, learned positions (kept together so that sequence
    parallelism can shard the sum, not the token part alone)."""

    def __init__(self, model: ModelSpec) -> None:
        super().__init__()
        self.tok = nn.Embedding(model.vocab_size, model.hidden_size)
        learned = model.position_kind is PositionKind.LEARNED
        self.pos = nn.Embedding(model.max_position_embeddings, model.hidden_size) if learned else None
        self.dropout = nn.Dropout(DROPOUT_P if model.dropout else 0.0)
        self.positions: torch.Tensor | None = None   # context parallelism: the tokens' places
        self.scale = model.scale_embeddings

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens)
        if self.scale:   # Gemma: by sqrt(hidden) in the compute dtype, as transformers does
            h = h * torch.tensor(h.shape[-1] ** 0.5, dtype=h.dtype)
        if self.pos is not None:
            where = torch.arange(tokens.shape[1]) if self.positions is None else self.positions
            h = h + self.pos(where.to(tokens.device))
        return self.dropout(h)


class Transformer(nn.Module):
    """The whole model, or one pipeline stage of it once `keep_only` has pruned it."""

    def __init__(self, model: ModelSpec, kernel: AttentionKernel = AttentionKernel.FLASH) -> None:
        super().__init__()
        if model.position_kind is PositionKind.ALIBI:
            raise UserError(f"model {model.name}: ALiBi positions are not implemented by the runtime")
        self.spec = model
        self.embed: Embedding | None = Embedding(model)
        self.embeds_tokens = True   # the first stage: its input is tokens, not hidden states
        # the MTP modules' layers follow the model's (runtime.mtp), as DeepSeek's checkpoint numbers them
        self.layers = nn.ModuleDict({str(i): Layer(model, kernel, i)
                                     for i in range(model.num_layers + model.mtp_depth)})
        self.norm: nn.Module | None = _norm(model)
        self.output: nn.Linear | None = nn.Linear(model.hidden_size, model.vocab_size, bias=False)
        if model.tied_embeddings:
            self.output.weight = self.embed.tok.weight
        self.mtp: nn.ModuleList | None = None
        if model.mtp_depth:   # imported here: runtime.mtp builds on this module
            from runtime.mtp import MtpHead
            self.mtp = nn.ModuleList(MtpHead(model) for _ in range(model.mtp_depth))
        self.mtp_grad_scale = 1.0   # runtime.job: the weight the step gives a micro-batch's loss

    def keep_only(self, layer_ids: list[int], *, first: bool, last: bool) -> None:
        """Prune to one pipeline stage (the last keeps the MTP modules). A tied output layer on a
        later stage than the embedding gets its own weight, and so does the embedding the MTP
        modules read there (one weight where both are), synchronised by the runtime
        (Megatron-LM's embedding group)."""
        num_main, mtp = self.spec.num_layers, self.mtp is not None
        kept = set(layer_ids) | (set(range(num_main, num_main + self.spec.mtp_depth)) if last else set())
        for i in [i for i in map(int, self.layers) if i not in kept]:
            del self.layers[str(i)]
        if last and not first and self.spec.tied_embeddings:
            self.output.weight = nn.Parameter(torch.empty_like(self.output.weight))
        if last and not first and mtp:
            self.embed.tok.weight = (self.output.weight if self.spec.tied_embeddings
                                     else nn.Parameter(torch.empty_like(self.embed.tok.weight)))
        self.embeds_tokens = first
        if not first and not (last and mtp):
            self.embed = None
        if not last:
            self.norm, self.output, self.mtp = None, None, None

    def set_context_parallel(self, shard: CpShard, seq_len: int) -> None:
        """This rank holds its CP chunks of every sequence (runtime.context_parallel)."""
        if self.spec.mtp_depth:
            raise UserError(f"model {self.spec.name}: the runtime does not build multi-token prediction "
                             "(mtp_depth) under context parallelism (its labels' shift crosses the CP "
                             "ranks' chunks); use cp 1 (planner search / predict price it)")
        positions = shard.positions(seq_len)
        for s_q, s_k in shard.attention_shapes(seq_len):
            lower_right_causal(s_q, s_k)
        if self.embed is not None:
            self.embed.positions = positions
        for layer in self.layers.values():
            layer.attention.cp, layer.attention.positions = shard, positions

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Logits on the last stage (hidden states before); `labels` (the targets) feed the MTP
        modules there, whose loss joins the main loss's in backward (runtime.mtp)."""
        h = self.embed(x) if self.embeds_tokens else x
        for key, layer in self.layers.items():
            if int(key) < self.spec.num_layers:
                h = layer(h)
        if self.norm is None:
            return h
        h = self.norm(h)
        if self.mtp is not None:
            from runtime.mtp import with_mtp_loss
            h = with_mtp_loss(self, h, labels)
        return self.output(h)

    def materialize(self, device: torch.device, seed: int) -> None:
        """Allocate on `device` (the model is built on meta) and initialise. `to_empty` makes
        new parameters, which unties a shared output weight: tie it again."""
        tied = self.embed is not None and self.output is not None and \
            self.output.weight is self.embed.tok.weight
        self.to_empty(device=device)
        for mod in self.modules():   # RoPE's frequencies, a plain attribute to_empty leaves on the host:
            if isinstance(mod, Attention) and mod.inv_freq is not None:   # moved here, not in the forward,
                mod.inv_freq = mod.inv_freq.to(device)   # whose side effect a compiled checkpoint cannot trace
        if tied:
            self.output.weight = self.embed.tok.weight
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic per parameter name, so every rank and the single-process reference
        draw the same values whatever they hold. The separate copy of a tied output weight uses
        the embedding's name, hence starts equal to it. Buffers (a sigmoid router's balancing
        bias and its step's counts: runtime.moe) start at zero."""
        for buf in self.buffers():
            buf.zero_()
        for name, param in self.named_parameters():
            key = "embed.tok.weight" if name == "output.weight" else name
            if name.endswith("bias"):
                param.zero_()
            elif "norm" in name:
                param.fill_(0.0 if self.spec.norm_unit_offset else 1.0)
            else:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)


def count_params(module: nn.Module) -> int:
    """Distinct parameters (a tied weight counts once), shapes only: works on the meta device."""
    return sum(p.numel() for p in module.parameters())
