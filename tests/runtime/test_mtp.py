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

from costmodel.memory.activations import deepseek_edge_bytes
from costmodel.registry import MODELS
from planner.space import Choice
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


def _saved_bytes(spec, train, batch: int) -> int:
    """Distinct storages autograd keeps for one forward and loss (parameters excluded)."""
    from test_activation_memory import _plain, _storage_key
    model = Transformer(spec, train.attention_kernel)
    model.init_weights(0)
    seen = {}

    def pack(t):
        key, _ = _storage_key(t)
        if key is not None:
            seen.setdefault(key, _plain(t).untyped_storage())
        return t

    x = torch.randint(0, spec.vocab_size, (batch, train.seq_len), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        cross_entropy(model(x, x), x)
    weights = {_storage_key(p)[0] for p in model.parameters()}
    return sum(st.nbytes() for key, st in seen.items() if key not in weights)


def test_what_an_mtp_module_keeps_is_what_costmodel_counts():
    """The model with its MTP modules less the model without: within 3 % of the last rank's MTP
    bytes (costmodel.memory.activations.deepseek_edge_bytes) on this CPU's kernels, in fp32."""
    from parity import plan_file
    pf = plan_file(Choice(micro_batch_size=4), world=1, seq_len=256, global_batch=4, model="debug-mla", mtp_depth=2)
    measured = _saved_bytes(pf.model, pf.train, 4) - _saved_bytes(replace(pf.model, mtp_depth=0), pf.train, 4)
    counted = deepseek_edge_bytes(pf.model, pf.train, pf.plan, False, True, pf.cluster.framework)
    assert measured == pytest.approx(counted, rel=0.03)
