"""Checkpoints: a run stopped after step 3 and resumed continues exactly as an uninterrupted run
(fp32, AdamW, so optimizer states matter), under every parallelism tested here; a checkpoint
saved under one plan resumes under another; a half-written or damaged one is refused by name.
Ranks are forked (gloo on CPU)."""
from __future__ import annotations

import json
import shutil

import pytest
from parity import SEED, plan_file

from costmodel.plan import Recompute
from costmodel.schedules import Schedule
from costmodel.specs import Optimizer
from planner.space import Choice
from runtime import checkpoint
from runtime.fork import RankFailed, run_forked
from runtime.train import RunConfig, run_rank

LR = 1e-2


def _losses(pf, root=None, *, steps: int, resume: bool = False, every: int = 0,
            background: bool = False) -> list[float]:
    cfg = RunConfig(steps=steps, warmup=0, seed=SEED, lr=LR, quiet=True, resume=resume,
                    checkpoint_dir=str(root) if root else None, checkpoint_every=every,
                    checkpoint_async=background)
    return run_forked(pf.plan.world_size, run_rank, pf, cfg)[0]["losses"]


def _plan(choice: Choice, world: int = 2, model: str = "debug-tiny", framework: str | None = None):
    return plan_file(choice, world=world, optimizer=Optimizer.ADAMW, model=model, framework=framework)


# every parallelism the runtime executes (the list): each ZeRO stage, TP with SP (TP alone
# is the same DTensor resharding; test_parity proves it), every pipeline schedule, both
# recomputation kinds, and context parallelism
SAME_PLAN = {
    "ddp": Choice(zero_stage=0, micro_batch_size=2),
    "zero1": Choice(zero_stage=1, micro_batch_size=2),
    "zero2_recompute_full": Choice(zero_stage=2, micro_batch_size=2, recompute=Recompute.FULL),
    "zero3": Choice(zero_stage=3, micro_batch_size=2),
    # TP and CP take the replica's whole batch in one micro-batch: DTensor's per-op dispatch on a
    # CPU makes each micro-batch of a TP plan cost about a step of the others, and a checkpoint
    # holds nothing per micro-batch (accumulation: the DP cases here, and test_parity)
    "tp_sp_recompute_selective": Choice(tp=2, recompute=Recompute.SELECTIVE, micro_batch_size=8),
    "pp_gpipe": Choice(pp=2, schedule=Schedule.GPIPE),
    "pp_1f1b_recompute_full": Choice(pp=2, recompute=Recompute.FULL),
    "pp_interleaved": Choice(pp=2, vpp=2),
    "pp_zb_h1": Choice(pp=2, schedule=Schedule.ZB_H1),
    "pp_zbv": Choice(pp=2, vpp=2, schedule=Schedule.ZBV),
    "cp": Choice(cp=2, micro_batch_size=8),
}


@pytest.mark.parametrize("name", list(SAME_PLAN))
def test_resume_continues_exactly(tmp_path, name):
    pf = _plan(SAME_PLAN[name])
    whole = _losses(pf, steps=5)
    first = _losses(pf, tmp_path, steps=3, every=2)    # checkpoints after steps 2 and 3
    assert checkpoint.complete_steps(tmp_path) == [2, 3]
    # two steps after the resume: the second step's loss is the first to see the restored
    # optimizer moments (the first sees only the restored weights)
    rest = _losses(pf, tmp_path, steps=5, resume=True)
    assert first + rest == whole   # fp32, same plan: bit for bit


@pytest.mark.parametrize("choice,world", [(Choice(zero_stage=3), 2), (Choice(pp=2), 2), (Choice(ep=2, zero_stage=1), 2),
                                          (Choice(tp=2, micro_batch_size=8), 2),
                                          (Choice(ep=2, cp=2, zero_stage=1, micro_batch_size=4), 4)],
                         ids=["zero3", "pp", "ep2", "tp2", "ep2_cp2"])
def test_a_mixture_of_experts_resumes_exactly(tmp_path, choice, world):
    """Stacked expert weights and their AdamW states (runtime.moe) through DCP, and the router;
    under expert parallelism each rank's slice of the experts (sharded over edp x cp under CP),
    under TP the same mixture on each TP rank."""
    pf = _plan(choice, world=world, model="debug-moe")
    whole = _losses(pf, steps=5)
    first = _losses(pf, tmp_path, steps=2)
    assert first + _losses(pf, tmp_path, steps=5, resume=True) == whole


def test_experts_saved_under_expert_parallelism_resume_without_it(tmp_path):
    """The experts are one DTensor sharded over the EP ranks, so DCP reshards them like any
    other weight: saved under ep2 x ZeRO-3, resumed on two replicas holding every expert."""
    saved, resumed = _plan(Choice(ep=2, zero_stage=3), model="debug-moe"), _plan(Choice(zero_stage=1), model="debug-moe")
    whole = _losses(saved, steps=5)
    _losses(saved, tmp_path, steps=3)
    assert _losses(resumed, tmp_path, steps=5, resume=True) == pytest.approx(whole[3:], rel=1e-5)


def test_experts_folded_over_tp_resume_carved_from_dp(tmp_path):
    """Experts folded over TP x DP (our runtime's layout, Megatron-Core's, costmodel.placement.
    expert_layout: tp2 dp2 ep4, one expert a rank, its states whole) are one DTensor over the EP
    group as carved ones are, so DCP reshards them: saved folded, resumed with EP carved from dp
    (a plan for DeepSpeed: ep2 over the two replicas, each TP rank holding two experts whole),
    the same micro-batches."""
    folded = _plan(Choice(tp=2, ep=4, zero_stage=1, micro_batch_size=4), world=4, model="debug-moe")
    carved = _plan(Choice(tp=2, ep=2, zero_stage=1, micro_batch_size=4), world=4, model="debug-moe",
                   framework="deepspeed")
    whole = _losses(folded, steps=5)
    _losses(folded, tmp_path, steps=3)
    assert _losses(carved, tmp_path, steps=5, resume=True) == pytest.approx(whole[3:], rel=1e-5)

@pytest.mark.parametrize("name", ["zero3", "pp_interleaved"])
def test_a_checkpoint_written_in_the_background_resumes_exactly(tmp_path, name):
    """--checkpoint-async: training goes on while DCP writes (the state was copied first), and
    the checkpoint committed at the next save or the run's end resumes as a synchronous one."""
    pf = _plan(SAME_PLAN[name])
    whole = _losses(pf, steps=6)
    first = _losses(pf, tmp_path, steps=3, every=1, background=True)   # the writes overlap steps 2 and 3
    assert checkpoint.complete_steps(tmp_path) == [2, 3]                 # --keep 2 pruned step 1
    assert not list(tmp_path.glob(".*.partial"))
    rest = _losses(pf, tmp_path, steps=6, resume=True, background=True)
    assert first + rest == whole


@pytest.mark.parametrize("saved,resumed", [
    (Choice(zero_stage=1, micro_batch_size=2), Choice(tp=2, micro_batch_size=8)),
    (Choice(pp=2), Choice(zero_stage=1, micro_batch_size=2)),
    (Choice(zero_stage=3, micro_batch_size=2), Choice(zero_stage=1, micro_batch_size=2)),
    (Choice(cp=2, micro_batch_size=8), Choice(pp=2)),
], ids=["dp2-to-tp2", "pp2-to-dp2", "zero3-to-zero1", "cp2-to-pp2"])
def test_a_checkpoint_resumes_under_another_plan(tmp_path, saved, resumed):
    whole = _losses(_plan(saved), steps=5)
    _losses(_plan(saved), tmp_path, steps=3)
    rest = _losses(_plan(resumed), tmp_path, steps=5, resume=True)
    assert rest == pytest.approx(whole[3:], rel=1e-5)


def test_hybrid_sharding_resumes_exactly_and_under_full_sharding(tmp_path):
    """HSDP's states are DTensors over a 2-D mesh (replicated over dp_out, sharded over dp_in):
    DCP saves one copy and resumes them under the same plan bit for bit, and under ZeRO-3 over
    all four ranks."""
    hybrid = _plan(Choice(zero_stage=3, dp_replicate=2), world=4)
    whole = _losses(hybrid, steps=5)
    first = _losses(hybrid, tmp_path / "a", steps=3)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    assert first + _losses(hybrid, tmp_path / "a", steps=5, resume=True) == whole
    rest = _losses(_plan(Choice(zero_stage=3), world=4), tmp_path / "b", steps=5, resume=True)
    assert rest == pytest.approx(whole[3:], rel=1e-5)


def test_keep_prunes_old_checkpoints_and_partial_ones_are_never_picked(tmp_path):
    pf = _plan(Choice(zero_stage=1, micro_batch_size=2))
    cfg = RunConfig(steps=4, warmup=0, seed=SEED, lr=LR, quiet=True, checkpoint_dir=str(tmp_path),
                    checkpoint_every=1, keep=2)
    run_forked(2, run_rank, pf, cfg)
    assert checkpoint.complete_steps(tmp_path) == [3, 4]
    # a checkpoint being written (no COMPLETE yet) is not the latest
    shutil.copytree(tmp_path / "step-000004", tmp_path / "step-000009")
    (tmp_path / "step-000009" / checkpoint.COMPLETE).unlink()
    assert checkpoint.latest(tmp_path) == tmp_path / "step-000004"


def test_damaged_checkpoints_are_refused_by_name(tmp_path):
    pf = _plan(Choice(zero_stage=1, micro_batch_size=2))
    _losses(pf, tmp_path, steps=2)
    step = tmp_path / "step-000002"
    (step / "plan.json").write_text("{not json")
    with pytest.raises(RankFailed, match="plan.json"):
        _losses(pf, tmp_path, steps=4, resume=True)
    # none complete, but attempts exist: no silent start from step 0
    (step / checkpoint.COMPLETE).unlink()
    with pytest.raises(RankFailed, match="no complete checkpoint"):
        _losses(pf, tmp_path, steps=4, resume=True)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    _losses(_plan(Choice(zero_stage=1, micro_batch_size=2)), tmp_path, steps=1)
    other = plan_file(Choice(zero_stage=1, micro_batch_size=2), world=2, model="debug-tiny-gpt",
                      optimizer=Optimizer.ADAMW)
    with pytest.raises(RankFailed, match="saved for model debug-tiny"):
        _losses(other, tmp_path, steps=3, resume=True)
    saved = json.loads((tmp_path / "step-000001" / "plan.json").read_text())
    assert saved["step"] == 1 and saved["model"]["name"] == "debug-tiny"


def test_planner_run_saves_and_resumes(dp_run, tmp_path, capsys):
    """The command as a user types it (torchrun, 2 gloo ranks): 4 steps saved (dp_run's
    uninterrupted run, its checkpoint copied here), then resumed to 6 under another plan; the
    flags' refusals are one line each."""
    import subprocess
    import sys

    from planner.cli import main
    _, _, saved = dp_run
    dp = saved / "dp.json"
    assert main(["predict", "--model", "debug-tiny", "--cluster", "1x2xxeon-amx", "--dtype", "fp32", "--json",
                 "--dp", "1", "--tp", "2", "--mbs", "8", "--out", str(tmp_path / "tp.json")]) == 0
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved / "ckpt-whole", ckpt)
    assert checkpoint.complete_steps(ckpt) == [4]   # the run's end, no --checkpoint-every

    def run(plan, out, *extra):
        return subprocess.run([sys.executable, "-m", "planner", "run", str(tmp_path / plan), "--warmup", "0",
                               "--out", str(tmp_path / out), "--checkpoint-dir", str(ckpt), *extra],
                              capture_output=True, text=True, timeout=120)
    # refusals come before any rank starts: in this process (a new interpreter costs seconds)
    capsys.readouterr()
    assert main(["run", str(dp), "--warmup", "0", "--out", str(tmp_path / "b"),
                 "--checkpoint-dir", str(ckpt), "--steps", "6"]) == 2
    assert "holds checkpoints (step-000004); pass --resume" in capsys.readouterr().err
    (ckpt / ".step-000005.partial" / "rng").mkdir(parents=True)   # an interrupted write: never resumed, removed
    resumed = run("tp.json", "c", "--steps", "6", "--resume", "--checkpoint-async", "--seed", "3")
    assert resumed.returncode == 0, resumed.stderr
    assert not (ckpt / ".step-000005.partial").exists()
    assert "resuming after step 4" in resumed.stderr
    # another seed draws another token stream from the checkpoint on: said, and recorded
    assert "was trained on other tokens (seed 0 there, 3 here)" in resumed.stderr, resumed.stderr   # tp.json: same batch
    assert json.loads((checkpoint.step_dir(ckpt, 6) / "plan.json").read_text())["tokens"]["seed"] == 3
    measured = json.loads((tmp_path / "c" / "measured.json").read_text())
    assert len(measured["losses"]) == 2 and checkpoint.complete_steps(ckpt) == [4, 6]
    assert len(measured["checkpoint_wait_s"]) == 1   # one save, at the end: the time the step stood still
    assert main(["run", str(tmp_path / "tp.json"), "--warmup", "0", "--out", str(tmp_path / "d"),
                 "--checkpoint-dir", str(ckpt), "--steps", "6", "--resume"]) == 2
    assert "is at step 6, and --warmup + --steps = 6 ends there: nothing more to train" in capsys.readouterr().err
    for flags, text in ((["--keep", "3"], "need --checkpoint-dir"), (["--resume"], "need --checkpoint-dir"),
                        (["--checkpoint-async"], "need --checkpoint-dir"),
                        (["--device-mtbf-hours", "100"], "need --checkpoint-dir"),
                        (["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--storage-mb-s-per-device", "9"],
                         "--checkpoint-every sets the interval")):
        assert main(["run", str(dp), *flags]) == 2
        assert text in capsys.readouterr().err


def test_a_tied_embedding_saved_on_one_stage_resumes_split_over_two(tmp_path):
    """GPT ties its output layer to the embedding; split over pipeline stages the output layer is
    a copy kept equal to it, which the one-stage checkpoint fills from the embedding's entries."""
    def gpt(choice):
        return plan_file(choice, world=2, model="debug-tiny-gpt", dropout=False, optimizer=Optimizer.ADAMW)
    whole = _losses(gpt(Choice(zero_stage=1, micro_batch_size=2)), steps=4)
    _losses(gpt(Choice(zero_stage=1, micro_batch_size=2)), tmp_path, steps=2)
    rest = _losses(gpt(Choice(pp=2)), tmp_path, steps=4, resume=True)
    assert rest == pytest.approx(whole[2:], rel=1e-5)


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory):
    """A dp2 plan (torchrun, 2 gloo ranks) and the losses of its uninterrupted 4-step run, which
    saves its checkpoint at the end (ckpt-whole: test_planner_run_saves_and_resumes resumes a copy;
    a save after the last step changes none of its losses)."""
    import subprocess
    import sys

    from planner.cli import main
    tmp = tmp_path_factory.mktemp("dp_run")
    plan = tmp / "dp.json"
    assert main(["predict", "--model", "debug-tiny", "--cluster", "1x2xxeon-amx", "--dtype", "fp32", "--dp", "2",
                 "--json", "--out", str(plan)]) == 0

    def run(out, *extra):
        return subprocess.run([sys.executable, "-m", "planner", "run", str(plan), "--warmup", "0", "--steps", "4",
                               "--out", str(tmp / out), *extra], capture_output=True, text=True, timeout=180)
    whole = run("whole", "--checkpoint-dir", str(tmp / "ckpt-whole"))
    assert whole.returncode == 0, whole.stderr
    return run, json.loads((tmp / "whole" / "measured.json").read_text())["losses"], tmp


# "hang" restarts the same way once the watchdog ends the hung rank; its detection and naming
# are test_run_cli's (a second restart run here cost CI 21 s)
def test_a_failed_rank_restarts_and_the_run_ends_as_an_uninterrupted_one(dp_run):
    """rank 1 SIGKILLs itself before step 3 of 4 on the first attempt;
    it is named within 30 s, and with --max-restarts 1 torchrun restarts the ranks, which resume
    after step 2 and finish with the uninterrupted run's losses."""
    import time
    run, losses, tmp = dp_run
    fault = "kill"
    inject = ["--inject-fault", f"1:2:{fault}", "--hang-timeout", "5"]   # detection alone: test_run_cli
    start = time.perf_counter()
    restarted = run(f"restarted-{fault}", *inject, "--max-restarts", "1",
                    "--checkpoint-dir", str(tmp / f"ckpt-{fault}"), "--checkpoint-every", "1")
    assert restarted.returncode == 0, restarted.stderr
    assert "recovered: a rank failed and all ranks were restarted 1 time(s)" in restarted.stderr
    after = json.loads((tmp / f"restarted-{fault}" / "measured.json").read_text())["losses"]
    # once in a loaded CI run 4 losses came back: the attempts' own lines tell a restart spent
    # before the fault (a start-up failure) from a resume that did not happen
    log = (tmp / f"restarted-{fault}" / "run.log").read_text()
    assert after == losses[2:], f"losses {after}, uninterrupted {losses}\n{restarted.stderr[-3000:]}\n{log[-3000:]}"
    assert time.perf_counter() - start < 90   # detection (5 s of silence) + one restart, never a hang


def test_a_checkpoint_saved_before_a_model_field_existed_still_resumes(tmp_path):
    """plan.json written by an older planner lacks fields added since (RoPE base, experts...):
    they take their defaults, so the same model resumes."""
    pf = _plan(Choice(zero_stage=1, micro_batch_size=2))
    _losses(pf, tmp_path, steps=1)
    record = tmp_path / "step-000001" / "plan.json"
    saved = json.loads(record.read_text())
    for key in ("rope_theta", "norm_eps", "num_experts", "qkv_bias"):
        del saved["model"][key]
    record.write_text(json.dumps(saved))
    assert checkpoint.check_resumable(tmp_path / "step-000001", pf) == 1


def test_what_a_checkpoint_was_fed_is_compared_with_what_a_resume_feeds(tmp_path):
    """A token file's stream does not depend on the seed; the sequences a step takes do."""
    from costmodel.specs import TrainSpec
    train = TrainSpec(seq_len=64, global_batch_size=16)
    (tmp_path / "plan.json").write_text(json.dumps({"tokens": checkpoint.token_source(0, "/d/t.bin", "uint16", train)}))
    assert checkpoint.other_tokens(tmp_path, checkpoint.token_source(3, "/d/t.bin", "uint16", train)) is None
    assert checkpoint.other_tokens(tmp_path, checkpoint.token_source(3, None, "uint16", train)) == \
        "data '/d/t.bin' there, None here, seed None there, 3 here"
    bigger = checkpoint.token_source(0, "/d/t.bin", "uint16", TrainSpec(seq_len=64, global_batch_size=32))
    assert checkpoint.other_tokens(tmp_path, bigger) == "global_batch 16 there, 32 here"
    (tmp_path / "plan.json").write_text(json.dumps({"step": 1}))   # saved before the record existed
    assert checkpoint.other_tokens(tmp_path, bigger) is None
