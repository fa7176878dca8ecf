"""A run that breaks says so: a loss that stops being finite stops the run at that step with
exit 1 and one line naming it (no checkpoint of the broken state); `--resume` into a directory
without a checkpoint is an error, unless `--resume-if-present` asks to start afresh then."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from parity import SEED, distributed, plan_file, reference

from costmodel.measured import MeasuredRun
from planner.cli import main
from planner.space import Choice
from runtime import checkpoint
from runtime.fork import run_forked
from runtime.train import RunConfig, run_rank

TINY = ["predict", "--model", "debug-tiny", "--cluster", "1x2xxeon-amx", "--dtype", "fp32"]


def _plan(tmp_path: Path) -> Path:
    assert main([*TINY, "--out", str(tmp_path / "plan.json")]) == 0
    return tmp_path / "plan.json"


def test_a_diverged_run_stops_at_the_step_with_exit_1_and_keeps_no_broken_checkpoint(tmp_path, capsys):
    plan = _plan(tmp_path)
    capsys.readouterr()
    ckpt = tmp_path / "ckpt"
    code = main(["run", str(plan), "--steps", "4", "--warmup", "1", "--out", str(tmp_path / "run"),
                 "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1", "--inject-fault", "1:2:nan"])
    everything = capsys.readouterr().err.splitlines()
    err = [line for line in everything if not line.startswith("[planner run]")]
    assert code == 1
    stopped = [line for line in err if "stopped:" in line]
    assert len(stopped) == 1 and "training diverged at step 2/4 on rank 1: loss nan" in stopped[0], err   # as the progress lines count
    step = 3   # the first non-finite loss: rank 1's layers output NaN in the third step
    assert checkpoint.complete_steps(ckpt) == [1, 2]   # every step before it, never the broken state
    progress = [line for line in everything if line.startswith("[planner run]") and "grad norm" in line]
    assert progress and all("loss" in line for line in progress)
    # the last warm-up step tracks every live tensor on CPU, and its line says why it is slower
    assert [("tracked" in line) for line in progress] == [line.startswith("[planner run] warm-up 1/1")
                                                           for line in progress]
    measured = MeasuredRun.load(tmp_path / "run" / "measured.json")   # the timed steps, marked
    assert not measured.complete and measured.diverged["step"] == step
    assert len(measured.grad_norms) == len(measured.losses) == step
    assert None in (measured.losses[-1], measured.grad_norms[-1])   # null: not finite (JSON has no NaN)
    assert None not in measured.grad_norms[:-1]


def test_max_nonfinite_steps_skips_the_update_of_a_bad_step_and_stops_at_the_nth_in_a_row(monkeypatch):
    """A non-finite gradient norm (injected at steps 2 and 3 of 5, one rank's) skips that step's
    update: with --max-nonfinite-steps 3 the run ends, with 2 it stops at step 3 naming the rank."""
    import runtime.health
    from runtime.fork import RankFailed
    from runtime.parallel import local_tensor
    pf = plan_file(Choice(zero_stage=1, micro_batch_size=2), world=2)
    real, calls = runtime.health.grad_sq_share, [0]

    def poisoned(job):   # rank 1's shard of the first gradient, NaN after the backward of steps 2 and 3
        calls[0] += 1
        if calls[0] in (2, 3) and job.coords["dp"] == 1:
            local_tensor(next(iter(job.modules[0].parameters())).grad).fill_(math.nan)
        return real(job)
    monkeypatch.setattr(runtime.health, "grad_sq_share", poisoned)
    tolerant = RunConfig(steps=5, warmup=0, seed=SEED, lr=0.5, quiet=True, max_nonfinite_steps=3)
    got = run_forked(2, run_rank, pf, tolerant)[0]
    assert [math.isfinite(x) for x in got["grad_norms"]] == [True, False, False, True, True]
    assert all(math.isfinite(x) for x in got["losses"])   # the NaN gradients never reached the weights
    with pytest.raises(RankFailed, match=r"training diverged at step 3/5 on rank 1: .*gradient norm nan \(2 non-finite"):
        run_forked(2, run_rank, pf, RunConfig(steps=5, warmup=0, seed=SEED, lr=0.5, quiet=True, max_nonfinite_steps=2))


def test_resume_without_a_checkpoint_is_an_error_and_resume_if_present_starts_afresh(tmp_path, capsys):
    plan = _plan(tmp_path)
    capsys.readouterr()
    missing = tmp_path / "misspelt"
    assert main(["run", str(plan), "--steps", "1", "--checkpoint-dir", str(missing), "--resume",
                 "--out", str(tmp_path / "r1")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds no checkpoint (it does not exist)" in err[0] and "--resume-if-present" in err[0]
    assert main(["run", str(plan), "--steps", "1", "--checkpoint-dir", "", "--resume", "--out", str(tmp_path / "r0")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--checkpoint-dir is empty" in err[0]
    assert main(["run", str(plan), "--steps", "1", "--warmup", "0", "--checkpoint-dir", str(missing),
                 "--resume-if-present", "--out", str(tmp_path / "r2")]) == 0
    assert checkpoint.complete_steps(missing) == [1]   # trained from step 0 and saved at the end


@pytest.mark.parametrize("model,choice,world", [
    ("debug-tiny", Choice(zero_stage=3, micro_batch_size=2), 2),
    ("debug-tiny", Choice(tp=2, micro_batch_size=8), 2),
    ("debug-tiny-gpt", Choice(pp=2), 2),   # the tied output layer split from the embedding: counted once
    # FSDP2 over TP shards: the weights' placement on the dp dim is a _StridedShard
    ("debug-tiny", Choice(tp=2, zero_stage=1, micro_batch_size=4), 4),
], ids=["zero3", "tp2_sp", "pp2_tied", "tp2_dp2_zero1"])
def test_the_gradient_norm_is_the_whole_models_as_one_process_computes_it(model, choice, world):
    """runtime.health's norm over FSDP2 shards, TP shards and copies, and pipeline stages equals torch.nn.utils.get_total_norm of the single-process reference's gradient."""
    pf = plan_file(choice, world=world, model=model, **({"dropout": False} if model == "debug-tiny-gpt" else {}))
    expected: list[float] = []
    reference(pf, steps=2, grad_norms=expected)
    got = distributed(pf, steps=2)["grad_norms"]
    assert got == pytest.approx(expected, rel=1e-5)


def test_a_run_diverged_in_its_warm_up_keeps_those_steps_marked(tmp_path):
    """No timed step yet: the warm-up steps' times stand in, so measured.json still says what broke."""
    from runtime.fork import RankFailed
    from runtime.measure import measured_record
    pf = plan_file(Choice(zero_stage=1, micro_batch_size=2), world=2)
    partial = tmp_path / "partial.json"
    cfg = RunConfig(steps=2, warmup=3, seed=SEED, lr=0.5, quiet=True, fault=(1, 1, "nan"), partial=partial)
    with pytest.raises(RankFailed, match="training diverged at warm-up 2/3 on rank 1"):
        run_forked(2, run_rank, pf, cfg)
    raw = json.loads(partial.read_text())
    assert raw["diverged"]["step"] == 2 and len(raw["step_times_s"]) == len(raw["losses"]) == 2
    record = measured_record(pf, raw, steps=2, warmup=0, wall_s=1.0, complete=False)
    assert record.diverged["loss"] is None and record.losses[0] is not None and record.losses[1] is None
