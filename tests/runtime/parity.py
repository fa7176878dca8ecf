"""Single-process reference and the distributed run it is compared with."""
from __future__ import annotations

from dataclasses import replace

import torch

from costmodel.frameworks import framework_traits
from costmodel.hardware import parse_cluster
from costmodel.plan import PlanFile
from costmodel.registry import resolve_model
from costmodel.specs import AttentionKernel, DType, Optimizer, TrainSpec
from planner.space import Choice, build_plan
from runtime.data import TokenSource
from runtime.fork import run_forked
from runtime.job import cross_entropy
from runtime.model import Transformer
from runtime.train import RunConfig, run_rank

# SGD: a wrong gradient scale shows (Adam would hide it). Two steps: the first step's loss checks
# the forward, the second's the first update, the parameters after it both updates (and that the
# gradients were cleared between them); a third step checks nothing more and costs a third.
STEPS, LR, SEED = 2, 0.5, 7


def plan_file(choice: Choice, *, world: int, model: str = "debug-tiny", seq_len: int = 32,
              global_batch: int = 8, compute_dtype: DType = DType.FP32,
              attention_kernel: AttentionKernel = AttentionKernel.FLASH,
              optimizer: Optimizer = Optimizer.SGD, framework: str | None = None, **model_changes) -> PlanFile:
    """`framework`: the plan made for that framework's traits (e.g. its expert-parallel layout,
    which the runtime follows); our runtime's by default."""
    spec = resolve_model(model)
    if model_changes:
        spec = replace(spec, **model_changes)
    train = TrainSpec(seq_len=seq_len, global_batch_size=global_batch, compute_dtype=compute_dtype,
                      grad_dtype=DType.FP32, optimizer=optimizer,
                      attention_kernel=attention_kernel)
    cluster = parse_cluster(f"1x{world}xxeon-amx")
    if framework is not None:
        cluster = replace(cluster, framework=framework_traits(framework))
    return PlanFile(plan=build_plan(spec, train, cluster, choice), model=spec, train=train,
                    cluster=cluster)


def reference(pf: PlanFile, steps: int = STEPS, lr: float = LR,
              grad_norms: list[float] | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The whole global batch in one process, the plain model, the same optimizer; each step's
    gradient norm appended to `grad_norms` where given."""
    model = Transformer(pf.model, pf.train.attention_kernel)
    model.init_weights(SEED)
    if pf.plan.fp8_linears:   # the same float8 linears in one process
        from runtime.float8 import apply_float8
        apply_float8(model)
    opt = (torch.optim.SGD(model.parameters(), lr=lr) if pf.train.optimizer is Optimizer.SGD
           else torch.optim.AdamW(model.parameters(), lr=lr))
    source = TokenSource(pf.model.vocab_size, pf.train.seq_len, SEED)
    losses = []
    for step in range(steps):
        x, y = source.batch(step * pf.train.global_batch_size, pf.train.global_batch_size)
        if pf.model.is_moe:   # the load-balancing loss is per micro-batch: the same chunks, in one process
            loss = _moe_step(model, pf, x, y)
        else:
            loss = cross_entropy(model(x, y), y)
            loss.backward()
        if grad_norms is not None:
            grad_norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        opt.step()
        opt.zero_grad()
        _update_balancing_biases(model)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _update_balancing_biases(model: Transformer) -> None:
    """DeepSeek-V3's step-end bias update from the whole batch's routed counts (runtime.moe)."""
    from runtime.moe import MoE
    for sub in model.modules():
        if isinstance(sub, MoE) and sub.sigmoid:
            sub.update_bias(sub.routed_counts.clone())
            sub.routed_counts.zero_()


def _moe_step(model: Transformer, pf: PlanFile, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradients as the plan's ranks make them: each data-parallel shard's micro-batches, each
    loss (and aux-loss gradient) weighted 1 / (micro-batches x replicas)."""
    from runtime.moe import MoE
    chunks = pf.plan.dp * pf.plan.num_micro_batches
    for sub in model.modules():
        if isinstance(sub, MoE):
            sub.aux_grad_scale = 1.0 / chunks
    model.mtp_grad_scale = 1.0 / chunks   # an MTP loss weighs as its micro-batch's loss (runtime.mtp)
    total = torch.zeros(())
    for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
        loss = cross_entropy(model(xs, ys), ys)
        (loss / chunks).backward()
        total += loss.detach() / chunks
    return total


def distributed(pf: PlanFile, steps: int = STEPS, lr: float = LR) -> dict:
    cfg = RunConfig(steps=steps, warmup=0, seed=SEED, lr=lr, collect_params=True, quiet=True)
    return run_forked(pf.plan.world_size, run_rank, pf, cfg)[0]


def assert_parity(pf: PlanFile, rtol: float = 1e-5, steps: int = STEPS) -> None:
    ref_losses, ref_params = reference(pf, steps)
    got = distributed(pf, steps)
    for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a} vs reference {b}"
    params = got["params"]
    for name, ref in ref_params.items():
        assert name in params, f"{name} missing from the distributed model"
        err = (params[name] - ref).abs().max().item()
        assert err <= rtol * max(ref.abs().max().item(), 1.0), f"{name}: max |diff| {err}"
    if "output.weight" in params and "output.weight" not in ref_params:   # tied, split copy
        assert torch.allclose(params["output.weight"], ref_params["embed.tok.weight"], atol=rtol)
