"""DeepSeek's mechanisms through a checkpoint: latent attention's weights, and the sigmoid
routers' balancing biases (buffers every step moves, runtime.moe) resumed exactly and resharded."""
from __future__ import annotations

import pytest
from parity import SEED, plan_file

from costmodel.specs import Optimizer
from planner.space import Choice
from runtime.fork import run_forked
from runtime.train import RunConfig, run_rank

MLA = dict(model="debug-mla", mtp_depth=0)


def _losses(pf, root=None, *, steps: int, resume: bool = False) -> list[float]:
    cfg = RunConfig(steps=steps, warmup=0, seed=SEED, lr=1e-2, quiet=True, resume=resume,
                    checkpoint_dir=str(root) if root else None)
    return run_forked(pf.plan.world_size, run_rank, pf, cfg)[0]["losses"]


def test_balancing_biases_resume_resharded(tmp_path):
    """Saved under ep2 after 2 steps, resumed on two replicas holding every expert: the third
    step's loss is the uninterrupted run's (a bias left at zero would route it otherwise)."""
    saved = plan_file(Choice(ep=2, zero_stage=1), world=2, optimizer=Optimizer.ADAMW, **MLA)
    whole = _losses(saved, steps=3)
    _losses(saved, tmp_path, steps=2)
    resumed = plan_file(Choice(zero_stage=1), world=2, optimizer=Optimizer.ADAMW, **MLA)
    assert _losses(resumed, tmp_path, steps=3, resume=True) == pytest.approx(whole[2:], rel=1e-5)
