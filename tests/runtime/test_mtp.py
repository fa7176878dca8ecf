"""Multi-token prediction (runtime.mtp) against a hand-written forward of DeepSeek-V3 Sec. 2.2 /
Megatron-Core's MTP from the same weights: the losses and every parameter's gradient. The
reference truncates each depth's sequence to the positions that have a target instead of
rolling and masking, builds the total loss itself (main + scale x mean over depths) and reuses
only the transformer layers (tested on their own against transformers: test_hf_deepseek)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from costmodel.registry import MODELS
from runtime.job import cross_entropy
from runtime.model import Transformer
from runtime.mtp import MTP_LOSS_SCALE

# two depths (the second chains on the first's output); no load-balancing loss, whose gradient
# would depend on how many positions each depth runs
SPEC = replace(MODELS["debug-mla"], mtp_depth=2, router_aux_loss_coef=0.0)
BATCH, SEQ = 2, 12


def _rms(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + SPEC.norm_eps) * norm.weight


def _reference_losses(model: Transformer, seq: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The main loss and each depth's, seq holding SEQ + 1 tokens (inputs and targets)."""
    emb, head = model.embed.tok.weight, model.output.weight
    h = emb[seq[:, :SEQ]]
    for i in range(SPEC.num_layers):
        h = model.layers[str(i)](h)
    h = _rms(h, model.norm)
    main = F.cross_entropy((h @ head.T).flatten(0, 1), seq[:, 1:].flatten())
    depths = []
    for k in range(1, SPEC.mtp_depth + 1):
        n = SEQ - k   # positions i with a token i + k + 1
        mod, layer = model.mtp[k - 1], model.layers[str(SPEC.num_layers + k - 1)]
        joined = torch.cat((_rms(emb[seq[:, k:k + n]], mod.enorm), _rms(h[:, :n], mod.hnorm)), dim=-1)
        h = _rms(layer(joined @ mod.eh_proj.weight.T), mod.norm)
        depths.append(F.cross_entropy((h @ head.T).flatten(0, 1), seq[:, k + 1:k + 1 + n].flatten()))
    return main, depths


@pytest.fixture(scope="module")
def pair():
    seq = torch.randint(0, SPEC.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(5))
    models = [Transformer(SPEC), Transformer(SPEC)]
    for m in models:
        m.init_weights(11)
    return seq, models


def test_losses_and_gradients_equal_a_hand_written_reference(pair):
    seq, (model, ref) = pair
    x, y = seq[:, :-1], seq[:, 1:]
    loss = cross_entropy(model(x, y), y)
    loss.backward()
    main, depths = _reference_losses(ref, seq)
    scaled = MTP_LOSS_SCALE * torch.stack(depths).mean()
    (main + scaled).backward()
    torch.testing.assert_close(loss, main, rtol=1e-5, atol=0)
    torch.testing.assert_close(model.last_mtp_loss, scaled.detach(), rtol=1e-5, atol=0)
    assert 0 < scaled.item() < main.item()
    theirs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-4, atol=1e-7, msg=name)
    assert model.mtp[1].eh_proj.weight.grad.abs().sum() > 0   # the second depth trains


def test_training_without_labels_is_a_bug_not_a_silent_skip(pair):
    _, (model, _) = pair
    with pytest.raises(ValueError, match="labels"):
        model(torch.zeros(1, 4, dtype=torch.long))
    with torch.no_grad():   # inference: the main logits alone
        assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, SPEC.vocab_size)
