"""DeepSeek-V3's multi-token prediction (arXiv 2412.19437 Sec. 2.2), as Megatron-Core trains it
(megatron/core/transformer/multi_token_prediction.py).

Module k (1..mtp_depth) predicts, at position i, the token k + 1 places ahead. It normalises the
previous depth's hidden state (the main model's final-norm output for k = 1, module k - 1's output
after that) and the shared embedding of token i + k, concatenates them (embedding first, as
Megatron-Core's and DeepSeek's `eh_proj` take them), projects 2h -> h (`eh_proj`), runs one
transformer layer (an expert layer like the model's last: it lives in `Transformer.layers` under
index num_layers + k - 1, where DeepSeek's checkpoint stores it), normalises, and reads the shared
output head. Its loss is the cross entropy against that token, averaged over the positions that
have one (the last k have none: Megatron-Core rolls the labels and masks those). The losses are
averaged over the depths and scaled by MTP_LOSS_SCALE; their gradient joins the main loss's in
backward (Megatron-Core's MTPLossAutoScaler: runtime.moe's aux-loss function, scaled as the main
loss is per micro-batch). The reported loss stays the main one, as Megatron-Core reports it.

Token i + k is labels[i + k - 1] (labels[i] is token i + 1), so the last pipeline stage needs the
labels only, and its own copy of the embedding, kept equal to the first stage's by summing their
gradients over the two stages (runtime.job, as a tied output layer's copy).

Tensor parallelism: `eh_proj` is column-parallel with its output gathered (Megatron-Core's
ColumnParallelLinear, then gather_from_tensor_model_parallel_region); the norms are whole. Under
sequence parallelism each rank normalises its sequence shard (the norms' gradients then summed
over TP: runtime.job._tp_replicated), `eh_proj` gathers the shards and hands each rank its shard
of the output, as a layer's input. Context parallelism is refused: the labels' shift would cross
the CP ranks' chunks (Megatron-Core's roll_tensor exchanges their boundaries), not built here.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from costmodel.specs import ModelSpec
from runtime.model import _norm
from runtime.moe import _AddAuxLossGrad
from runtime.parallel import local_tensor

# lambda: DeepSeek-V3's weight of the MTP loss over its last 4.8T tokens (0.3 before);
# Megatron-Core's default mtp_loss_scaling_factor
MTP_LOSS_SCALE = 0.1


class MtpHead(nn.Module):
    """One MTP module's own parameters but its layer: the two input norms, the projection of their
    concatenation and the norm before the shared output head (costmodel.params.mtp_params)."""

    def __init__(self, model: ModelSpec) -> None:
        super().__init__()
        self.enorm, self.hnorm = _norm(model), _norm(model)
        self.eh_proj = nn.Linear(2 * model.hidden_size, model.hidden_size, bias=False)
        self.norm = _norm(model)

    def norm_parameters(self) -> list[nn.Parameter]:
        return [*self.enorm.parameters(), *self.hnorm.parameters(), *self.norm.parameters()]

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, layer: nn.Module) -> torch.Tensor:
        joined = torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1)
        return self.norm(layer(self.eh_proj(joined)))


def shifted_tokens(labels: torch.Tensor, k: int) -> torch.Tensor:
    """Token i + k at position i (labels rolled left by k - 1), zero where the sequence has none:
    those positions only reach outputs whose target is missing too (causal attention)."""
    if k == 1:
        return labels
    return torch.cat((labels[:, k - 1:], labels.new_zeros(labels.shape[0], k - 1)), dim=1)


def mtp_losses(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """Each depth's mean cross entropy; `hidden` is the main model's final-norm output and
    `model` a Transformer (or its last stage) holding the embedding, the MTP modules and the head."""
    from runtime.job import cross_entropy  # the main loss; runtime.job imports this module
    hidden = local_tensor(hidden)   # under SP the norm's output is a DTensor of sequence shards
    losses = []
    for k, head in enumerate(model.mtp, start=1):
        layer = model.layers[str(model.spec.num_layers + k - 1)]
        hidden = head(hidden, model.embed(shifted_tokens(labels, k)), layer)
        logits = model.output(hidden)
        losses.append(cross_entropy(logits[:, :-k], labels[:, k:]))
    return losses


def with_mtp_loss(model: nn.Module, hidden: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """`hidden` (the main model's final-norm output) unchanged; in backward the scaled MTP loss
    gets the gradient `model.mtp_grad_scale` (what the step gives a micro-batch's main loss:
    runtime.job), as Megatron-Core attaches it to the hidden states before the output head."""
    if labels is None:
        if model.training and torch.is_grad_enabled():
            raise ValueError("multi-token prediction trains on the labels: call the model with them")
        return hidden
    losses = mtp_losses(model, hidden, labels)
    total = torch.stack(losses).sum() * (MTP_LOSS_SCALE / len(losses))
    model.last_mtp_loss = total.detach()
    return _AddAuxLossGrad.apply(hidden, total, model.mtp_grad_scale)


def mtp_tensor_parallel(stage: nn.Module, tp_mesh: DeviceMesh, sp: bool) -> None:
    """`eh_proj` column-parallel, its output gathered (whole, or this rank's sequence shard under
    SP). The MTP layers are the stage's layers (runtime.parallel splits them as any other)."""
    if getattr(stage, "mtp", None) is None:
        return
    layout = Shard(1) if sp else Replicate()
    for head in stage.mtp:
        parallelize_module(head, tp_mesh, {"eh_proj": ColwiseParallel(input_layouts=layout, output_layouts=layout)})
