"""`planner run` as a user meets it: a real torchrun launch on CPU, the measured.json contract,
failures that end the job and name the rank, refusals in one line, the dry run, launch scripts."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from planner.cli import main

TINY = ["predict", "--model", "debug-tiny", "--cluster", "1x2xxeon-amx", "--dtype", "fp32"]


def _plan(tmp_path: Path, *extra: str, name: str = "plan.json") -> Path:
    path = tmp_path / name
    assert main([*TINY, *extra, "--out", str(path), "--json"]) == 0
    return path


def _run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "planner", "run", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=120)


def test_run_measures_and_compares(tmp_path, capsys):
    plan = _plan(tmp_path, "--zero", "3")
    capsys.readouterr()
    out = tmp_path / "run"
    proc = _run(str(plan), "--steps", "2", "--warmup", "1", "--out", str(out))
    log = (out / "run.log").read_text() if (out / "run.log").exists() else ""
    assert proc.returncode == 0, proc.stderr + "\n--- run.log (tail) ---\n" + log[-4000:]
    for text in ("step time", "tokens/s", "MFU", "peak memory, stage 0", "stage 0 work", "stage 0 wait", "loss"):
        assert text in proc.stdout
    m = json.loads((out / "measured.json").read_text())
    for key in ("step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes", "losses", "predicted",
                "error_pct"):
        assert key in m
    assert len(m["losses"]) == 3 and len(m["peak_memory_bytes"]) == 1
    assert m["peak_memory_bytes"][0] > 0 and m["step_time_s"] > 0
    parts = m["stage_breakdown_s"]
    assert 0 < parts["work"][0] <= m["step_time_s"] and parts["optimizer"][0] > 0
    assert sum(p[0] for p in parts.values()) == pytest.approx(m["step_time_s"])
    assert set(m["error_pct"]["stage_breakdown_s"]) == {"work", "dp_sync", "optimizer", "wait"}
    assert m["predicted"]["step_time_s"] > 0 and "time_breakdown_s" in m["predicted"]
    assert (out / "run.log").exists()


@pytest.mark.parametrize("fault, expected", [
    ("1:1:raise", "rank 1 failed at step 1/3: RuntimeError: injected fault"),   # as its progress lines count
    ("0:1:exit", "rank 0 died (exit code 3) without a Python error"),
    ("1:1:kill", "rank 1 died (signal 9) without a Python error"),
    # alive but silent: the watchdog names it, not the peer that waits for it
    pytest.param("1:1:hang", "rank 1 failed at step 1/3: RankHung: no progress for",
                 marks=pytest.mark.alone),   # two timeouts race: the watchdog's 5 s, the peer's 6 s
])
def test_a_failing_rank_ends_the_job_and_is_named(tmp_path, fault, expected):
    plan = _plan(tmp_path)
    start = time.monotonic()
    proc = _run(str(plan), "--steps", "3", "--warmup", "1", "--out", str(tmp_path / "run"),
                "--inject-fault", fault, "--hang-timeout", "5")
    assert time.monotonic() - start < 60   # the bound is 30 s of job time; launch adds a few
    assert proc.returncode == 1   # the run broke, not the command line (2)
    last = proc.stderr.strip().splitlines()[-1]
    assert expected in last and last.startswith("planner run: stopped:")
    assert "Traceback" not in proc.stderr.split("planner run: stopped")[-1]


def _refused(args: list[str], capsys) -> str:
    assert main(["run", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("planner run: error:")
    return err


def test_bad_plan_files_are_refused_in_one_line(tmp_path, capsys):
    plan = _plan(tmp_path)
    capsys.readouterr()
    doc = json.loads(plan.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**doc, "version": 99}))
    assert "version 99 is not supported" in _refused([str(bad)], capsys)
    bad.write_text(json.dumps({**doc, "cluster": {**doc["cluster"], "devices_per_node": 4}}))
    assert "does not equal the cluster's 4 devices" in _refused([str(bad)], capsys)
    assert "does not exist" in _refused([str(tmp_path / "missing.json")], capsys)


def test_machine_mismatches_are_refused(tmp_path, capsys):
    big = tmp_path / "big.json"
    assert main(["predict", "--model", "debug-tiny", "--cluster", f"1x{4 * (os.cpu_count() or 1)}xxeon-amx",
                 "--global-batch", str(4 * (os.cpu_count() or 1)), "--dtype", "fp32", "--out", str(big),
                 "--json"]) == 0
    capsys.readouterr()
    assert "pass --nproc" in _refused([str(big)], capsys)
    small = _plan(tmp_path)
    capsys.readouterr()
    assert "needs exactly" in _refused([str(small), "--nproc", "3"], capsys)
    gpu = tmp_path / "gpu.json"
    assert main(["predict", "--model", "llama3-8b", "--cluster", "1x8xH100", "--tp", "8",
                 "--out", str(gpu), "--json"]) == 0
    capsys.readouterr()
    if not __import__("torch").cuda.is_available():
        assert "no GPU" in _refused([str(gpu)], capsys)


@pytest.mark.parametrize("flags, stages", [(["--pp", "4", "--zero", "1", "--recompute", "selective"], 4),
                                           (["--zero", "3", "--dp-replicate", "2", "--recompute", "full"], 1)],
                         ids=["pp4_zero1", "zero3_hybrid_sharding"])
def test_dry_run_checks_llama70b_states_per_rank(tmp_path, capsys, flags, stages):
    """The runtime's states per stage equal the cost model's; under hybrid sharding each rank
    holds its shard group's 1/4 (dp 8 over two replicas), not 1/8."""
    plan = tmp_path / "70b.json"
    assert main(["predict", "--model", "llama-70b", "--cluster", "8x8xA100", "--tp", "8", *flags,
                 "--out", str(plan), "--json"]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), "--dry-run", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["stage"] for r in rows] == list(range(stages))
    for row in rows:
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert abs(row[key]["error_pct"]) < 0.01, (row["stage"], key, row[key])


@pytest.mark.parametrize("flags", [["--tp", "2"], ["--cp", "2", "--seq-len", "8192", "--global-batch", "128"]],
                         ids=["tp2", "cp2"])
def test_dry_run_holds_the_experts_the_model_says(tmp_path, capsys, flags):
    """Experts are not split over TP (expert TP 1), sharded over EP (folded: under tp2 both TP
    ranks and two replicas, under cp2 both CP ranks and two replicas) and, by ZeRO, over the
    ranks holding the same ones (two local experts over a group of four: rows, not padded
    experts): the runtime's states per stage equal the cost model's."""
    plan = tmp_path / "mixtral.json"
    assert main(["predict", "--model", "mixtral-8x7b", "--cluster", "8x8xH100", *flags, "--pp", "4",
                 "--ep", "4", "--zero", "1", "--recompute", "full", "--out", str(plan), "--json"]) == 0
    sync_s = json.loads(capsys.readouterr().out)["estimate"]["time_breakdown_s"]["comm/tp_replica_sync"]
    assert sync_s > 0 if "--tp" in flags else sync_s == 0
    assert main(["run", str(plan), "--dry-run", "--json"]) == 0
    for row in json.loads(capsys.readouterr().out)["rows"]:
        for key in ("params_bytes", "grads_bytes", "optimizer_bytes"):
            assert abs(row[key]["error_pct"]) < 0.01, (row["stage"], key, row[key])


def test_dry_run_lays_out_a_megatron_plans_folded_experts(tmp_path, capsys):
    """A plan searched for Megatron-Core with EP beyond dp (ep8 over tp2 x dp4: the EP group every
    rank of a stage, costmodel.placement.expert_layout) runs as its framework lays it out: each
    rank's parameter elements, whole and ZeRO-sharded, equal the cost model's count under
    Megatron-Core's traits (each rank's experts sharded over no other rank)."""
    from costmodel.params import rank_params
    from costmodel.plan import PlanFile
    plan = tmp_path / "plan.json"
    assert main(["predict", "--model", "mixtral-8x7b", "--cluster", "2x8xH100", "--tp", "2", "--pp", "2", "--ep", "8",
                 "--seq-len", "4096", "--global-batch", "64", "--framework", "megatron", "--out", str(plan),
                 "--json"]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), "--dry-run", "--json"]) == 0
    pf = PlanFile.load(plan)
    assert pf.plan.dp == 4 and pf.cluster.framework.ep_folds_over_tp
    for row in json.loads(capsys.readouterr().out)["rows"]:
        counted = rank_params(pf.model, pf.plan, row["stage"])
        assert row["elements_unsharded"] == counted.replicated + counted.experts
        assert row["elements_shard"] == counted.zero_shard(pf.plan, pf.cluster.framework)

def _printed_launch(tmp_path, capsys, *predict: str) -> str:
    """What `planner run --print-launch` prints for the plan `planner predict` gives with these flags."""
    plan = tmp_path / "plan.json"
    assert main(["predict", *predict, "--out", str(plan), "--json"]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), "--print-launch"]) == 0
    return capsys.readouterr().out


def test_print_launch_gives_one_torchrun_per_node_and_sbatch(tmp_path, capsys):
    out = _printed_launch(tmp_path, capsys, "--model", "llama-70b", "--cluster", "8x8xA100", "--tp", "8", "--pp", "4")
    # each with the allocator setting the GPU profiles price fragmentation with, as a local run sets it
    assert out.count("env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torchrun --nnodes=8 --nproc-per-node=8") == 8
    # c10d ranks the hosts itself and ignores --node-rank (torchrun warns so): none is passed
    assert "--node-rank" not in out and out.count("--rdzv-conf=is_host=true") == 1
    assert "#SBATCH --nodes=8" in out and "--gpus-per-node=8" in out and "srun torchrun" in out
    assert "export MASTER_ADDR PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out


def test_print_launch_starts_an_nvlink_domain_node_host_by_host(tmp_path, capsys):
    """A GB200 node of the plan is a rack's NVLink domain of 4-GPU trays: torchrun runs a tray at a
    time, and Slurm keeps a node's trays in one segment, as NVIDIA's launchers do."""
    out = _printed_launch(tmp_path, capsys, "--model", "llama3-8b", "--cluster", "2x8xGB200", "--tp", "2", "--mbs", "1")
    assert out.count("expandable_segments:True torchrun --nnodes=4 --nproc-per-node=4") == 4
    assert "#SBATCH --nodes=4" in out and "#SBATCH --gpus-per-node=4" in out and "#SBATCH --segment=2" in out
    # c10d ranks the hosts by name: where that order splits a domain listed in a hostfile, the TP
    # groups of its ranks would cross the scale-out network; refused, naming two such hosts
    plan = tmp_path / "plan.json"
    hosts = tmp_path / "hosts.txt"
    launch = ["run", str(plan), "--print-launch", "--launcher", "hostfile", "--hostfile", str(hosts)]
    hosts.write_text("127.0.0.1\n127.0.0.2\n127.0.0.10\n127.0.0.11\n")
    assert main(launch) == 2
    assert "127.0.0.1 and 127.0.0.10 would share an NVLink domain of 2 hosts" in capsys.readouterr().err
    hosts.write_text("127.0.0.1\n127.0.0.1\n127.0.0.10\n127.0.0.11\n")
    assert main(launch) == 2 and "127.0.0.1 is listed twice" in capsys.readouterr().err
    hosts.write_text("127.0.0.1\n127.0.0.10\n127.0.0.11\n127.0.0.2\n")   # the same domains as c10d's order
    assert main(launch) == 0 and capsys.readouterr().out.count("--local-addr=127.0.0.1 ") == 1
    assert main(["run", str(plan), "--print-launch", "--launcher", "k8s", "--image", "registry.example/planner:0.1"]) == 0
    assert "an NVLink domain of 2 pods' hosts" in capsys.readouterr().out
    # a mixed cluster's launch keeps a node per host: one whose nodes span hosts is refused in one line
    mixed = tmp_path / "mixed.json"
    assert main(["search", "--model", "llama3-8b", "--cluster", "2x8xH100+2x8xGB200", "--top", "1",
                 "--out", str(mixed)]) == 0
    capsys.readouterr()
    assert main(["run", str(mixed), "--print-launch"]) == 2
    assert capsys.readouterr().err.strip() == ("planner run: error: a mixed cluster is launched a node per host, and "
                                               "GB200's nodes of 8 span hosts of 4: launch its groups apart")


def test_a_job_name_is_a_label_whatever_the_model_is_called(tmp_path):
    """A config.json's model name may hold '/' and capitals; a PyTorchJob's name is a DNS-1035
    label (the training operator's webhook refuses others), and sbatch takes the same."""
    import dataclasses

    from costmodel.plan import PlanFile
    from runtime.launch import job_name
    pf = PlanFile.load(_plan(tmp_path))
    named = dataclasses.replace(pf, model=dataclasses.replace(pf.model, name="meta-llama/Meta-Llama-3-8B_v2."))
    assert job_name(named) == "planner-meta-llama-meta-llama-3-8b-v2"
    long = dataclasses.replace(pf, model=dataclasses.replace(pf.model, name="x" * 54 + "-" + "y" * 20))
    assert len(job_name(long)) <= 63 and not job_name(long).endswith("-")


def test_dry_run_shards_zero_over_dp_times_cp(tmp_path, capsys):
    """cp ranks hold the same weights, so ZeRO shards over dp x cp, in the runtime as in costmodel."""
    plan = tmp_path / "cp.json"
    assert main(["predict", "--model", "llama3-8b", "--cluster", "2x8xH100", "--cp", "2", "--tp", "2",
                 "--pp", "2", "--vpp", "2", "--zero", "1", "--global-batch", "64", "--out", str(plan),
                 "--json"]) == 0
    capsys.readouterr()
    assert main(["run", str(plan), "--dry-run", "--json"]) == 0
    for row in json.loads(capsys.readouterr().out)["rows"]:
        assert abs(row["optimizer_bytes"]["error_pct"]) < 0.01


def test_a_context_parallel_plan_runs(tmp_path, capsys):
    """cp2 on two gloo ranks, the worker's own loop and measurement: what the search emits for
    long sequences runs and is measured (its equality with one process: test_parity; the
    torchrun launch, the same for every plan: the tests above)."""
    plan = _plan(tmp_path, "--cp", "2", "--zero", "1")
    assert json.loads(capsys.readouterr().out)["estimate"]["time_breakdown_s"]["comm/cp_exposed"] > 0
    m = _measured_forked(plan)
    assert m.plan["cp"] == 2 and len(m.losses) == 2 and m.peak_memory_bytes[0] > 0


def _one_thread_rank(pf):
    from runtime.train import RunConfig, run_rank
    torch.set_num_threads(1)   # as `planner run` gives each CPU rank (profile threads_per_rank)
    return run_rank(pf, RunConfig(steps=1, warmup=1, quiet=True))


def _measured_forked(plan: Path):
    """The plan's measured record as `planner run` writes it (runtime.measure), its ranks forked
    from this process: the worker's own training loop and memory tracker without torchrun's
    start-up and imports (the launch path has its own tests above)."""
    from costmodel.plan import PlanFile
    from runtime.fork import run_forked
    from runtime.measure import measured_record
    pf = PlanFile.load(plan)
    raw = run_forked(pf.plan.world_size, _one_thread_rank, pf)[0]
    return measured_record(pf, raw, steps=1, warmup=1, wall_s=0.0)


def test_zero_under_a_pipeline_uses_the_memory_the_model_says(tmp_path, capsys):
    """pp2 x dp2 in bf16 (4 oversubscribed gloo ranks): torch pipelining keeps FSDP's gradients
    and gathered weights whole until the last micro-batch, so ZeRO-3 holds what ZeRO-1 does, per
    stage, and the cost model (our runtime's traits) predicts the same for both. ZeRO-1's stage is
    one FSDP unit (runtime.parallel.fsdp_units: debug-tiny's layers are far below a bucket), whose
    reduction at the step's end copies the stage's gradients at once where ZeRO-3's copies a
    layer's: the last stage measures about 1.48 MB against 1.26, which the prediction, above
    both (it also counts a reserve the CPU tracker cannot see, the backward working set at its
    widest), covers by less than half."""
    peaks = {}
    for zero in ("1", "3"):
        plan = tmp_path / f"z{zero}.json"
        assert main(["predict", "--model", "debug-tiny", "--cluster", "1x4xxeon-amx", "--dtype", "bf16", "--pp", "2",
                     "--dp", "2", "--zero", zero, "--mbs", "1", "--out", str(plan), "--json"]) == 0
        capsys.readouterr()
        m = _measured_forked(plan)
        peaks[zero] = (m.peak_memory_bytes, m.predicted_memory_compared_bytes)
    for stage in range(2):
        measured1, measured3 = peaks["1"][0][stage], peaks["3"][0][stage]
        predicted1, predicted3 = peaks["1"][1][stage], peaks["3"][1][stage]
        assert measured3 <= 1.05 * measured1   # the tracker sees gloo's timing
        assert predicted3 == pytest.approx(predicted1, rel=0.03)
        for measured, predicted in ((measured1, predicted1), (measured3, predicted3)):
            assert measured <= predicted <= 1.5 * measured


@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zbv", 2)])
def test_pipeline_schedules_hold_the_memory_the_model_says(tmp_path, capsys, schedule, vpp):
    """Per stage, measured peak against predicted on 2 stages x 8 micro-batches (fp32): torch's
    zero-bubble schedules keep a deferred weight pass's whole graph and its output gradients
    (costmodel.frameworks.deferred_w_keeps_graph), pipeline buffers and sends live until their
    consumer is done (runtime.pipeline; pipeline_sends_held off), and the last stage keeps no
    logits beyond the micro-batch in flight. `python benchmarks/memory.py pipeline` prints the
    figures (predicted -1 % to +20 % against measured)."""
    plan = tmp_path / "plan.json"
    assert main(["predict", "--model", "debug-small", "--cluster", "1x2xxeon-amx", "--dtype", "fp32",
                 "--seq-len", "512", "--global-batch", "16", "--mbs", "2", "--pp", "2", "--dp", "1",
                 "--vpp", str(vpp), "--zero", "0", "--schedule", schedule, "--out", str(plan), "--json"]) == 0
    capsys.readouterr()
    m = _measured_forked(plan)
    for stage, (measured, predicted) in enumerate(zip(m.peak_memory_bytes, m.predicted_memory_compared_bytes)):
        assert -0.10 <= predicted / measured - 1 <= 0.25, f"stage {stage}: {predicted:.3g} vs {measured:.3g}"


@pytest.mark.alone   # a per-rank timing difference of 80 ms
def test_a_straggler_is_named_in_the_measured_results(tmp_path):
    """Rank 1 computes 20 ms slower per layer: every rank's step time equalises at the slowest
    (they wait for it), its own layer forwards do not; measured.json keeps it per rank."""
    plan = _plan(tmp_path, "--dp", "2")
    proc = _run(str(plan), "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "run"),
                "--inject-fault", "1:0:slow")
    assert proc.returncode == 0, proc.stderr
    fwd = json.loads((tmp_path / "run" / "measured.json").read_text())["rank_forward_s"]
    assert len(fwd) == 2 and fwd[1] > fwd[0] + 0.05   # 4 layers x 20 ms
    assert "slowest rank's layer forwards (rank 1)" in proc.stdout


def test_print_launch_for_a_hostfile_runs_and_a_pytorchjob_parses(tmp_path, capsys):
    """The hostfile variant's command, run here as printed (one host: localhost), trains; the
    Kubernetes PyTorchJob for the 8-node llama-70b plan is valid YAML with a Master and 7 Workers
    of 8 GPUs; a hostfile that does not fit the plan, or names an unknown host, is one line."""
    import yaml
    plan = _plan(tmp_path, "--dp", "2")
    capsys.readouterr()
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("# the only node\nlocalhost slots=2\n")
    out = tmp_path / "run"
    assert main(["run", str(plan), "--print-launch", "--launcher", "hostfile", "--hostfile", str(hosts), "--steps", "2",
                 "--warmup", "0", "--out", str(out)]) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1]
    assert command.startswith("env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True OMP_NUM_THREADS=")
    assert " torchrun --nnodes=1 --nproc-per-node=2" in command
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(json.loads((out / "raw.json").read_text())["losses"]) == 2
    # no `planner run` waited for these ranks: rank 0 wrote the run directory report and calibrate read
    assert (out / "plan.json").read_text() == plan.read_text()
    from runtime.measure import MeasuredRun
    assert MeasuredRun.load(out / "measured.json").steps == 2
    assert main(["report", str(out / "plan.json"), "--measured", str(out / "measured.json"),
                 "--out", str(tmp_path / "report")]) == 0
    big = tmp_path / "70b.json"
    assert main(["predict", "--model", "llama-70b", "--cluster", "8x8xA100", "--tp", "8", "--pp", "4",
                 "--recompute", "full", "--out", str(big), "--json"]) == 0
    capsys.readouterr()
    assert main(["run", str(big), "--print-launch", "--launcher", "k8s", "--image", "registry.example/planner:0.1"]) == 0
    job = yaml.safe_load(capsys.readouterr().out)
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert job["kind"] == "PyTorchJob" and specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 7
    container = specs["Worker"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8 and "--nnodes=8" in container["command"]
    assert {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"} in container["env"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", job["metadata"]["name"])   # a DNS-1035 label
    # a pod Kubernetes restarts would find this run's checkpoints: a resume flag is asked for; no empty image
    k8s = ["run", str(big), "--print-launch", "--launcher", "k8s", "--image"]
    assert main([*k8s, "registry.example/planner:0.1", "--checkpoint-dir", str(tmp_path / "ck")]) == 2
    assert "pass --resume-if-present" in capsys.readouterr().err
    assert main([*k8s, "registry.example/planner:0.1", "--checkpoint-dir", str(tmp_path / "ck"),
                 "--resume-if-present"]) == 0
    assert "--resume-if-present" in capsys.readouterr().out
    assert main([*k8s, " "]) == 2 and "--image is empty" in capsys.readouterr().err
    for image in ("bad image:@@", "img:", "registry.example/planner:a:b"):   # not written into the YAML unread
        assert main([*k8s, image]) == 2 and "is not a container image reference" in capsys.readouterr().err
    assert main([*k8s, "nvcr.io/nvidia/pytorch:24.09-py3"]) == 0 and "nvcr.io/nvidia/pytorch:24.09-py3" in \
        capsys.readouterr().out
    # a CPU plan's sbatch asks for no GPU and gives each rank its profile's threads
    assert main(["run", str(plan), "--print-launch"]) == 0
    out = capsys.readouterr().out
    assert "--gpus-per-node" not in out and "export MASTER_ADDR PYTORCH_CUDA_ALLOC_CONF" in out and \
        "OMP_NUM_THREADS=" in out
    for text, message in (("localhost slots=4\n", "has slots=4, but the plan puts 2"),
                          ("h\xe9te\n".encode("latin-1"), "is not a text file (not UTF-8)"),
                          ("localhost\nlocalhost\n", "2 host(s), but the plan's cluster has 1 host(s)"),
                          ("no-such-host.invalid\n", "cannot be resolved from here")):
        hosts.write_bytes(text) if isinstance(text, bytes) else hosts.write_text(text)
        assert main(["run", str(plan), "--print-launch", "--launcher", "hostfile", "--hostfile", str(hosts)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1
    assert main(["run", str(plan), "--print-launch", "--launcher", "k8s"]) == 2
    assert "needs --image" in capsys.readouterr().err
    assert main(["run", "--print-launch", str(plan)]) == 0   # the flag before the plan, as before
    capsys.readouterr()


def test_a_printed_launch_keeps_the_resume_rule_of_a_local_run(tmp_path, capsys, monkeypatch):
    """--resume-if-present reaches the ranks; a --checkpoint-dir of earlier checkpoints is refused
    here without a resume flag, and by the ranks themselves where this machine cannot see it."""
    from types import SimpleNamespace

    from runtime import checkpoint
    from runtime.train import _resume
    plan = _plan(tmp_path)
    capsys.readouterr()
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-000008").mkdir(parents=True)
    argv = ["run", str(plan), "--print-launch", "--checkpoint-dir", str(ckpt)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds checkpoints (step-000008); pass --resume or --resume-if-present" in err
    assert main([*argv, "--resume-if-present"]) == 0
    assert "--resume-if-present" in capsys.readouterr().out
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    cfg = SimpleNamespace(checkpoint_dir=str(ckpt), resume=False, resume_if_present=False)
    with pytest.raises(checkpoint.CheckpointError, match="holds checkpoints of an earlier run"):
        _resume(None, None, None, cfg, 10)
    empty = SimpleNamespace(checkpoint_dir=str(tmp_path / "none"), resume=False, resume_if_present=True)
    assert _resume(None, None, None, empty, 10) == 0   # nothing to resume: from step 0
