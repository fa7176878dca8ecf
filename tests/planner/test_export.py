"""`planner export`: each target's file is read by the real tool's own parser or config classes
(torchtitan's ConfigManager and ParallelDims, Megatron-Core's TransformerConfig and
DistributedDataParallelConfig, DeepSpeed's DeepSpeedConfig; installed by the test extra, skipped
with the reason where they are not), says the plan it claims to, and lists what it changed."""
from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path

import pytest

from costmodel.plan import PlanFile
from planner.cli import main

# the main job's plan, a per-rank-recompute interleaved mixture with experts, and plans that
# exercise what a target cannot say (uneven layers, zero-bubble, ZeRO-3 under a pipeline, GPipe)
PLANS = {
    "llama70b": ["--model", "llama-70b", "--cluster", "8x8xA100", "--tp", "2", "--pp", "8", "--cp", "2",
                 "--zero", "1"],
    "mixtral": ["--model", "mixtral-8x7b", "--cluster", "8x8xH100", "--pp", "2", "--vpp", "4", "--ep", "8",
                "--zero", "1", "--recompute", "full", "--recompute-layers", "1"],
    "llama8b_zb": ["--model", "llama3-8b", "--cluster", "1x8xH100", "--tp", "2", "--pp", "4", "--zero", "3",
                   "--schedule", "zb-h1", "--seq-len", "4096", "--global-batch", "64"],
    "llama8b_interleaved_selective": ["--model", "llama3-8b", "--cluster", "2x8xH100", "--tp", "4", "--pp", "2",
                                      "--vpp", "2", "--recompute", "selective", "--seq-len", "4096",
                                      "--global-batch", "64", "--mesh-order", "dp,pp,cp,tp"],
    "llama13b_gpipe_zero0_uneven": ["--model", "llama2-13b", "--cluster", "2x8xA100", "--tp", "2", "--pp", "4",
                                    "--zero", "0", "--schedule", "gpipe", "--recompute", "full",
                                    "--global-batch", "64"],
}
# offloaded states: each target's own offload switch (Megatron's only under its distributed optimizer)
PLANS["llama8b_zero3_offload"] = ["--model", "llama3-8b", "--cluster", "1x8xH100", "--zero", "3", "--offload-optimizer",
                                  "--seq-len", "4096", "--global-batch", "64"]
# float8 linears: torchtitan's float8 converter (compiled), Megatron's Transformer Engine recipe
PLANS["llama8b_fp8"] = ["--model", "llama3-8b", "--cluster", "1x8xH100", "--zero", "3", "--dtype", "fp8",
                        "--recompute", "full", "--seq-len", "4096", "--global-batch", "64"]
# activations on the host: no target's file says it; each export keeps them on the device
PLANS["llama8b_act_offload"] = ["--model", "llama3-8b", "--cluster", "1x8xH100", "--zero", "3",
                                "--offload-activations", "--seq-len", "4096", "--global-batch", "64"]
# NeMo's Llama 3.1 405B layout: 126 layers on pp 8 x vpp 8, the embedding and the loss counted as layers
PLANS["llama405b_embedding_loss_split"] = ["--model", "llama3-405b", "--cluster", "128x8xH100", "--tp", "8", "--pp", "8",
                                           "--cp", "2", "--vpp", "8", "--zero", "1", "--seq-len", "8192",
                                           "--global-batch", "512", "--grad-dtype", "bf16", "--framework", "megatron"]
# Megatron-Core's MoE parallel folding: EP 8 over TP 2 x 4 data-parallel ranks (ep > dp), which
# only Megatron runs (the other targets refuse it: test_a_folded_expert_layout_is_megatron_s_only)
FOLDED = {"mixtral_ep_folded": ["--model", "mixtral-8x7b", "--cluster", "2x8xH100", "--tp", "2", "--pp", "2",
                                "--ep", "8", "--zero", "1", "--seq-len", "4096", "--global-batch", "64",
                                "--framework", "megatron"],
          # expert tensor parallelism: each expert split over 2 of the TP ranks, EP 4 over the next ranks
          # Megatron-Core's expert all-to-all overlap: EP, an interleaved pipeline, no full recomputation
          "mixtral_ep_overlap": ["--model", "mixtral-8x7b", "--cluster", "4x8xH100", "--tp", "2", "--pp", "2",
                                 "--vpp", "2", "--ep", "8", "--recompute", "selective", "--zero", "1",
                                 "--seq-len", "4096", "--global-batch", "64", "--framework", "megatron",
                                 "--ep-overlap"],
          "mixtral_etp": ["--model", "mixtral-8x7b", "--cluster", "2x8xH100", "--tp", "4", "--pp", "2", "--ep", "4",
                          "--etp", "2", "--zero", "1", "--seq-len", "4096", "--global-batch", "64",
                          "--framework", "megatron"],
          # one layer a virtual stage, the first and the last holding the embedding and the loss alone
          # (32 layers + 2 on pp 2 x vpp 17), as the model zoo runs Qwen3-235B's 94 on pp 32 x vpp 3
          "llama8b_empty_end_stages": ["--model", "llama3-8b", "--cluster", "1x8xH100", "--tp", "4", "--pp", "2",
                                       "--vpp", "17", "--zero", "1", "--seq-len", "4096", "--global-batch", "64",
                                       "--framework", "megatron"],
          # an explicit layout whose last stage holds the loss alone (Megatron-Bridge's DeepSeek-V3: ...|mL)
          "llama8b_loss_alone": ["--model", "llama3-8b", "--cluster", "1x8xH100", "--tp", "4", "--pp", "2",
                                 "--zero", "1", "--seq-len", "4096", "--global-batch", "64", "--framework", "megatron"]}
# interleaved virtual stages of unequal layers (4 ranks x 2 chunks): Megatron's explicit layout
PLANS["llama8b_interleaved_uneven"] = ["--model", "llama3-8b", "--cluster", "1x8xH100", "--tp", "2", "--pp", "4",
                                       "--vpp", "2", "--zero", "1", "--seq-len", "4096", "--global-batch", "64"]
# hybrid sharding: ZeRO-3 inside each node's 8 ranks, 2 replicas (torchtitan's replicate x shard;
# Megatron and DeepSpeed shard over every data-parallel rank: one shard group there)
PLANS["llama8b_hsdp"] = ["--model", "llama3-8b", "--cluster", "2x8xH100", "--zero", "3", "--dp-replicate", "2",
                         "--seq-len", "4096", "--global-batch", "64"]
# splits only the search writes: the plan's fields replaced
UNEVEN = {"llama13b_gpipe_zero0_uneven": {"layers_per_stage": [9, 10, 10, 11], "recompute_num_layers": [9, 10, 10, 11]},
          "llama8b_interleaved_uneven": {"layers_per_stage": [3, 4, 5, 4, 4, 4, 5, 3]},
          "llama8b_loss_alone": {"layers_per_stage": [32, 0]}}
# a Qwen3-shaped model (heads of 128 over a 1024-wide model, per-head Q/K norms), from its config.json
QWEN3 = {"model_type": "qwen3", "hidden_size": 1024, "head_dim": 128, "num_attention_heads": 16,
         "num_key_value_heads": 8, "intermediate_size": 3072, "num_hidden_layers": 8, "vocab_size": 151936,
         "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": False, "max_position_embeddings": 40960}
PLANS["qwen3_tp2_pp2"] = ["--model", "QWEN3", "--cluster", "1x8xH100", "--tp", "2", "--pp", "2",
                          "--seq-len", "4096", "--global-batch", "64"]


# plans searched for each target (`search --framework T --out`): a pipeline, so that the target's
# layer split and recomputation rules are what the search solved under; exported as they are
SEARCHED = ["--model", "llama3-8b", "--cluster", "1x8xH100", "--seq-len", "4096", "--global-batch", "64",
            "--fix", "pp=4", "--fix", "recompute=full"]
NAMES = [*PLANS, "searched"]


def _path(paths: dict[str, Path], name: str, target: str) -> Path:
    return paths[f"searched-{target}"] if name == "searched" else paths[name]


@pytest.fixture(scope="module")
def plan_paths(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("plans")
    paths = {}
    config = root / "qwen3" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(QWEN3))
    for name, flags in {**PLANS, **FOLDED}.items():
        flags = [str(config) if f == "QWEN3" else f for f in flags]
        paths[name] = root / f"{name}.json"
        assert main(["predict", *flags, "--out", str(paths[name]), "--json"]) == 0, name
        if name in UNEVEN:
            doc = json.loads(paths[name].read_text())
            doc["plan"].update(UNEVEN[name])
            paths[name].write_text(json.dumps(doc))
    for target in ("torchtitan", "megatron", "deepspeed"):
        paths[f"searched-{target}"] = root / f"searched-{target}.json"
        assert main(["search", *SEARCHED, "--framework", target, "--out", str(paths[f"searched-{target}"]),
                     "--json"]) == 0, target
    return paths


def _exact_if_searched(doc: dict, pf: PlanFile, name: str) -> None:
    """A plan searched for the target is exported as it is: no change, and priced as planned; a
    plan priced for Megatron-Core is priced as planned too, with the options its file sets (the
    expert all-to-all overlap)."""
    if pf.cluster.framework.name == "megatron-core" and doc["target"] == "megatron" and not doc["differences"]:
        assert doc["estimate"]["step_time_s"] == pytest.approx(doc["planned"]["step_time_s"])
    if name == "searched":
        assert doc["plan"] == pf.plan.to_dict()
        assert doc["estimate"]["step_time_s"] == pytest.approx(doc["planned"]["step_time_s"])
        assert pf.plan.pp == 4 and pf.plan.recompute.value == "full"


def _export(capsys, path: Path, target: str, out: Path) -> dict:
    capsys.readouterr()   # what importing a tool printed (DeepSpeed logs on stdout)
    assert main(["export", str(path), "--to", target, "--out", str(out), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --- torchtitan -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_torchtitan_reads_the_job_file(plan_paths, tmp_path, capsys, name):
    config = pytest.importorskip("torchtitan.config", reason="torchtitan (test extra) is not installed")
    from torch.distributed.pipelining.schedules import get_schedule_class
    from torchtitan.distributed.parallel_dims import ParallelDims
    pf = PlanFile.load(_path(plan_paths, name, "torchtitan"))
    if pf.model.arch != "llama":
        pytest.skip("torchtitan has no gpt model")
    out = tmp_path / "job.toml"
    if pf.train.grad_dtype != "fp32":   # its mixed_precision_reduce is a literal "float32"
        assert main(["export", str(_path(plan_paths, name, "torchtitan")), "--to", "torchtitan", "--out", str(out)]) == 2
        assert "it reduces gradients in fp32 (training.mixed_precision_reduce), not bf16" in capsys.readouterr().err
        return
    doc = _export(capsys, _path(plan_paths, name, "torchtitan"), "torchtitan", out)
    _exact_if_searched(doc, pf, name)
    job = config.ConfigManager().parse_args(["--job.config_file", str(out)])   # unknown keys raise
    plan, p = doc["plan"], job.parallelism
    dims = ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree,
                        world_size=pf.cluster.world_size)   # torchtitan's own rules on the degrees
    assert (dims.tp, dims.pp, dims.cp, dims.ep) == (plan["tp"], plan["pp"], plan["cp"], plan["ep"])
    assert dims.dp_replicate * dims.dp_shard == plan["dp"]
    assert dims.dp_replicate == (plan["dp"] if plan["zero_stage"] == 0 else plan.get("dp_replicate", 1))
    assert job.training.seq_len == pf.train.seq_len and job.training.global_batch_size == pf.train.global_batch_size
    assert job.training.enable_cpu_offload == plan["offload_optimizer"]
    fp8 = plan["fp8_linears"]
    # the layers compiled, as priced (frameworks `compiled_layer`); the loss eager
    assert ("quantize.linear.float8" in job.model.converters) == fp8 and job.compile.enable
    assert list(job.compile.components) == ["model"]
    if fp8:
        assert job.quantize.linear.float8.recipe_name == "tensorwise" and job.quantize.linear.float8.filter_fqns == ["output"]
    if plan["pp"] > 1:
        get_schedule_class(p.pipeline_parallel_schedule)   # a schedule torch has
        stages = p.module_fqns_per_model_part
        layers = [int(n.split(".")[1]) for s in stages for n in s if n.startswith("layers.")]
        assert layers == list(range(pf.model.num_layers))
        assert [sum(n.startswith("layers.") for n in s) for s in stages] == plan["layers_per_stage"]
        assert job.training.local_batch_size == plan["micro_batch_size"] * plan["num_micro_batches"]
    ac = job.activation_checkpoint
    if plan["recompute"] == "selective":   # torchtitan's per-op policy, on every layer
        assert (ac.mode, ac.selective_ac_option) == ("selective", "op")
        assert plan["recompute_num_layers"] == _layers_by_rank(plan)
    elif plan["recompute"] == "full" and plan["recompute_num_layers"] != _layers_by_rank(plan):
        n = int(ac.selective_ac_option)   # every n-th layer each rank builds
        assert ac.mode == "selective" and plan["recompute_num_layers"] == [c // n for c in _layers_by_rank(plan)]
    else:
        assert ac.mode == plan["recompute"]
    assert all(isinstance(d, str) and d for d in doc["differences"])


def test_torchtitan_s_per_op_policy_is_searched_and_exported_as_searched(tmp_path, capsys):
    """torchtitan's selective recomputation is its per-op policy on every layer: the search under
    --framework torchtitan weighs it, the export writes it
    unchanged as `selective_ac_option = "op"`, and a plan of ours recomputing core attention on
    some layers becomes the per-op policy on all, each change a line."""
    config = pytest.importorskip("torchtitan.config", reason="torchtitan (test extra) is not installed")
    plan = tmp_path / "plan.json"
    assert main(["search", "--model", "llama3-70b", "--cluster", "8x8xA100", "--framework", "torchtitan",
                 "--fix", "recompute=selective", "--fix", "pp=4", "--top", "1", "--out", str(plan), "--json"]) == 0
    searched = PlanFile.load(plan).plan
    assert searched.recompute.value == "selective"
    assert searched.recompute_num_layers == tuple(searched.layers_on_rank(r) for r in range(searched.pp))
    doc = _export(capsys, plan, "torchtitan", tmp_path / "job.toml")
    assert doc["differences"] == [] and doc["plan"] == searched.to_dict()
    ac = config.ConfigManager().parse_args(["--job.config_file", str(tmp_path / "job.toml")]).activation_checkpoint
    assert (ac.mode, ac.selective_ac_option) == ("selective", "op")
    ours = tmp_path / "ours.json"
    assert main(["predict", "--model", "llama3-8b", "--cluster", "1x8xH100", "--tp", "2", "--pp", "2",
                 "--recompute", "selective", "--recompute-layers", "3,5", "--seq-len", "4096", "--global-batch", "64",
                 "--out", str(ours), "--json"]) == 0
    capsys.readouterr()
    doc = _export(capsys, ours, "torchtitan", tmp_path / "ours.toml")
    assert doc["plan"]["recompute"] == "selective" and doc["plan"]["recompute_num_layers"] == [16, 16]
    assert any(d.startswith("selective recomputation of [3, 5] layers per rank") for d in doc["differences"])
    assert any("torchtitan's per-op policy (selective_ac_option 'op')" in d for d in doc["differences"])


@pytest.mark.parametrize("target", ["megatron", "deepspeed"])
def test_hybrid_sharding_becomes_one_shard_group_where_the_target_has_none(plan_paths, tmp_path, capsys, target):
    doc = _export(capsys, plan_paths["llama8b_hsdp"], target, tmp_path / f"out.{target}")
    assert "dp_replicate" not in doc["plan"] and doc["plan"]["zero_stage"] >= 1
    assert any(d.startswith("hybrid sharding (dp_replicate=2)") for d in doc["differences"]), doc["differences"]


def _layers_by_rank(plan: dict) -> list[int]:
    return [sum(plan["layers_per_stage"][v * plan["pp"] + r] for v in range(plan["vpp"])) for r in range(plan["pp"])]


def test_torchtitan_flavours_are_torchtitan_s():
    pytest.importorskip("torchtitan.config", reason="torchtitan (test extra) is not installed")
    from torchtitan.models.llama3 import llama3_args

    from planner.exports.torchtitan_models import FLAVOURS
    for f in (f for f in FLAVOURS if f.name == "llama3"):
        args = llama3_args[f.flavor]
        hidden = int(args.ffn_dim_multiplier * int(2 * 4 * args.dim / 3))
        hidden = args.multiple_of * -(-hidden // args.multiple_of)   # torchtitan's FeedForward sizing
        assert (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, hidden, args.vocab_size, args.rope_theta,
                args.norm_eps, args.dim // args.n_heads) == \
            (f.dim, f.n_layers, f.n_heads, f.n_kv_heads, f.ffn_hidden, f.vocab_size, f.rope_theta, f.norm_eps,
             f.head_dim)


def test_torchtitan_qwen3_flavours_are_torchtitan_s():
    """Every Qwen3 flavour torchtitan builds (but its debug models) is one of ours, with every
    dimension its args set; its train spec has no pipeline (pipelining_fn None), as `pipelined`
    says."""
    pytest.importorskip("torchtitan.config", reason="torchtitan (test extra) is not installed")
    from torchtitan.models.qwen3 import get_train_spec, qwen3_args

    from planner.exports.torchtitan_models import FLAVOURS
    ours = {f.flavor: f for f in FLAVOURS if f.name == "qwen3"}
    assert set(ours) == {k for k in qwen3_args if not k.startswith("debug")}
    for flavor, f in ours.items():
        a = qwen3_args[flavor]
        width = a.moe_inter_dim if a.moe_enabled else a.hidden_dim
        experts = (a.moe_args.num_experts, a.moe_args.top_k) if a.moe_enabled else (0, 0)
        assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.head_dim, width, a.vocab_size, a.rope_theta,
                a.norm_eps, a.qk_norm, a.enable_weight_tying, *experts) == \
            (f.dim, f.n_layers, f.n_heads, f.n_kv_heads, f.head_dim, f.ffn_hidden, f.vocab_size, f.rope_theta,
             f.norm_eps, f.qk_norm, f.tied, f.num_experts, f.top_k), flavor
        if a.moe_enabled:   # what matches() requires of a mixture: softmax, top-k renormalised, no shared expert
            m = a.moe_args
            assert (m.score_func, m.route_norm, m.num_shared_experts, m.num_expert_groups, m.route_scale) == \
                ("softmax", True, 0, None, 1.0)
        assert not f.pipelined and get_train_spec().pipelining_fn is None


def test_a_qwen3_plan_searched_for_torchtitan_names_its_flavour_and_no_pipeline(tmp_path, capsys):
    """Qwen3-30B-A3B searched for torchtitan: every plan listed runs without a pipeline, the job
    names torchtitan's own qwen3 30B-A3B flavour (no train spec to register), torchtitan's parser
    reads it, and the export is the plan searched, priced as planned."""
    config = pytest.importorskip("torchtitan.config", reason="torchtitan (test extra) is not installed")
    plan, job_path = tmp_path / "plan.json", tmp_path / "job.toml"
    assert main(["search", "--model", "qwen3-30b-a3b", "--cluster", "2x8xH100", "--framework", "torchtitan",
                 "--top", "5", "--out", str(plan), "--json"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and all(p["plan"]["pp"] == 1 for p in plans)
    doc = _export(capsys, plan, "torchtitan", job_path)
    assert doc["differences"] == [] and doc["plan"] == PlanFile.load(plan).plan.to_dict()
    assert doc["estimate"]["step_time_s"] == pytest.approx(doc["planned"]["step_time_s"])
    job = config.ConfigManager().parse_args(["--job.config_file", str(job_path)])
    assert (job.model.name, job.model.flavor) == ("qwen3", "30B-A3B")
    assert job.parallelism.expert_parallel_degree == plans[0]["plan"]["ep"]


def test_a_qwen3_shaped_model_of_no_flavour_is_registered_on_torchtitan_s_qwen3(plan_paths, tmp_path, capsys):
    """A Qwen3-shaped model of the user's (heads of 128 over 1024 wide, per-head Q/K norms) that no
    flavour matches: the job names a train spec of its own, to build on torchtitan's qwen3 model,
    and with a pipeline the note says that spec needs a pipelining_fn (the qwen3 spec has none)."""
    doc = _export(capsys, plan_paths["qwen3_tp2_pp2"], "torchtitan", tmp_path / "job.toml")
    note = next(d for d in doc["differences"] if "register a train spec" in d)
    assert "built on torchtitan.models.qwen3" in note and "head_dim=128, qk_norm" in note
    assert "pipelining_fn (torchtitan's pipeline_llm) for pp 2" in note
    assert tomllib.loads((tmp_path / "job.toml").read_text())["model"]["name"] == PlanFile.load(
        plan_paths["qwen3_tp2_pp2"]).model.name


@pytest.mark.parametrize("schedule, runs, vpp", [("zb-h1", "Schedule1F1B", 1), ("zbv", "ScheduleInterleaved1F1B", 2),
                                                  ("dualpipev", "ScheduleInterleaved1F1B", 2)])
def test_torchtitan_runs_a_zero_bubble_plan_with_a_schedule_that_takes_its_compiled_layers(
        tmp_path, capsys, schedule, runs, vpp):
    """torch's zero-bubble and DualPipeV classes refuse compiled stage modules, and torchtitan
    compiles its layers (as priced): the export runs the plan with 1F1B or interleaved 1F1B and
    says why; torchtitan's search lists none of them."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    from planner.exports import torchtitan
    plan = tmp_path / "plan.json"
    assert main(["predict", "--model", "llama3-8b", "--cluster", "2x8xH100", "--tp", "2", "--pp", "2", "--dp", "4",
                 "--schedule", schedule, "--seq-len", "4096", "--global-batch", "64", "--out", str(plan)]) == 0
    doc = _export(capsys, plan, "torchtitan", tmp_path / "job.toml")
    job = tomllib.loads((tmp_path / "job.toml").read_text())
    assert job["compile"]["enable"] and doc["plan"]["vpp"] == vpp
    assert get_schedule_class(job["parallelism"]["pipeline_parallel_schedule"]).__name__ == runs
    assert any("refuses the compiled layers torchtitan runs" in d for d in doc["differences"]), doc["differences"]
    assert {s.traits.torch_class for s in torchtitan.SCHEDULES} == {"ScheduleGPipe", "Schedule1F1B",
                                                                   "ScheduleInterleaved1F1B"}


def test_a_pipelined_qwen3_plan_is_refused_by_torchtitan(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["predict", "--model", "qwen3-30b-a3b", "--cluster", "2x8xH100", "--pp", "2", "--ep", "8",
                 "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["export", str(plan), "--to", "torchtitan", "--out", str(tmp_path / "job.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("planner export: error: torchtitan cannot run this plan: its qwen3 model (30B-A3B) runs without "
                   "a pipeline (the qwen3 train spec has no pipelining_fn), not at pp 2")
    assert not (tmp_path / "job.toml").exists()


# --- Megatron-LM ----------------------------------------------------------------------------

def test_a_rotary_base_megatron_cannot_parse_is_refused(plan_paths):
    """Megatron-LM reads --rotary-base as an int: Mixtral's 1e6 is written whole, a fraction refused."""
    import dataclasses

    from planner.exports.common import CannotExport
    from planner.exports.megatron_model import _position_arguments
    model = PlanFile.load(plan_paths["mixtral_ep_folded"]).model
    assert ("--rotary-base", "1000000") in _position_arguments(model)
    with pytest.raises(CannotExport, match="rope_theta is 10000.5"):
        _position_arguments(dataclasses.replace(model, rope_theta=10_000.5))


# Megatron-LM's flag -> Megatron-Core config field where the names differ (arguments.py does the same)
RENAMED = {"--norm-epsilon": "layernorm_epsilon", "--num-experts": "num_moe_experts", "--fp8-format": "fp8",
           "--decoder-first-pipeline-num-layers": "num_layers_in_first_pipeline_stage",
           "--decoder-last-pipeline-num-layers": "num_layers_in_last_pipeline_stage",
           "--num-virtual-stages-per-pipeline-rank": "virtual_pipeline_model_parallel_size"}
# flags that are not Megatron-Core config fields: checked here by what they say
TRAINING = {"--seq-length", "--max-position-embeddings", "--position-embedding-type", "--rotary-base",
            "--rotary-percent", "--use-rope-scaling", "--rope-scaling-factor", "--openai-gelu",   # GPTModel's
            "--untie-embeddings-and-output-weights", "--micro-batch-size", "--global-batch-size",
            "--tokenizer-type", "--vocab-size", "--make-vocab-size-divisible-by", "--mock-data", "--use-tp-pp-dp-mapping",
            "--group-query-attention", "--ckpt-format",
            "--train-iters", "--eval-iters", "--lr-decay-style", "--log-interval", "--log-throughput"}
# those Megatron-LM's arguments.py parses with type=int (an int() of "1e+06" stops the job)
INTEGER_TRAINING = {"--seq-length", "--max-position-embeddings", "--rotary-base", "--micro-batch-size",
                    "--global-batch-size", "--vocab-size", "--make-vocab-size-divisible-by", "--train-iters",
                    "--eval-iters", "--log-interval"}


def _megatron_args(text: str) -> dict[str, str | None]:
    words = shlex.split(text.split("pretrain_gpt.py", 1)[1].replace("\\\n", " "))
    args: dict[str, str | None] = {}
    for word in words:
        if word.startswith("--"):
            args[word] = None
            last = word
        else:
            args[last] = word
    return args


@pytest.mark.parametrize("name", [*NAMES, *FOLDED])
def test_megatron_core_accepts_the_arguments(plan_paths, tmp_path, capsys, monkeypatch, name):
    pytest.importorskip("megatron.core", reason="megatron-core (test extra) is not installed")
    import dataclasses

    import torch
    import torch.nn.functional as F
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig
    out = tmp_path / "run.sh"
    doc = _export(capsys, _path(plan_paths, name, "megatron"), "megatron", out)
    pf, plan = PlanFile.load(_path(plan_paths, name, "megatron")), doc["plan"]
    _exact_if_searched(doc, pf, name)
    args = _megatron_args(out.read_text())
    # Megatron pads the vocabulary to a multiple of the divisor x TP: the rows priced, unpadded
    multiple = int(args["--make-vocab-size-divisible-by"]) * plan["tp"]
    assert -(-pf.model.vocab_size // multiple) * multiple == pf.model.vocab_size or multiple == plan["tp"]
    tc_fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    ddp_fields = {f.name for f in dataclasses.fields(DistributedDataParallelConfig)}
    opt_fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    tc, ddp, opt = {}, {}, {}
    for flag, value in args.items():
        if flag in TRAINING:
            assert flag not in INTEGER_TRAINING or value.isdigit(), f"{flag} {value}: Megatron-LM parses an int"
            continue
        if flag == "--swiglu":
            tc.update(gated_linear_unit=True, activation_func=F.silu)
        elif flag == "--disable-bias-linear":
            tc["add_bias_linear"] = False
        elif flag == "--bf16":
            tc.update(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
        elif flag == "--qk-layernorm":
            tc["qk_layernorm"] = True
        elif flag in ("--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"):   # arguments.py's
            ddp["grad_reduce_in_fp32"] = flag == "--accumulate-allreduce-grads-in-fp32"
        elif flag == "--attention-backend":
            from megatron.core.transformer.enums import AttnBackend
            tc["attention_backend"] = AttnBackend[value]
        elif flag == "--num-layers-per-virtual-pipeline-stage":
            tc["virtual_pipeline_model_parallel_size"] = pf.model.num_layers // (plan["pp"] * int(value))
        else:
            field = RENAMED.get(flag, flag[2:].replace("-", "_"))
            target = (tc if field in tc_fields else ddp if field in ddp_fields
                      else opt if field in opt_fields else None)
            assert target is not None, f"{flag} is neither a Megatron-Core config field nor a known training flag"
            target[field] = True if value is None else _typed(value)
    if plan["pp"] > 1:
        tc.setdefault("pipeline_dtype", torch.float32)
    config = TransformerConfig(**tc)   # Megatron-Core's own checks (__post_init__)
    if name in ("llama405b_embedding_loss_split", "llama8b_empty_end_stages"):   # embedding + layers + loss
        assert config.account_for_embedding_in_pipeline_split and config.account_for_loss_in_pipeline_split
    if name in ("llama8b_interleaved_uneven", "llama8b_loss_alone"):   # the layout Megatron-Core parsed is the plan's split
        layout = config.pipeline_model_parallel_layout.layout   # [pp rank][virtual stage]: layer types
        assert [len([t for t in layout[r][v] if t.name == "decoder"]) for v in range(plan["vpp"])
                for r in range(plan["pp"])] == plan["layers_per_stage"] == UNEVEN[name]["layers_per_stage"]
        assert doc["differences"] == []
    DistributedDataParallelConfig(**ddp)
    # Megatron-LM's one --use-distributed-optimizer sets both configs' field; Transformer Engine is
    # not installed here, and the precision-aware optimizer's check asks its version
    from megatron.core.optimizer import optimizer_config
    monkeypatch.setattr(optimizer_config, "is_te_min_version", lambda *a, **k: True)
    OptimizerConfig(**opt, use_distributed_optimizer=ddp.get("use_distributed_optimizer", False))
    assert opt.get("optimizer_cpu_offload", False) == plan["offload_optimizer"]
    assert (config.fp8, config.fp8_recipe) == (("hybrid", "tensorwise") if plan["fp8_linears"] else (None, "delayed"))
    assert opt.get("optimizer_offload_fraction", 0.0) == (1.0 if plan["offload_optimizer"] else 0.0)
    # Megatron-LM's validate_args: CPU offload only with the precision-aware optimizer
    assert opt.get("use_precision_aware_optimizer", False) == plan["offload_optimizer"]
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size, config.context_parallel_size,
            config.expert_model_parallel_size) == (plan["tp"], plan["pp"], plan["cp"], plan["ep"])
    if pf.model.is_moe:   # Megatron's default is the dense TP size: the export always says it
        assert config.expert_tensor_parallel_size == plan.get("etp", 1)
    assert config.sequence_parallel == (plan["sequence_parallel"] and plan["tp"] > 1)
    # pretrain_gpt.py stops without a run length and a learning rate (update_train_iters, the scheduler)
    assert int(args["--train-iters"]) > 0 and float(args["--lr"]) > 0 and args["--eval-iters"] == "0"
    assert (config.virtual_pipeline_model_parallel_size or 1) == plan["vpp"]
    dp = pf.cluster.world_size // (plan["tp"] * plan["pp"] * plan["cp"])
    if pf.model.is_moe:
        _megatron_lays_out_the_experts(args, plan, pf.cluster.world_size, dp)
    assert int(args["--global-batch-size"]) == dp * int(args["--micro-batch-size"]) * plan["num_micro_batches"]
    assert config.recompute_granularity == (None if plan["recompute"] == "none" else plan["recompute"])
    if plan["recompute"] == "full":   # the block method's first N of every chunk: the plan's per-rank counts
        n = config.recompute_num_layers
        assert [sum(min(n, plan["layers_per_stage"][v * plan["pp"] + r]) for v in range(plan["vpp"]))
                for r in range(plan["pp"])] == plan["recompute_num_layers"]
    assert ("--use-distributed-optimizer" in args) == (plan["zero_stage"] == 1)
    # Megatron-FSDP checkpoints only in its own format (validate_args asserts it)
    assert (args.get("--ckpt-format") == "fsdp_dtensor") == (plan["zero_stage"] >= 2)
    # bf16 keeps gradients in fp32 unless told otherwise (arguments.py)
    assert ("--grad-reduce-in-bf16" in args) == (pf.train.grad_dtype.value == "bf16")
    # Megatron-LM's validate_args asserts CUDA_DEVICE_MAX_CONNECTIONS=1 under TP or CP (before
    # Blackwell) unless Megatron-FSDP runs
    needs_one = (plan["tp"] > 1 or plan["cp"] > 1) and plan["zero_stage"] < 2 and not pf.cluster.framework.ep_a2a_overlap
    assert ("\nexport CUDA_DEVICE_MAX_CONNECTIONS=1\n" in out.read_text()) == needs_one
    # the expert all-to-all overlap: on where priced so, with more queues (its recipes' 32) and
    # without Transformer Engine's TP overlap beside it
    assert config.overlap_moe_expert_parallel_comm == pf.cluster.framework.ep_a2a_overlap == (name == "mixtral_ep_overlap")
    if config.overlap_moe_expert_parallel_comm:
        assert "\nexport CUDA_DEVICE_MAX_CONNECTIONS=32\n" in out.read_text() and not config.tp_comm_overlap
    if pf.model.qk_norm:   # the heads as the model has them
        assert config.kv_channels == pf.model.head_dim and config.qk_layernorm


def test_a_folded_expert_layout_is_not_deepspeed_s(plan_paths, tmp_path, capsys):
    """EP beyond dp, folded over the TP ranks, is a layout DeepSpeed does not run: its export says
    so in one line, exit 2."""
    plan = tmp_path / "folded.json"   # without a pipeline: AutoTP beside one is refused first
    assert main(["predict", "--model", "mixtral-8x7b", "--cluster", "2x8xH100", "--tp", "4", "--ep", "8", "--zero", "1",
                 "--recompute", "full", "--seq-len", "4096", "--global-batch", "64", "--framework", "megatron",
                 "--out", str(plan)]) == 0
    capsys.readouterr()
    assert main(["export", str(plan), "--to", "deepspeed", "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "deepspeed cannot run this plan" in err and "ep=8" in err


def test_torchtitan_folds_experts_over_tp_as_the_plan_is_priced(plan_paths, tmp_path, capsys):
    """torchtitan 0.2 at expert TP 1 lays EP over the innermost ranks, TP first (its sparse mesh
    unflattens the dense one's ranks): the plan priced folded is its job file, and its
    ParallelDims takes the degrees."""
    parallel_dims = pytest.importorskip("torchtitan.distributed.parallel_dims", reason="torchtitan is not installed")
    out = tmp_path / "job.toml"
    doc = _export(capsys, plan_paths["mixtral_ep_folded"], "torchtitan", out)
    plan = doc["plan"]
    assert (plan["tp"], plan["pp"], plan["ep"], plan.get("etp", 1)) == (2, 2, 8, 1)
    job = tomllib.loads(out.read_text())["parallelism"]
    assert (job["expert_parallel_degree"], job["expert_tensor_parallel_degree"]) == (8, 1)
    parallel_dims.ParallelDims(dp_replicate=1, dp_shard=plan["dp"], cp=plan["cp"], tp=plan["tp"], pp=plan["pp"],
                               ep=plan["ep"], etp=1, world_size=16)   # its own checks
    # its sparse mesh re-reads the dense ranks: the experts' FSDP group is what EP leaves whole
    assert plan["dp"] * plan["cp"] * plan["tp"] % plan["ep"] == 0


def test_megatron_s_tp_pp_dp_mapping_is_never_written_beside_context_or_expert_parallelism(tmp_path, capsys):
    """Megatron-LM's validate_args refuses --use-tp-pp-dp-mapping with CP or EP > 1: such a plan
    is exported in the default order (a difference, said), and the search for Megatron never
    picks that order for them."""
    plan_path = tmp_path / "cp.json"
    assert main(["predict", "--model", "llama3-8b", "--cluster", "2x8xA100", "--pp", "4", "--cp", "2",
                 "--mesh-order", "dp,pp,cp,tp", "--out", str(plan_path), "--json"]) == 0
    doc = _export(capsys, plan_path, "megatron", tmp_path / "cp.sh")
    assert "--use-tp-pp-dp-mapping" not in (tmp_path / "cp.sh").read_text()
    assert any(d.startswith("mesh order dp>pp>cp>tp") for d in doc["differences"]), doc["differences"]
    searched = tmp_path / "searched.sh"
    assert main(["search", "--model", "llama3-8b", "--cluster", "2x8xA100", "--fix", "cp=2", "--fix", "pp=4",
                 "--export", "megatron", "--export-out", str(searched)]) == 0
    assert "--context-parallel-size 2" in searched.read_text()
    assert "--use-tp-pp-dp-mapping" not in searched.read_text()


def _megatron_lays_out_the_experts(args: dict, plan: dict, world: int, dp: int) -> None:
    """Megatron-Core's parallel_state builds the expert grid the export asks for: the plan's expert
    TP, its expert data-parallel size world / (etp x ep x pp) whole, and its pipeline groups the
    dense grid's (the assertion initialize_model_parallel makes); the plan's folded EP (ep > dp
    here) is what it runs."""
    from megatron.core.parallel_state import RankGenerator
    etp, ep = int(args["--expert-tensor-parallel-size"]), int(args["--expert-model-parallel-size"])
    assert etp == plan.get("etp", 1) and ep == plan["ep"] and world % (etp * ep * plan["pp"]) == 0
    order = "tp-cp-ep-pp-dp" if "--use-tp-pp-dp-mapping" in args else "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=plan["tp"], ep=1, dp=dp, pp=plan["pp"], cp=plan["cp"], order=order)
    experts = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * plan["pp"]), pp=plan["pp"], cp=1, order=order)
    assert dense.get_ranks("pp") == experts.get_ranks("pp")


def _typed(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


# --- DeepSpeed ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_deepspeed_reads_the_config(plan_paths, tmp_path, capsys, monkeypatch, name):
    pytest.importorskip("deepspeed", reason="deepspeed (test extra) is not installed")
    from types import SimpleNamespace

    import deepspeed.runtime.config as ds_config
    from deepspeed.runtime.config import DeepSpeedConfig
    # no process group here: rank 0 of a job whose data-parallel size the mpu below gives
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    out = tmp_path / "ds_config.json"
    planned = PlanFile.load(_path(plan_paths, name, "deepspeed")).plan
    if planned.tp > 1 and planned.pp > 1:   # the engine replaces the pipeline's grid with AutoTP's groups
        capsys.readouterr()
        assert main(["export", str(_path(plan_paths, name, "deepspeed")), "--to", "deepspeed", "--out", str(out)]) == 2
        assert "AutoTP (tp" in capsys.readouterr().err and not out.exists()
        return
    doc = _export(capsys, _path(plan_paths, name, "deepspeed"), "deepspeed", out)
    plan = doc["plan"]
    _exact_if_searched(doc, PlanFile.load(_path(plan_paths, name, "deepspeed")), name)
    # DeepSpeed's batch arithmetic, its ZeRO, TP and precision models: a pipeline's grid (no tensor axis) gives the
    # data-parallel size (the mpu below); without one, AutoTP passes no mpu and DeepSpeed counts
    # every rank of the world, so the file leaves train_batch_size for it to derive
    world = plan["dp"] * plan["tp"] * plan["pp"]
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: world)
    grid = SimpleNamespace(get_data_parallel_world_size=lambda: world // plan["pp"]) if plan["pp"] > 1 else None
    config = DeepSpeedConfig(str(out), mpu=grid)
    assert config.train_batch_size == world // plan["pp"] * plan["micro_batch_size"] * plan["num_micro_batches"]
    assert ("train_batch_size" in json.loads(out.read_text())) == (plan["tp"] == 1)
    global_batch = PlanFile.load(_path(plan_paths, name, "deepspeed")).train.global_batch_size
    assert plan["dp"] * plan["micro_batch_size"] * plan["num_micro_batches"] == global_batch
    assert config.zero_optimization_stage == plan["zero_stage"]
    assert config.grad_accum_dtype == PlanFile.load(_path(plan_paths, name, "deepspeed")).train.grad_dtype.value
    assert (config.zero_config.offload_optimizer is not None) == plan["offload_optimizer"]
    if plan["zero_stage"] == 3:   # the next layer gathered behind the current one, two live: as priced
        _zero3_runs_as_priced(config.zero_config, PlanFile.load(_path(plan_paths, name, "deepspeed")))
    assert not plan["fp8_linears"]   # no float8 in DeepSpeed's config: the export said so and priced bf16
    assert config.tensor_parallel_config.autotp_size == (plan["tp"] if plan["tp"] > 1 else 0)
    assert config.pipeline["stages"] == "auto"   # the PipelineModule's num_stages says it (the launch line)
    assert plan["cp"] == 1 and plan["vpp"] == 1 and not (plan["tp"] > 1 and plan["sequence_parallel"])
    # a PipelineModule only with a pipeline (its engine refuses ZeRO-2/3)
    assert ("PipelineModule(num_stages=" in doc["launch"]) == (plan["pp"] > 1), doc["launch"]
    if plan["pp"] > 1:   # blocks balanced as the plan splits them, not every list item ('uniform')
        per = max(plan["layers_per_stage"])
        assert "partition_method='type:" in doc["launch"] and f"{per} blocks a stage" in doc["launch"], doc["launch"]


def _zero3_runs_as_priced(zero, pf: PlanFile) -> None:
    """DeepSpeed's coordinator walked with the knobs the config sets (costmodel.zero3_coordinator)
    holds about the two gathered layers the plan is priced with (besides the embedding or head,
    fetched whole when used), and gathers each weight twice a micro-batch as FSDP's unit is priced:
    for the forward, and for the recomputed forward, whose weights its backward reuses."""
    from dataclasses import replace

    from costmodel.params import layer_params, rank_params
    from costmodel.plan import Recompute
    from costmodel.zero3_coordinator import step_trace, walk
    layer = layer_params(pf.model, pf.plan.tp, pf.plan.ep)
    assert (zero.prefetch_bucket_size, zero.max_live_parameters, zero.max_reuse_distance) == (layer, 2 * layer, layer)
    plan = replace(pf.plan, recompute=Recompute.FULL)
    held = rank_params(pf.model, plan, 0, pf.cluster.framework)
    trace = step_trace(pf.model, pf.train, plan, plan.layers_on_rank(0), (0.0, 0.0, 0.0), (held.embedding, held.head))
    # no compute and a second a gather: the wait counts the gathers
    gathers, peak = walk(trace, tuple(1.0 for _ in trace), zero.prefetch_bucket_size, zero.max_live_parameters,
                         zero.max_reuse_distance)
    weights = sum(1 for use in trace if use.params and use.module >= 0) // 3   # a pass's layer weights
    assert gathers == 2 * weights + 3   # the embedding at both ends, the head once for its two uses
    assert peak <= 3 * layer + max(held.embedding, held.head)


# --- what the export says, and bad input ----------------------------------------------------

def test_differences_are_listed_and_the_nearest_plan_is_priced(plan_paths, tmp_path, capsys):
    doc = _export(capsys, plan_paths["llama8b_zb"], "megatron", tmp_path / "a.sh")
    assert doc["plan"]["schedule"] == "1f1b" and doc["plan"]["zero_stage"] == 1
    assert any(d.startswith("schedule zb-h1") for d in doc["differences"])
    assert any(d.startswith("zero 3 under pipeline parallelism") for d in doc["differences"])
    assert doc["estimate"]["fits"] and doc["estimate"]["step_time_s"] != doc["planned"]["step_time_s"]
    cp_plan = tmp_path / "cp.json"
    assert main(["predict", "--model", "llama3-8b", "--cluster", "1x8xH100", "--cp", "2", "--dp", "4", "--zero", "3",
                 "--recompute", "full", "--seq-len", "8192", "--global-batch", "32", "--out", str(cp_plan)]) == 0
    doc = _export(capsys, cp_plan, "deepspeed", tmp_path / "b.json")
    assert doc["plan"]["cp"] == 1 and doc["plan"]["dp"] == 8 and doc["estimate"]["fits"]
    doc = _export(capsys, plan_paths["mixtral"], "torchtitan", tmp_path / "c.toml")
    assert any("register a train spec" in d for d in doc["differences"])
    # as a person reads it: the file on stdout, the summary on stderr
    assert main(["export", str(plan_paths["llama70b"]), "--to", "megatron"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("#!/usr/bin/env bash") and "megatron says the plan as it is" in err


def test_search_exports_its_best_plan(tmp_path, capsys):
    out = tmp_path / "job.toml"
    assert main(["search", "--model", "llama3-8b", "--cluster", "1x8xH100", "--export", "torchtitan",
                 "--export-out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out and out.read_text().startswith("# torchtitan job")


@pytest.mark.parametrize("target,launch", [
    ("megatron", "torchrun --nnodes 32 --nproc-per-node 4"), ("torchtitan", "torchrun --nnodes 32 --nproc-per-node 4"),
    ("deepspeed", "deepspeed --num_nodes 32 --num_gpus 4")])
def test_an_nvlink_domain_node_is_launched_host_by_host(tmp_path, capsys, target, launch):
    """A GB200 node is a rack's NVLink domain; its 4-GPU trays are the hosts a launcher starts ranks
    on. A node that is not whole trays is refused in one line."""
    out = tmp_path / "job"
    assert main(["search", "--model", "llama3-8b", "--cluster", "2x64xGB200", "--top", "1", "--export", target,
                 "--export-out", str(out)]) == 0
    assert launch in capsys.readouterr().out + out.read_text()
    assert main(["search", "--model", "llama3-8b", "--cluster", "1x6xGB200", "--top", "1", "--export", target]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("GB200's hosts hold 4 devices each: nodes of 6 are not whole hosts, so no launcher can "
                            "start them (nodes of a multiple of 4)")


@pytest.mark.parametrize("flags,said", [
    (["--model", "llama3-8b", "--attention", "eager", "--tp", "2"], "--attention-backend unfused"),   # scores materialised
    (["--model", "qwen1.5-moe-a2.7b", "--ep", "4"], "--moe-shared-expert-gate"),   # Qwen2-MoE's gated shared expert
])
def test_megatron_says_what_the_plan_was_priced_with(tmp_path, capsys, flags, said):
    plan, out = tmp_path / "plan.json", tmp_path / "run.sh"
    assert main(["predict", *flags, "--cluster", "1x8xH100", "--seq-len", "2048", "--global-batch", "64",
                 "--framework", "megatron", "--out", str(plan)]) == 0
    assert main(["export", str(plan), "--to", "megatron", "--out", str(out)]) == 0
    assert said in out.read_text()


@pytest.mark.parametrize("argv,message", [
    (["--to", "nccl"], "invalid choice: 'nccl'"),
    (["--to", "torchtitan", "--gpt"], "torchtitan cannot run this plan: it has no model of the gpt kind"),
])
def test_bad_exports_are_one_line_and_exit_2(tmp_path, capsys, argv, message):
    plan = tmp_path / "p.json"
    gpt = "--gpt" in argv
    assert main(["predict", "--model", "gpt3" if gpt else "llama3-8b", "--cluster", "16x8xA100" if gpt else "1x8xH100",
                 "--tp", "8", "--pp", "8" if gpt else "1", "--out", str(plan), "--json"]) == 0
    capsys.readouterr()
    assert main(["export", str(plan), *[a for a in argv if a != "--gpt"]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_a_used_output_and_an_invalid_plan_are_refused(tmp_path, capsys):
    out = tmp_path / "run.sh"
    out.write_text("mine")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["export", str(bad), "--to", "megatron"]) == 2
    assert main(["export", str(bad), "--to", "megatron", "--out", str(out)]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and "exists; pass --overwrite" in errors[1]
    assert out.read_text() == "mine"


def test_a_model_the_target_cannot_build_is_refused(tmp_path, capsys):
    """GPT-NeoX's parallel residual has no Megatron-LM equivalent: one line, exit 2, not a file
    that would train another model."""
    config = tmp_path / "neox" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 512, "num_attention_heads": 8,
                                  "num_hidden_layers": 4, "intermediate_size": 2048, "vocab_size": 50304,
                                  "rotary_pct": 0.25, "use_parallel_residual": True}))
    plan = tmp_path / "p.json"
    assert main(["predict", "--model", str(config), "--cluster", "1x8xH100", "--tp", "2", "--seq-len", "2048",
                 "--global-batch", "32", "--out", str(plan), "--json"]) == 0
    capsys.readouterr()
    assert main(["export", str(plan), "--to", "megatron", "--out", str(tmp_path / "run.sh")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no attention and MLP in parallel" in err
    assert not (tmp_path / "run.sh").exists()


@pytest.mark.parametrize("target", ["torchtitan", "megatron", "deepspeed"])
def test_activations_on_the_host_are_said_and_kept_on_the_device(plan_paths, tmp_path, capsys, target):
    doc = _export(capsys, plan_paths["llama8b_act_offload"], target, tmp_path / "out")
    assert not doc["plan"]["offload_activations"]
    assert any(d.startswith("activations on the host: not an option") for d in doc["differences"])


# --- DeepSeek's mechanisms ------------------------------------------------------------------

def test_a_deepseek_plan_exports_its_mechanisms_to_megatron(tmp_path, capsys):
    """Latent attention, the dense first layer, sigmoid routing with a bias over expert groups
    and the routed scaling reach Megatron-LM's command line, read by Megatron-Core's own
    MLATransformerConfig; torchtitan's llama3 job would describe another model and is refused."""
    pytest.importorskip("megatron.core", reason="megatron-core (test extra) is not installed")
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    plan = tmp_path / "v2lite.json"
    assert main(["predict", "--model", "deepseek-v2-lite", "--cluster", "2x8xH100", "--pp", "2", "--ep", "8",
                 "--zero", "1", "--recompute", "full", "--seq-len", "4096", "--global-batch", "64",
                 "--framework", "megatron", "--out", str(plan), "--json"]) == 0
    out = tmp_path / "run.sh"
    _export(capsys, plan, "megatron", out)
    args = _megatron_args(out.read_text())
    pf = PlanFile.load(plan)
    m = pf.model
    fields = {"multi_latent_attention": True, "kv_lora_rank": int(args["--kv-lora-rank"]),
              "qk_head_dim": int(args["--qk-head-dim"]), "qk_pos_emb_head_dim": int(args["--qk-pos-emb-head-dim"]),
              "v_head_dim": int(args["--v-head-dim"]),
              "moe_layer_freq": eval(args["--moe-layer-freq"], {"__builtins__": {}}),   # Megatron-LM's moe_freq_type
              "num_moe_experts": int(args["--num-experts"]), "moe_router_topk": int(args["--moe-router-topk"]),
              "moe_ffn_hidden_size": int(args["--moe-ffn-hidden-size"]),
              "moe_shared_expert_intermediate_size": int(args["--moe-shared-expert-intermediate-size"]),
              # its YaRN, which Megatron-LM's own defaults (factor 1, mscale_all_dim 0) would undo
              "rotary_scaling_factor": float(args["--rotary-scaling-factor"]), "mscale": float(args["--mscale"]),
              "mscale_all_dim": float(args["--mscale-all-dim"]), "qk_layernorm": "--qk-layernorm" in args}
    assert "--q-lora-rank" not in args   # V2-Lite projects Q from the input
    # the latents' RMSNorms (kv_a_layernorm; V3 also q_a_layernorm): Megatron-Core builds them
    # only under --qk-layernorm (gpt_layer_specs), and the cost model prices them
    assert "--qk-layernorm" in args
    config = MLATransformerConfig(num_layers=int(args["--num-layers"]), hidden_size=int(args["--hidden-size"]),
                                  num_attention_heads=int(args["--num-attention-heads"]),
                                  ffn_hidden_size=int(args["--ffn-hidden-size"]), **fields)
    assert (config.kv_lora_rank, config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == \
        (m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim)
    assert config.moe_layer_freq == [0] * m.first_k_dense + [1] * (m.num_layers - m.first_k_dense)
    assert config.num_moe_experts == m.num_experts and config.moe_ffn_hidden_size == m.moe_ffn_hidden_size
    assert (config.rope_type, config.rotary_scaling_factor, config.mscale, config.mscale_all_dim) == \
        ("yarn", 40.0, 0.707, 0.707)   # DeepSeek-V2-Lite's config.json
    v3 = tmp_path / "v3.json"
    assert main(["predict", "--model", "deepseek-v3", "--cluster", "256x8xH100", "--pp", "16", "--ep", "64",
                 "--zero", "1", "--seq-len", "4096", "--global-batch", "15360", "--framework", "megatron",
                 "--recompute", "full", "--out", str(v3), "--json"]) == 0
    _export(capsys, v3, "megatron", tmp_path / "v3.sh")
    v3_args = _megatron_args((tmp_path / "v3.sh").read_text())
    assert (v3_args["--q-lora-rank"], v3_args["--moe-router-score-function"], v3_args["--moe-router-num-groups"],
            v3_args["--moe-router-group-topk"], v3_args["--moe-router-topk-scaling-factor"],
            v3_args["--mtp-num-layers"]) == ("1536", "sigmoid", "8", "4", "2.5", "1")
    assert "--moe-router-enable-expert-bias" in v3_args and "--qk-layernorm" in v3_args
    # 61 layers over 16 stages, the dense first three on the first: Megatron-Core's explicit layout,
    # the multi-token-prediction module after the last stage's layers
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    layout = PipelineParallelLayerLayout(v3_args["--pipeline-model-parallel-layout"], 16)
    layout.validate_layer_layout(num_layers=61, mtp_num_layers=1)
    assert tuple(len([t for t in stage if t.name == "decoder"]) for (stage,) in layout.layout) == \
        PlanFile.load(v3).plan.layers_per_stage
    # both were priced with a dispatcher that sends a token once to each node and rank holding its
    # experts (costmodel.moe_dispatch): Megatron-Core's flex dispatcher over DeepEP, for V3 across
    # nodes and for V2-Lite's top-6 of 64 experts inside one (4.5 ranks a token, not 6); the
    # all-to-all dispatcher only where both move the same bytes (needs_per_node_dispatcher)
    assert v3_args["--moe-token-dispatcher-type"] == "flex" and v3_args["--moe-flex-dispatcher-backend"] == "deepep"
    assert "--moe-enable-deepep" not in v3_args   # deprecated in Megatron-Core for the backend flag
    assert args["--moe-token-dispatcher-type"] == "flex" and args["--moe-flex-dispatcher-backend"] == "deepep"
    capsys.readouterr()
    assert main(["export", str(plan), "--to", "torchtitan", "--out", str(tmp_path / "job.toml")]) == 2
    assert "latent attention" in capsys.readouterr().err


def test_recomputed_modules_are_priced_kept_in_the_plan_file_and_exported(tmp_path, capsys):
    """--recompute-modules (Megatron-Core's selective recomputation by module): the plan recomputing
    the latent attention's up-projections and the dense MLP keeps less than the default's, the
    plan file keeps the modules, and Megatron-LM's command line says them, as Megatron-Core's own
    MLATransformerConfig reads them."""
    pytest.importorskip("megatron.core", reason="megatron-core (test extra) is not installed")
    from megatron.core.transformer.transformer_config import MLATransformerConfig
    flags = ["predict", "--model", "deepseek-v2-lite", "--cluster", "2x8xH100", "--pp", "2", "--ep", "8", "--zero", "1",
             "--recompute", "selective", "--seq-len", "4096", "--global-batch", "64", "--framework", "megatron", "--json"]
    plans, peaks = {}, {}
    for name, extra in (("default", []), ("modules", ["--recompute-modules", "mla_up_proj,mlp"])):
        plans[name] = tmp_path / f"{name}.json"
        assert main([*flags, *extra, "--out", str(plans[name])]) == 0
        peaks[name] = max(json.loads(capsys.readouterr().out)["estimate"]["peak_memory_bytes"])
    default, modules = (json.loads(plans[n].read_text()) for n in ("default", "modules"))
    assert modules["cluster"]["recompute_modules"] == ["mla_up_proj", "mlp"] and "recompute_modules" not in default["cluster"]
    assert PlanFile.load(plans["modules"]).cluster.framework.selective_modules == ("mla_up_proj", "mlp")
    assert peaks["modules"] < peaks["default"]
    out = tmp_path / "run.sh"
    doc = _export(capsys, plans["modules"], "megatron", out)
    # priced with the modules it writes, as planned
    assert doc["estimate"]["step_time_s"] == pytest.approx(doc["planned"]["step_time_s"])
    text = out.read_text()
    assert "--recompute-modules mla_up_proj mlp" in text
    words = shlex.split(text.split("--recompute-modules", 1)[1].split("\\", 1)[0])
    config = MLATransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=4, multi_latent_attention=True,
                                  recompute_granularity="selective", recompute_modules=words)
    assert config.recompute_modules == ["mla_up_proj", "mlp"]
    _export(capsys, plans["default"], "megatron", tmp_path / "default.sh")
    assert "--recompute-modules" not in (tmp_path / "default.sh").read_text()
    cluster = dict(modules["cluster"], recompute_modules=["moe"])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(dict(modules, cluster=cluster)))
    assert main(["export", str(bad), "--to", "megatron", "--out", str(tmp_path / "bad.sh")]) == 2
    assert "does not price recomputing 'moe'" in capsys.readouterr().err


def test_an_export_to_another_framework_is_measured_against_the_plan_as_searched(plan_paths, tmp_path, capsys):
    """A plan searched for Megatron exported to DeepSpeed: the loss is told against the plan as it
    was searched (Megatron's traits), not against that plan priced as DeepSpeed would run it,
    which DeepSpeed cannot."""
    from costmodel.estimate import estimate
    pf = PlanFile.load(plan_paths["searched-megatron"])
    doc = _export(capsys, plan_paths["searched-megatron"], "deepspeed", tmp_path / "c.json")
    searched_s = estimate(pf.model, pf.train, pf.cluster, pf.plan).step_time_s
    assert doc["planned"]["step_time_s"] == pytest.approx(searched_s) != doc["estimate"]["step_time_s"]
    assert main(["export", str(plan_paths["searched-megatron"]), "--to", "deepspeed", "--out",
                 str(tmp_path / "d.json")]) == 0
    assert "the plan as priced for megatron" in capsys.readouterr().out


def test_a_model_with_attention_biases_is_named_a_model_torchtitan_must_register(tmp_path):
    """Qwen2's biases on Q, K and V are not in torchtitan's llama3 model: the export says the train
    spec to register, with them, rather than a flavour that would drop them."""
    from costmodel.hardware import parse_cluster
    from costmodel.hf_config import model_from_hf_config
    from costmodel.specs import TrainSpec
    from planner.exports import torchtitan
    from planner.space import Choice, build_plan
    config = {"model_type": "qwen2", "hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
              "num_key_value_heads": 16, "num_hidden_layers": 8, "vocab_size": 32000, "hidden_act": "silu",
              "tie_word_embeddings": False}
    (tmp_path / "qwen2-mini.json").write_text(json.dumps(config))
    model, train = model_from_hf_config(tmp_path / "qwen2-mini.json"), TrainSpec(seq_len=1024, global_batch_size=8)
    cluster = parse_cluster("1x8xH100")
    plan = build_plan(model, train, cluster, Choice(zero_stage=2))
    differences = torchtitan.nearest(PlanFile(plan=plan, model=model, train=train, cluster=cluster)).differences
    assert any("register a train spec named 'qwen2-mini'" in d and "biases on the Q, K and V" in d
               for d in differences), differences


@pytest.mark.parametrize("dtype, grad, zero", [("fp16", "fp32", 1), ("fp16", "fp16", 0), ("bf16", "fp32", 1),
                                               ("bf16", "bf16", 0), ("bf16", "fp16", 1)])
def test_deepspeed_without_zero_keeps_gradients_only_in_dtypes_its_engine_takes(tmp_path, capsys, dtype, grad, zero):
    """DeepSpeed's engine (_do_optimizer_sanity_check) runs without ZeRO only gradients in the
    model's dtype (0.19 raises NotImplementedError for bf16's in fp32, which older versions took):
    any other pair is exported at ZeRO-1, which adds them in the stated dtype
    (data_types.grad_accum_dtype)."""
    plan_path = tmp_path / "p.json"
    assert main(["predict", "--model", "debug-tiny", "--cluster", "1x2xA100", "--dtype", dtype, "--grad-dtype", grad,
                 "--zero", "0", "--out", str(plan_path), "--json"]) == 0
    doc = _export(capsys, plan_path, "deepspeed", tmp_path / "ds.json")
    config = json.loads((tmp_path / "ds.json").read_text())
    assert doc["plan"]["zero_stage"] == config["zero_optimization"]["stage"] == zero
    assert config["data_types"] == {"grad_accum_dtype": grad}


@pytest.mark.parametrize("offload", [False, True])
def test_float8_weights_are_gathered_in_float8_only_with_the_optimizer_on_the_device(tmp_path, offload):
    """Megatron-LM takes --fp8-param-gather with an offloaded optimizer under the delayed recipe
    only (megatron/training/arguments.py), and the export writes the tensorwise one: an offloaded
    float8 plan is exported without it and priced so, keeping Transformer Engine's cached float8
    weights beside its 16-bit ones (costmodel.frameworks.float8_params)."""
    from costmodel.frameworks import float8_params
    from costmodel.memory import float8_weight_cache_bytes
    from planner.exports.megatron import arguments
    path = tmp_path / "plan.json"
    flags = ["--offload-optimizer"] if offload else []
    assert main(["predict", "--model", "llama3-8b", "--cluster", "1x8xH100", "--tp", "2", "--zero", "1", *flags,
                 "--dtype", "fp8", "--seq-len", "4096", "--global-batch", "64", "--framework", "megatron",
                 "--out", str(path), "--json"]) == 0
    pf = PlanFile.load(path)
    names = [name for name, _ in arguments(pf, pf.plan)]
    traits = pf.cluster.framework
    assert ("--fp8-param-gather" in names) == float8_params(pf.plan, traits) == (not offload)
    assert float8_weight_cache_bytes(pf.plan, traits) == (2 if offload else 0)   # Hopper: the copy and its transpose
