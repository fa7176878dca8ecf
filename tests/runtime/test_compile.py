"""`planner run --compile` (runtime.compile): each layer's forward compiled by torch.compile
(inductor's C++ on a CPU) trains as the eager single process does, losses within 1e-4 relative,
for every strategy the issue names; compiled graphs are counted, so an eager fallback fails.

Compiling is the cost here: the cases share one forked process group (two gloo ranks), run
one after another, and one inductor cache for the session (TORCHINDUCTOR_CACHE_DIR in a
temporary directory), so a layer graph compiled for one case serves the next. The default run
holds data parallelism (DDP and ZeRO-3), tensor + sequence parallelism and the interleaved
pipeline (about 40 s on 2 cores, --durations); the rest of the issue's list (1F1B, CP, EP, full
recomputation) runs with PLANNER_COMPILE_ALL=1: about 140 s more, most of it the mixture's
recompiles for its experts' varying token counts."""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from parity import SEED, plan_file, reference

from costmodel.hardware import parse_cluster
from costmodel.plan import Recompute
from costmodel.schedules import Schedule
from costmodel.specs import DType
from planner.space import Choice
from runtime.fork import run_forked
from runtime.train import RunConfig, run_rank

STEPS, RTOL = 2, 1e-4
DEFAULT = {
    "dp2": (Choice(zero_stage=0), {}),
    "tp2_sp": (Choice(tp=2), {}),
    "pp2_interleaved": (Choice(pp=2, vpp=2), {}),
    "zero3": (Choice(zero_stage=3), {}),   # dp2's layer graph again: FSDP2's gathers stay eager
}
MORE = {
    "pp2_1f1b": (Choice(pp=2, schedule=Schedule.ONE_F_ONE_B), {}),   # the interleaved case's layers, in order
    "recompute_full": (Choice(zero_stage=1, recompute=Recompute.FULL, recompute_layers=4), {}),
    "recompute_selective": (Choice(zero_stage=1, recompute=Recompute.SELECTIVE), {}),
    "cp2": (Choice(cp=2), {}),
    "ep2": (Choice(ep=2, zero_stage=1), {"model": "debug-moe"}),
}


@pytest.fixture(scope="module", autouse=True)
def _inductor_cache(tmp_path_factory):
    """One inductor cache for this module's compiles (the forked ranks inherit the variable),
    and inductor compiling in each rank's own process: its default on a multi-core machine is a
    pool of compile workers per process, whose threads a rank forked from a threaded parent
    would start beside OpenMP's (a rank died of SIGSEGV here once in CI; pytorch#148651 and
    #121197 advise compile_threads = 1 under fork)."""
    import torch._inductor.config as inductor
    saved, threads = os.environ.get("TORCHINDUCTOR_CACHE_DIR"), inductor.compile_threads
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    inductor.compile_threads = 1
    yield
    inductor.compile_threads = threads
    if saved is None:
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved


def _run_each(cases: list) -> dict:
    """On every rank: each plan in turn, compiled; rank 0 returns {name: (losses, graphs)}."""
    from torch._dynamo.utils import counters
    out = {}
    for name, pf in cases:
        torch._dynamo.reset()   # a fresh cache per plan: one run's code is compiled for its own modules
        before = counters["stats"]["unique_graphs"]
        # a warm-up step first, as `planner run --compile` requires: on a CPU not under the memory
        # tracker, whose dispatch mode torch.compile refuses
        raw = run_rank(pf, RunConfig(steps=STEPS - 1, warmup=1, seed=SEED, lr=0.5, quiet=True, compile=True))
        if raw is not None:
            out[name] = (raw["losses"], counters["stats"]["unique_graphs"] - before)
    return out


def _assert_compiled_as_eager(cases: dict) -> None:
    pfs = [(name, plan_file(choice, world=2, **kwargs)) for name, (choice, kwargs) in cases.items()]
    got = run_forked(2, _run_each, pfs)[0]
    for name, pf in pfs:
        losses, graphs = got[name]
        assert graphs >= 1, f"{name}: no graph compiled"
        expected, _ = reference(pf, steps=STEPS)
        assert losses == pytest.approx(expected, rel=RTOL), name


def test_compiled_layers_train_as_eager():
    _assert_compiled_as_eager(DEFAULT)


@pytest.mark.skipif(not os.environ.get("PLANNER_COMPILE_ALL"),
                    reason="opt-in (PLANNER_COMPILE_ALL=1): four more strategies' compiles, ~140 s on 2 cores")
def test_every_strategy_compiled():
    _assert_compiled_as_eager(MORE)


@pytest.mark.parametrize("choice,why", [
    (Choice(zero_stage=3, offload_activations=True), "activation offloading"),
    (Choice(pp=2, schedule=Schedule.ZB_H1), "zb-h1 schedule"),
    (Choice(pp=2, vpp=2, schedule=Schedule.ZBV), "zbv schedule"),
    (Choice(tp=2, recompute=Recompute.SELECTIVE), "selective recomputation under tensor parallelism"),
    (Choice(tp=2, recompute=Recompute.FULL, recompute_layers=4), "full recomputation under tensor parallelism"),
], ids=["activation_offload", "zb_h1", "zbv", "selective_tp2", "full_tp2"])
def test_what_compile_cannot_serve_is_refused_by_name(choice, why):
    """Measured: offloaded activations come back contiguous and the compiled backward asserts
    their strides; a zero-bubble schedule's input pass keeps the graph for its weight pass,
    which a compiled backward (its buffers donated) refuses; a checkpoint under TP (the attention
    core's or the layer's) has AOTAutograd save the TP mesh and assert. All before any rank starts."""
    from costmodel.inputs import UserError
    from runtime.compile import compile_problem
    from runtime.job import build_job
    pf = plan_file(choice, world=2)
    assert why in compile_problem(pf.plan) and "\n" not in compile_problem(pf.plan)
    assert compile_problem(plan_file(Choice(pp=2, vpp=2), world=2).plan) is None
    with pytest.raises(UserError, match=why):
        build_job(pf, torch.device("cpu"), seed=0, materialize=False, compile=True)


def test_run_compile_refuses_in_one_line_before_any_rank(tmp_path, capsys):
    from planner.cli import main
    plan = tmp_path / "zbv.json"
    assert main(["predict", "--model", "debug-tiny", "--cluster", "1x2xxeon-amx", "--dtype", "fp32", "--pp", "2",
                 "--vpp", "2", "--schedule", "zbv", "--out", str(plan), "--json"]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), "--compile", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "zbv schedule" in err and not (tmp_path / "run").exists()
    assert main(["run", str(plan), "--dry-run", "--compile"]) == 2   # the dry run compiles nothing
    capsys.readouterr()
    # a timed first step would measure the compilation
    fine = tmp_path / "pp2.json"
    assert main(["predict", "--model", "debug-tiny", "--cluster", "1x2xxeon-amx", "--dtype", "fp32", "--pp", "2",
                 "--out", str(fine), "--json"]) == 0
    capsys.readouterr()
    assert main(["run", str(fine), "--compile", "--warmup", "0", "--out", str(tmp_path / "run0")]) == 2
    assert "--compile with --warmup 0" in capsys.readouterr().err and not (tmp_path / "run0").exists()
    from runtime.launch import WorkerArgs
    worker = WorkerArgs(plan=plan, out=tmp_path, compile=True)
    assert WorkerArgs.parse(worker.argv()[2:]).compile   # what each rank is told


@pytest.mark.parametrize("cluster", ["1x8xH100", "1x2xxeon-amx"])
def test_a_compiled_run_is_priced_with_its_layers_fused(cluster):
    """`planner run --compile` compares with the estimate under `compiled_layer`: the layers'
    memory-bound work at the fused count (fewer bytes, fewer kernels) on a GPU and on a CPU,
    so its forward and step are predicted faster than the eager layer's, and its SwiGLU keeps
    one f-wide tensor less (COMPILED_SWIGLU_SAVED); GEMMs, attention and communication unchanged."""
    from costmodel.estimate import estimate
    from costmodel.frameworks import COMPILED_RUNTIME
    from runtime.measure import priced_as_run
    pf = plan_file(Choice(tp=2), world=2, compute_dtype=DType.BF16, model="llama3-8b", seq_len=4096,
                   global_batch=2)
    pf = replace(pf, cluster=parse_cluster(cluster))
    assert priced_as_run(pf, False) is pf
    compiled_pf = priced_as_run(pf, True)
    assert compiled_pf.cluster.framework.compiled_layer
    assert compiled_pf.cluster.framework == replace(COMPILED_RUNTIME, cpu_kernels=pf.cluster.device.kind == "cpu")
    eager, compiled = (estimate(p.model, p.train, p.cluster, p.plan) for p in (pf, compiled_pf))
    assert compiled.time_breakdown_s["compute/forward"] < 0.97 * eager.time_breakdown_s["compute/forward"]
    assert compiled.step_time_s < eager.step_time_s
    assert all(c < e for c, e in zip(compiled.peak_memory_bytes, eager.peak_memory_bytes))
    assert compiled.time_breakdown_s["comm/tp_exposed"] == eager.time_breakdown_s["comm/tp_exposed"]
    # the record a run writes (planner run, or a printed launch's rank 0) prices it as it ran
    from runtime.measure import run_record
    raw = {"losses": [1.0, 1.0], "step_times_s": [1.0], "peak_memory_bytes": None, "memory_source": "tensors",
           "device": "cpu"}
    ran = run_record(pf, raw, wall_s=1.0, compiled=True)
    assert ran.compiled and ran.warmup_steps == 1
    assert ran.predicted["step_time_s"] == pytest.approx(compiled.step_time_s)


@pytest.mark.parametrize("framework", ["planner", "megatron"])
def test_a_compiled_run_is_read_back_as_it_ran(tmp_path, framework):
    """measured.json says whether the layers were compiled, and calibrate and gpu_check's replay
    (planner.measure.run_dirs) price the run so again on the profile as read: its own
    prediction once more (a plan made for Megatron-Core keeps that framework's vendor attention),
    not the eager layer's; an eager and a compiled run of one plan are two plans to the fit."""
    from costmodel.measured import MeasuredRun
    from planner.measure.run_dirs import load_run, merge_repeats, predict_with, priced_as_run
    from planner.targets import cluster_for
    from runtime.measure import measured_record
    pf = plan_file(Choice(), world=1, compute_dtype=DType.BF16, seq_len=4096, global_batch=2, model="llama3-8b")
    profile = parse_cluster("1x1xH100").device
    pf = replace(pf, cluster=cluster_for(framework, parse_cluster("1x1xH100")))
    for mode in ("eager", "compiled"):
        raw = {"losses": [1.0], "step_times_s": [0.5], "peak_memory_bytes": [1e9], "device": "NVIDIA H100",
               "memory_source": "torch.cuda.max_memory_allocated"}
        pf.save(tmp_path / mode / "plan.json")
        measured_record(priced_as_run(pf, mode == "compiled"), raw, steps=1, warmup=0, wall_s=1.0,
                        compiled=mode == "compiled").save(tmp_path / mode / "measured.json")
    runs = {mode: load_run(tmp_path / mode) for mode in ("eager", "compiled")}
    assert [runs[m].compiled for m in runs] == [False, True]
    assert MeasuredRun.load(tmp_path / "compiled" / "measured.json").compiled
    for run in runs.values():
        again = predict_with(run, profile).step_time_s
        assert again == pytest.approx(run.measured.predicted["step_time_s"], rel=1e-12)
    if framework == "planner":   # the same layers fused
        assert predict_with(runs["compiled"], profile).step_time_s < predict_with(runs["eager"], profile).step_time_s
    assert len(merge_repeats(list(runs.values()))) == 2


def test_a_mixed_cluster_is_not_priced_compiled():
    """The compiled runtime's pricing is of one kind of device: a mixed cluster under --compile
    is a user's one-line refusal, not an assertion of the pricing."""
    from costmodel.inputs import UserError
    from runtime.measure import priced_as_run
    pf = replace(plan_file(Choice(), world=2), cluster=parse_cluster("1x8xA100+1x8xH100"))
    assert priced_as_run(pf, False) is pf
    with pytest.raises(UserError, match="mixed cluster is priced for the eager runtime only"):
        priced_as_run(pf, True)


def test_a_dense_layer_compiles_whole_or_fails():
    """A side effect inside a checkpointed layer (as RoPE's frequencies moved to the GPU in the
    forward once did) makes Dynamo run the whole checkpoint eagerly: under `_whole_graph` the
    first forward raises instead of training eagerly in silence; where breaks are allowed (CP's
    ring attention) the same layer runs, eagerly."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from runtime.compile import apply_compile

    class SideEffect(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear, self.scale = torch.nn.Linear(8, 8), torch.ones(8, dtype=torch.float64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.scale.dtype != x.dtype:
                self.scale = self.scale.to(x.dtype)
            return self.linear(x) * self.scale

    def stage() -> torch.nn.Module:
        mod = torch.nn.Module()
        mod.layers = torch.nn.ModuleDict({"0": checkpoint_wrapper(SideEffect(), preserve_rng_state=True)})
        return mod

    x = torch.randn(2, 8, requires_grad=True)
    dense = stage()
    apply_compile(dense, plan_file(Choice(recompute=Recompute.FULL, recompute_layers=4), world=1).plan)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="side effect"):
        dense.layers["0"](x)
    ring = stage()
    apply_compile(ring, plan_file(Choice(cp=2), world=2).plan)
    ring.layers["0"](x).sum().backward()
