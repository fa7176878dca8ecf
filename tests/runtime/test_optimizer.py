"""The runtime's AdamW (runtime.optimizer): fused where torch runs it, one step equal to torch's
plain per-tensor loop; foreach, said so, where torch would refuse fused; fused over FSDP2's
DTensor shards as build_job makes them (the multi-rank layouts train through it in
tests/runtime/test_parity.py's AdamW cases)."""
from __future__ import annotations

import pytest
import torch
from parity import plan_file

from costmodel.specs import DType, Optimizer
from planner.space import Choice
from runtime.model import Transformer
from runtime.optimizer import adamw, fused_refusal


def _model_params(seed: int) -> list[torch.nn.Parameter]:
    pf = plan_file(Choice(), world=1)
    model = Transformer(pf.model, pf.train.attention_kernel)
    model.init_weights(seed)
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    return list(model.parameters())


def test_one_fused_step_equals_the_plain_loop():
    fused_params, plain_params = _model_params(3), _model_params(3)
    fused, note = adamw(fused_params, lr=1e-2)
    plain = torch.optim.AdamW(plain_params, lr=1e-2, foreach=False, fused=False)
    assert note is None and fused.defaults["fused"]
    for _ in range(2):   # the first step allocates the moments, the second reads them
        fused.step()
        plain.step()
    for a, b in zip(fused_params, plain_params):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fused.state[a][key], plain.state[b][key], rtol=1e-6, atol=1e-9)


def test_what_torch_would_refuse_runs_foreach_and_says_why():
    on_meta = [torch.nn.Parameter(torch.zeros(4, device="meta"))]
    assert "meta" in fused_refusal(on_meta)
    optimizer, note = adamw(on_meta, lr=1e-3)
    assert not optimizer.defaults["fused"] and optimizer.defaults["foreach"]
    assert note.startswith("foreach AdamW, not fused:") and "meta" in note and "\n" not in note


def test_fsdp2_shards_step_fused(group):
    """A one-rank job in bf16, which FSDP2 wraps: every parameter a DTensor shard, and the
    optimizer make_optimizer builds for it is the fused one and steps."""
    from runtime.job import build_job, cross_entropy
    from runtime.train import make_optimizer
    pf = plan_file(Choice(), world=1, compute_dtype=DType.BF16, optimizer=Optimizer.ADAMW)
    job = build_job(pf, torch.device("cpu"), seed=0)
    assert all(type(p).__name__ == "DTensor" for p in job.parameters())
    optimizer = make_optimizer(job, pf, lr=1e-3)
    assert optimizer.defaults["fused"]
    before = [p.detach().full_tensor().clone() for p in job.parameters()]
    tokens = torch.randint(0, pf.model.vocab_size, (2, pf.train.seq_len + 1))
    cross_entropy(job.modules[0](tokens[:, :-1]), tokens[:, 1:]).backward()
    optimizer.step()
    assert all(not torch.equal(b, p.detach().full_tensor()) for b, p in zip(before, job.parameters()))


def test_fused_adamw_over_experts_and_dense_layers_on_two_meshes():
    """Expert parallelism under ZeRO-3: the experts live on the (edp, ep) meshes, the rest on the
    dp mesh; one fused AdamW steps both, and the losses are the single process's."""
    from parity import distributed, reference
    pf = plan_file(Choice(ep=2, zero_stage=3), world=2, model="debug-moe", optimizer=Optimizer.ADAMW)
    ref_losses, _ = reference(pf, lr=1e-2)
    assert distributed(pf, lr=1e-2)["losses"] == pytest.approx(ref_losses, rel=1e-5)
