import pytest

from costmodel.specs import DType
from planner.measure.runs_table import attention_kernel
from planner.measure.validate import spearman, validate

HEADER = ("id,source,arch,layers,hidden,ffn_hidden,heads,kv_heads,vocab,seq_len,gpu,num_gpus,"
          "gpus_per_node,tp,pp,dp,vpp,sp,cp,zero_stage,recompute,micro_batch,global_batch,"
          "precision,metric_name,metric_value")


def test_spearman():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486833, rel=1e-6)


def test_attention_kernel_by_publication():
    assert attention_kernel({"source": "Narayanan et al. (arXiv 2104.04473)"}) == "eager"
    assert attention_kernel({"source": "Korthikanti et al. (arXiv 2205.05198)"}) == "eager"
    # published after FlashAttention (2205.14135) but trained before the frameworks had it (2301)
    assert attention_kernel({"source": "a 2022 run (arXiv 2211.01234)"}) == "eager"
    assert attention_kernel({"source": "Touvron et al. (arXiv 2302.13971)"}) == "flash"
    assert attention_kernel({"source": "Megatron-LM README"}) == "flash"
    assert attention_kernel({"source": "x", "attention": "eager"}) == "eager"


def test_a_run_from_before_selective_recomputation_and_sp_is_filled_without_them():
    """Selective recomputation and sequence parallelism came with Korthikanti et al. (arXiv
    2205.05198): a run a 2021 paper describes, its recompute and sp unstated, is filled with
    full recomputation or none and no SP (the planner's best choice today is selective with SP,
    priced about a quarter faster); the same row from a 2023 paper keeps every mode."""
    from planner.measure.validate import validate_row
    row = dict(id="x", source="a 2021 run (arXiv 2112.01234)", framework="megatron-lm", arch="gpt", layers="96",
               hidden="12288", ffn_hidden="", heads="96", kv_heads="", vocab="51200", seq_len="2048",
               gpu="A100-SXM4-80GB", num_gpus="512", gpus_per_node="8", tp="8", pp="8", dp="8", vpp="", sp="",
               cp="1", zero_stage="0", recompute="", micro_batch="1", global_batch="512", precision="fp16",
               metric_name="iteration_time_s", metric_value="10")
    old, new = validate_row(row), validate_row({**row, "source": "a 2023 run (arXiv 2305.01234)"})
    assert old.filled["recompute"] in ("none", "full") and old.filled["sp"] is False and old.fits
    assert new.filled["sp"] is True


def test_an_unstated_vpp_under_deepspeed_s_pipeline_engine_is_filled_with_its_1f1b():
    """DeepSpeed's PipelineEngine runs one 1F1B schedule, one stage per rank
    (planner.exports.deepspeed): a Megatron-DeepSpeed or DeepSpeed row that leaves vpp empty is
    filled with 1F1B, where a Megatron-LM row of the same layout fills interleaving (a GPT-3 175B
    layout, TP 8 x PP 8 on 512 A100s: Megatron-DeepSpeed's was filled V = 2 and priced 2.4 % fast)."""
    from planner.measure.validate import validate_row
    row = dict(id="x", source="x", framework="megatron-lm", arch="gpt", layers="96", hidden="12288", ffn_hidden="",
               heads="96", kv_heads="", vocab="51200", seq_len="2048", gpu="A100-SXM4-80GB", num_gpus="512",
               gpus_per_node="8", tp="8", pp="8", dp="8", vpp="", sp="no", cp="1", zero_stage="1", recompute="full",
               micro_batch="1", global_batch="512", precision="bf16", metric_name="iteration_time_s", metric_value="60")
    assert validate_row(row).filled["vpp"] > 1
    for framework in ("megatron-deepspeed", "deepspeed"):
        res = validate_row({**row, "framework": framework})
        assert res.filled["vpp"] == 1 and str(res.plan.schedule) == "1f1b"


def test_a_framework_without_megatron_s_modes_is_filled_without_them():
    """DeepSpeed's AutoTP has no sequence parallelism and its engine checkpoints whole layers
    (planner.exports.deepspeed); so do PyTorch FSDP's checkpoint wrappers: a `deepspeed` row that
    leaves recompute and sp empty is filled without SP or selective recomputation, where a
    Megatron-LM row of the same layout fills SP."""
    from planner.measure.validate import validate_row
    row = dict(id="x", source="x", framework="megatron-lm", arch="llama", layers="80", hidden="8192",
               ffn_hidden="28672", heads="64", kv_heads="8", vocab="32000", seq_len="4096", gpu="A100-SXM4-80GB",
               num_gpus="64", gpus_per_node="8", tp="8", pp="1", dp="8", vpp="", sp="", cp="1", zero_stage="1",
               recompute="", micro_batch="1", global_batch="256", precision="bf16", metric_name="iteration_time_s",
               metric_value="60")
    assert validate_row(row).filled["sp"] is True
    for framework in ("deepspeed", "pytorch-fsdp"):
        filled = validate_row({**row, "framework": framework}).filled
        assert filled["sp"] is False and filled["recompute"] != "selective"


def test_an_unknown_framework_s_layers_are_split_as_the_planner_would_split_them():
    """The reference format has no column for a pipeline's split: a framework the model does not
    know is split as the planner splits it where the even split overflows. Llama 3.1 405B without
    recomputation, TP 8 x PP 16 over 8,192 H100s (32 micro-batches a step): evenly split it fits
    only under ZeRO-2, whose per-micro-batch reduce-scatters cost a quarter of the step; with the
    first stages a layer lighter it fits under ZeRO-1, which is filled."""
    from planner.measure.validate import validate_row
    row = dict(id="x", source="x", framework="some-trainer", arch="llama", layers="126", hidden="16384",
               ffn_hidden="53248", heads="128", kv_heads="8", vocab="128256", seq_len="8192", gpu="H100-SXM5-80GB",
               num_gpus="8192", gpus_per_node="8", tp="8", pp="16", dp="64", vpp="", sp="", cp="1", zero_stage="",
               recompute="none", micro_batch="1", global_batch="2048", precision="bf16",
               metric_name="iteration_time_s", metric_value="20")
    free = validate_row(row)
    assert free.fits and free.filled["zero_stage"] == 1
    assert len(set(free.plan.layers_per_stage[1:-1])) > 1   # not the even split
    assert free.filled["layers_per_stage"] == free.plan.layers_per_stage   # and said
    zero2 = validate_row({**row, "zero_stage": "2"})
    assert zero2.fits and free.predicted < 0.9 * zero2.predicted


def test_torchtitan_s_tensor_parallelism_is_filled_with_sp_as_it_always_runs():
    """torchtitan's TP shards the norms' sequence whatever else it does (planner.exports.torchtitan):
    an empty sp of a torchtitan row at TP > 1 is filled yes, even where no SP would price faster."""
    from costmodel.registry import MODELS
    from planner.measure.fill import _options
    row = {"id": "x", "framework": "torchtitan", "sp": "", "recompute": "full", "micro_batch": "1", "vpp": "",
           "zero_stage": "3"}
    opts, fillable = _options(row, MODELS["llama3-70b"], tp=8, pp=1, dp=8, global_batch=64)
    assert opts["sp"] == [True] and "sp" in fillable
    assert _options({**row, "framework": "megatron-core"}, MODELS["llama3-70b"], 8, 1, 8, 64)[0]["sp"] == [False, True]


def test_oom_rows_and_filled_cells(tmp_path):
    """A 70B GPT on 8 GPUs, no sharding: predicted not to fit, so the OOM row is right; the empty
    micro_batch and recompute cells are filled and reported as the planner's choice."""
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + "\n"
                    "oom,x,gpt,80,8192,,64,64,51200,2048,A100-SXM4-80GB,8,8,1,1,8,,,1,0,none,1,8,bf16,status,OOM\n"
                    "ok,x,gpt,24,2048,,16,16,51200,2048,A100-SXM4-80GB,8,8,1,1,8,,,1,1,,,64,bf16,iteration_time_s,1.0\n")
    results, summary = validate(path)
    oom, ok = results
    assert oom.predicted == "OOM" and not oom.fits and oom.error_pct is None
    assert set(ok.filled) == {"micro_batch", "recompute", "vpp", "sp"}
    assert summary["num_status_rows"] == 1 and summary["num_status_correct"] == 1
    assert summary["n"] == 1


def test_a_row_saying_interleaved_without_v_searches_v(tmp_path):
    """vpp = interleaved: the source ran interleaved 1F1B and did not say V; validate fills V >= 2
    (never the plain 1F1B an empty cell may fill) and reports it as filled."""
    path = tmp_path / "runs.csv"
    row = "il,x,gpt,24,2048,,16,16,51200,2048,A100-SXM4-80GB,8,8,1,2,4,VPP,,1,1,none,1,64,bf16,iteration_time_s,1.0\n"
    path.write_text(HEADER + "\n" + row.replace("VPP", "interleaved") + row.replace("il,", "one,").replace("VPP", "1"))
    (interleaved, plain), _ = validate(path)
    assert interleaved.filled["vpp"] >= 2 and interleaved.plan.vpp == interleaved.filled["vpp"]
    assert str(interleaved.plan.schedule) == "interleaved-1f1b"
    assert "vpp" not in plain.filled and plain.plan.vpp == 1


def test_the_table_says_by_how_much_a_run_does_not_fit(tmp_path):
    """A run priced as not fitting shows its tightest stage's peak against what the device leaves."""
    from reports.tables import validate_table
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + "\n"
                    "oom,x,gpt,80,8192,,64,64,51200,2048,A100-SXM4-80GB,8,8,1,1,8,,,1,0,none,1,8,bf16,status,OOM\n")
    results, summary = validate(path)
    peak, cap = (results[0].estimate.peak_memory_bytes[0] / 2**30, results[0].estimate.capacity_per_rank_bytes[0] / 2**30)
    assert peak > cap
    assert f"no: {peak:.1f} of {cap:.1f} GiB" in validate_table(results, summary)


def test_an_unstated_zero_stage_is_filled_with_one_the_framework_runs(tmp_path):
    """A 76-layer GPT on 32 A100-40GB at TP 8, PP 2 fits only with gradients sharded (ZeRO-2/3).
    A framework the table does not know may have run that; Megatron-Core pipelines run ZeRO-0/1
    alone (its distributed optimizer: planner.exports.megatron), so its row keeps ZeRO-1 and is
    priced as not fitting rather than filled with a stage Megatron cannot run."""
    row = "z,x,gpt,76,8192,,64,64,51200,2048,A100-SXM4-40GB,32,8,8,2,2,1,yes,1,,full,1,64,bf16,iteration_time_s,1.0,FW\n"
    filled = {}
    for framework in ("other", "megatron-core", "megatron-deepspeed"):
        path = tmp_path / f"{framework}.csv"
        path.write_text(HEADER + ",framework\n" + row.replace("FW", framework))
        (result,), _ = validate(path)
        filled[framework] = (result.filled["zero_stage"], result.fits)
    assert filled["other"][0] >= 2 and filled["other"][1]
    assert filled["megatron-core"] == filled["megatron-deepspeed"] == (1, False)


def test_an_unstated_zero_stage_of_a_pytorch_fsdp_run_is_one_of_fsdp_s_strategies(tmp_path):
    """PyTorch FSDP shards everything, gradients and states, or nothing (FULL_SHARD,
    SHARD_GRAD_OP, NO_SHARD): a `pytorch-fsdp`, `fms-fsdp` or `composer-fsdp` row that leaves its
    stage empty is filled with 0, 2 or 3, never ZeRO-1, as torchtitan's FSDP2."""
    from planner.measure.fill import _framework_zero_stages
    for framework in ("pytorch-fsdp", "fms-fsdp", "composer-fsdp", "torchtitan"):
        assert _framework_zero_stages({"framework": framework}, pp=1) == frozenset({0, 2, 3})
    assert 1 in _framework_zero_stages({"framework": "megatron-core"}, pp=1)


def test_an_unstated_zero_stage_of_torchtitan_beside_tensor_parallelism_is_fsdp(tmp_path):
    """torchtitan runs DDP (ZeRO-0) on a one-dimensional mesh only: a torchtitan row at TP 2 that
    leaves its stage empty is filled with FSDP2 (ZeRO-2 here), though ZeRO-0 would price faster
    (32 micro-batches a replica: one gradient reduction a step against one a micro-batch) and
    fills the same row at TP 1 and PyTorch FSDP's at TP 2 (NO_SHARD beside TP is not bound so)."""
    row = ("t,x,llama,16,2048,5632,16,16,32000,2048,H100-SXM5-80GB,8,8,TP,1,DP,,,1,,none,1,128,bf16,"
           "iteration_time_s,1.0,FW\n")
    filled = {}
    for framework, tp in (("torchtitan", 2), ("torchtitan", 1), ("pytorch-fsdp", 2)):
        path = tmp_path / f"{framework}{tp}.csv"
        path.write_text(HEADER + ",framework\n" + row.replace("FW", framework).replace(",TP,", f",{tp},")
                        .replace(",DP,", f",{8 // tp},"))
        (result,), _ = validate(path)
        filled[framework, tp] = result.filled["zero_stage"]
    assert filled == {("torchtitan", 2): 2, ("torchtitan", 1): 0, ("pytorch-fsdp", 2): 0}


GOOD = "ok,x,gpt,24,2048,,16,16,51200,2048,A100-SXM4-80GB,8,8,1,1,8,,,1,1,,,64,bf16,iteration_time_s,1.0\n"


@pytest.mark.parametrize("text,message", [
    (HEADER + "\n", "no runs"),
    ("id,source\nx,y\n", "missing columns"),
    (HEADER + "\n" + GOOD.replace(",8,8,1,1,8,", ",8,8,x,1,8,"), "tp = 'x' is not an integer"),
    (HEADER + "\n" + GOOD.replace("iteration_time_s,1.0", "status,OOM").replace(",8,8,1,1,8,", ",8,8,,,8,"),
     "empty tp, pp"),
    (HEADER + "\n" + GOOD.replace(",1.0\n", ",-5\n"), "'-5' is out of range for iteration_time_s"),
    (HEADER + "\n" + GOOD.replace(",1.0\n", ",1e308\n"), "'1e308' is out of range for iteration_time_s"),   # -inf %
    (HEADER + "\n" + GOOD.replace(",1.0\n", ",1e-300\n"), "'1e-300' is out of range"),   # +3.7e301 %
    (HEADER + "\n" + GOOD.replace(",1.0\n", ",fast\n"), "is not a number"),
    (HEADER + "\n" + GOOD + GOOD, "duplicate id 'ok'"),
    (HEADER + "\n" + GOOD.replace("ok,", '"o\nk",', 1), "id holds a control character"),   # split the table's row
    (HEADER + ",expert_imbalance\n" + GOOD.replace("\n", ",even\n"), "expert_imbalance = 'even' is not a number"),
    (HEADER + ",expert_imbalance\n" + GOOD.replace("\n", ",0.5\n"), "expert_imbalance = 0.5 is out of range"),
    (HEADER + ",node_network_gbps\n" + GOOD.replace("\n", ",0\n"), "node_network_gbps = 0 is out of range"),
    (HEADER + ",node_network_gbps\n" + GOOD.replace("\n", ",nan\n"), "node_network_gbps = nan is not a finite"),
    (HEADER + ",node_network_gbps\n" + GOOD.replace("\n", ",fast\n"), "node_network_gbps = 'fast' is not a number"),
    (HEADER + "\n" + GOOD.replace(",8,,,1,1,", ",8,interleaved,,1,1,"), "vpp = interleaved but 24 layers over pp = 1"),
    (HEADER + "\n" + GOOD.replace(",8,,,1,1,", ",8,2v,,1,1,"), "vpp = '2v' is not an integer"),
    (HEADER + ",compiled\n" + GOOD.replace("\n", ",maybe\n"), "compiled = 'maybe' is not yes or no"),
    (HEADER + ",offload_optimizer\n" + GOOD.replace("\n", ",cpu\n"), "offload_optimizer = 'cpu' is not yes or no"),
    (HEADER + ",zero3_max_live\n" + GOOD.replace("\n", ",1e9\n"),
     "row 'ok': zero3_max_live is DeepSpeed's ZeRO-3 setting; framework 'generic' has none"),
    (HEADER + ",offload_activations\n" + GOOD.replace(",1,1,,,64,", ",1,1,full,,64,").replace("\n", ",yes\n"),
     "offload_activations with recomputation: they are alternatives"),
    (HEADER + ",async_tp\n" + GOOD.replace("\n", ",yes\n"), "async_tp = yes on A100-SXM4-80GB, whose profile runs no TP"),
    (HEADER + ",compiled,async_tp\n" + GOOD.replace("A100-SXM4-80GB", "H100").replace("\n", ",no,yes\n"),
     "async_tp = yes needs compiled = yes"),
    (HEADER + "\n" + GOOD.replace(",bf16,", ",fp4,"), "precision = 'fp4' is not one of fp32, bf16, fp16, fp8"),
    (HEADER + "\n" + GOOD.replace(",1,1,,,64,", ",1,1,sometimes,,64,"),
     "recompute = 'sometimes' is not one of none, selective, full"),
    (HEADER + "\n" + GOOD.replace(",8,,,1,1,", ",8,,maybe,1,1,"), "sp = 'maybe' is not yes or no"),
    (HEADER + "\n" + GOOD.replace(",16,16,51200,", ",7,7,51200,"), "row 'ok': hidden 2048 is not a multiple of heads 7"),
    (HEADER + "\n" + GOOD.replace(",1,1,,,64,", ",1,1,,4,6,"),
     "row 'ok': global_batch 6 does not split over dp = 8 data-parallel replicas"),
    (HEADER + "\n" + GOOD.replace(",1,1,,,64,", ",1,1,,,7,"),   # micro-batch unstated: none to fill it with
     "row 'ok': global_batch 7 does not split over dp = 8 data-parallel replicas"),
    (HEADER + ",attention\n" + GOOD.replace("\n", ",sdpa\n"), "row 'ok': attention = 'sdpa' is not one of"),
    (HEADER + ",expert_imbalance\n" + GOOD.replace("\n", ",nan\n"), "expert_imbalance = nan is not a finite"),
    (HEADER + ",dispatcher\n" + GOOD.replace("\n", ",nccl\n"),
     "row 'ok': dispatcher = 'nccl' is not one of alltoall, deepep, hybridep"),
    (HEADER + ",memory_gb\n" + GOOD.replace("\n", ",abc\n"), "line 2: row 'ok': memory_gb = 'abc' is not a number"),
    (HEADER + ",tp\n" + GOOD.replace("\n", ",2\n"), "runs.csv: column 'tp' appears more than once in the header"),
    (HEADER + "\n" + GOOD.replace("\n", ",x,y\n"), "runs.csv line 2: 28 cells, the header names 26"),
    # a quote left open runs the row into the next line: the row's lines are named, and why
    (HEADER + "\n" + GOOD.replace(",gpt,", ',"gpt,', 1) + GOOD.replace("ok", "next", 1),
     "runs.csv lines 2-3 (one row: a quoted cell runs over 2 lines; an unclosed quote?)"),
    # a table cut short: inside a quoted cell, or in its last row's cells before the line ends
    (HEADER + "\n" + GOOD.replace(",gpt,", ',"gpt,', 1).rstrip("\n"),
     "runs.csv line 2: the file ends inside a quoted cell (truncated? an unclosed quote?)"),
    (HEADER + "\n" + GOOD[:GOOD.index(",bf16,")],
     "runs.csv line 2: the last row holds 23 of the header's 26 cells and the file ends without a line break"),
    (HEADER + "\n" + GOOD + "   ", "runs.csv line 3 (row '   '): empty id, arch"),   # spaces, not a row cut short
    (HEADER + ",num_experts\n" + GOOD.replace("\n", ",8\n"),
     "row 'ok': num_experts describe a mixture of experts, which only llama rows have"),
    (HEADER + ",experts_per_token\n" + GOOD.replace(",gpt,", ",llama,").replace("\n", ",2\n"),
     "row 'ok': experts_per_token without num_experts"),
    (HEADER + "\n" + GOOD.replace("A100-SXM4-80GB", "FooGPU"), "row 'ok': gpu: unknown device 'FooGPU'"),
    (HEADER + ",layers_per_stage\n" + GOOD.replace("\n", ",12;12\n"),
     "row 'ok': layers_per_stage = '12;12' is not comma-separated integers"),
    (HEADER + ",layers_per_stage\n" + GOOD.replace("\n", ',"12,11"\n'),
     "row 'ok': layers_per_stage = '12,11' must be counts of at least 0 adding up to the model's 24 layers"),
    (HEADER + ",layers_per_stage\n" + GOOD.replace("\n", ',"12,12"\n'),
     "row 'ok': layers_per_stage = '12,12' must give pp x vpp = 1 counts"),
    (HEADER + "\n" + GOOD.replace("A100-SXM4-80GB", "V100"),
     "row 'ok': precision bf16: V100-SXM2-32GB has no bf16 in its profile (fp16 or fp32)"),
])
def test_bad_tables_are_one_line_and_exit_2(tmp_path, capsys, text, message):
    from planner.cli import main
    path = tmp_path / "runs.csv"
    path.write_text(text)
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_unknown_framework_gets_generic_traits(tmp_path):
    from costmodel.frameworks import GENERIC, framework_traits
    assert framework_traits("some-new-trainer") is GENERIC and framework_traits("") is GENERIC
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + ",framework\n" + GOOD.rstrip("\n") + ",some-new-trainer\n")
    results, summary = validate(path)
    assert summary["n"] == 1 and results[0].error_pct is not None


def test_an_unknown_framework_s_float8_rows_under_tp_and_with_experts_are_priced(tmp_path):
    """Generic traits run float8 under tensor parallelism and in a mixture's experts, as
    Transformer Engine and torchao do, so a row of a framework the model does not know that states
    either is priced, not refused (our runtime's own limit is named as the runtime's)."""
    dense = "d,x,llama,32,4096,14336,32,8,128256,8192,H100-SXM5-80GB,64,8,4,2,8,,yes,1,1,none,1,256,fp8,iteration_time_s,4.0"
    moe = "m,x,llama,32,4096,14336,32,8,128256,4096,H100-SXM5-80GB,64,8,2,1,32,,yes,1,1,none,1,256,fp8,iteration_time_s,4.0"
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + ",framework,num_experts,experts_per_token,moe_ffn_hidden,ep\n"
                    + dense + ",some-new-trainer,,,,\n" + moe + ",some-new-trainer,8,2,14336,8\n")
    results, summary = validate(path)
    assert summary["n"] == 2 and all(r.error_pct is not None and r.plan.fp8_linears for r in results)
    assert results[0].plan.tp == 4 and results[1].plan.ep == 8


def test_the_rows_priced_with_generic_traits_are_said(tmp_path):
    """A framework the model does not know (or none stated) is priced with generic traits; the
    summary and the table name it with its row count, so its errors are not read as the
    framework's. Known names are not listed."""
    from reports.tables import validate_table
    path = tmp_path / "runs.csv"
    names = ("some-new-trainer", "some-new-trainer", "", "Megatron-LM")
    rows = [GOOD.replace("ok,", f"r{i},", 1).rstrip("\n") + f",{name}\n" for i, name in enumerate(names)]
    path.write_text(HEADER + ",framework\n" + "".join(rows))
    results, summary = validate(path)
    assert summary["generic_frameworks"] == {"some-new-trainer": 2, "": 1}
    text = validate_table(results, summary)
    assert "priced with generic traits (a framework the model does not know): some-new-trainer (2 rows), " \
           "(unstated) (1 row); known: " in text and "megatron-lm" in text.rsplit("known:", 1)[1]
    assert "benchmarks/fidelity.py" in text.rsplit("known:", 1)[1]   # where what generic traits cost is measured


def test_a_stated_node_network_replaces_the_profiles_between_nodes():
    """node_network_gbps: the node's bandwidth to other nodes as the source states it, shared by
    its GPUs (IBM's 800 Gbit/s a node of 8 H100s: 12.5 GB/s each, not a DGX's 50)."""
    from planner.measure.runs_table import row_specs
    head = HEADER.split(",") + ["node_network_gbps"]
    row = dict(zip(head, GOOD.strip().replace("A100-SXM4-80GB,8,8,1,1,8", "H100-SXM5-80GB,16,8,1,1,16").split(",") + [""]))
    _, _, dgx = row_specs(row)
    _, _, stated = row_specs({**row, "node_network_gbps": "800"})
    assert dgx.device.tier_for(2).bandwidth_bytes_per_s == pytest.approx(50e9)
    assert stated.device.tier_for(2).bandwidth_bytes_per_s == pytest.approx(12.5e9)
    assert stated.device.intra_node == dgx.device.intra_node


def test_a_row_that_kept_its_states_on_the_host_is_priced_so(tmp_path):
    """offload_optimizer = yes: the plan's states and their step on the host (ZeRO-Offload), the
    stated field fixed in the row's search; the same row without it keeps them on the device."""
    path = tmp_path / "runs.csv"
    row = "r,x,gpt,24,2048,,16,16,51200,2048,A100-SXM4-80GB,8,8,1,1,8,,,1,3,full,1,64,bf16,iteration_time_s,1.0"
    path.write_text(HEADER + ",offload_optimizer\n" + row + ",yes\n" + row.replace("r,", "d,", 1) + ",\n")
    (host, device), _ = validate(path)
    assert host.plan.offload_optimizer and not device.plan.offload_optimizer
    assert host.estimate.step_time_s > device.estimate.step_time_s   # the step on the host, its copies
    assert max(host.estimate.peak_memory_bytes) < max(device.estimate.peak_memory_bytes)


def test_a_deepspeed_zero3_row_gathers_as_its_coordinator_was_set(tmp_path):
    """A Megatron-DeepSpeed ZeRO-3 row's gathers walk DeepSpeed's coordinator with the knobs it
    states: a live bound below one weight prefetches only while nothing is live, so the gathers
    wait and few weights are held; a free prefetch hides them and holds more."""
    path = tmp_path / "runs.csv"
    row = ("r,x,megatron-deepspeed,gpt,24,2048,,16,16,51200,2048,A100-SXM4-80GB,16,8,1,1,16,,,1,3,full,1,64,bf16,"
           "iteration_time_s,1.0,")
    path.write_text(HEADER.replace("id,source,", "id,source,framework,") + ",zero3_prefetch_bucket,zero3_max_live\n"
                    + row + "5e7,1\n" + row.replace("r,", "f,", 1) + "1e12,1e12\n" + row.replace("r,", "d,", 1) + ",\n"
                    + row.replace("r,", "n,", 1) + "0,\n")
    (blocked, free, defaults, none), _ = validate(path)
    assert blocked.estimate.step_time_s > defaults.estimate.step_time_s >= free.estimate.step_time_s
    assert max(blocked.estimate.peak_memory_bytes) < max(free.estimate.peak_memory_bytes)
    # a bucket of 0 is DeepSpeed's "no prefetch": every gather on demand (the blocked row still
    # prefetches a weight at a weightless module's hook while nothing is live)
    assert none.estimate.step_time_s > blocked.estimate.step_time_s


def test_a_device_cell_is_stripped_as_every_other_cell(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + "\n" + GOOD.replace(",A100-SXM4-80GB,", ", A100-SXM4-80GB ,"))
    (result,), _ = validate(path)
    assert result.fits


def test_a_column_that_is_not_read_is_said(tmp_path, capsys):
    """A misspelt column leaves its values unread and the plan searched: said on stderr."""
    from planner.cli import main
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + ",micro_bacth\n" + GOOD.replace("\n", ",2\n"))
    assert main(["validate", str(path)]) == 0
    assert "column 'micro_bacth' not read" in capsys.readouterr().err


def test_a_cloud_instance_the_notes_name_sets_the_network_between_nodes(tmp_path):
    """A source that names its instance (AWS's p4d.24xlarge: 400 Gbit/s of EFA a node, 6.25 GB/s
    a GPU) and not its network is priced over that network, and the table says so; a stated
    node_network_gbps wins, and notes naming instances of different networks name none."""
    from planner.measure.runs_table import row_specs
    from reports.tables import validate_table
    head = HEADER.split(",") + ["node_network_gbps", "notes"]
    row = dict(zip(head, GOOD.strip().replace("A100-SXM4-80GB,8,8,1,1,8", "A100-SXM4-40GB,16,8,1,1,16").split(",")
                   + ["", "64 p4d.24xlarge instances"]))
    def per_gpu(r):
        return row_specs(r)[2].device.tier_for(2).bandwidth_bytes_per_s
    assert per_gpu(row) == pytest.approx(6.25e9)
    assert per_gpu({**row, "notes": "P4de nodes"}) == pytest.approx(6.25e9)
    assert per_gpu({**row, "notes": ""}) == pytest.approx(25e9)
    assert per_gpu({**row, "notes": "p4d, later p5.48xlarge"}) == pytest.approx(25e9)
    assert per_gpu({**row, "node_network_gbps": "800"}) == pytest.approx(12.5e9)
    path = tmp_path / "runs.csv"
    path.write_text(",".join(head) + "\n" + ",".join(row[c] for c in head) + "\n")
    results, summary = validate(path)
    assert summary["networks_from_notes"] == {"ok": "p4d.24xlarge: 400 Gbit/s a node"}
    assert "ok (p4d.24xlarge: 400 Gbit/s a node)" in validate_table(results, summary)


def test_an_fp16_run_s_gradients_are_fp16_unless_it_says_otherwise():
    """Megatron-LM turns fp32 gradient accumulation and all-reduce on for bf16 only; an fp16 run
    keeps its gradients in fp16, as DeepSpeed's fp16 optimizer and FSDP's mixed precision do."""
    from planner.measure.runs_table import row_specs
    head = HEADER.split(",") + ["grad_dtype"]
    row = dict(zip(head, GOOD.strip().split(",") + [""]))
    assert row_specs(row)[1].grad_dtype is DType.FP32   # bf16: Megatron's fp32
    assert row_specs({**row, "precision": "fp16"})[1].grad_dtype is DType.FP16
    assert row_specs({**row, "precision": "fp16", "grad_dtype": "fp32"})[1].grad_dtype is DType.FP32
    assert row_specs({**row, "grad_dtype": "bf16"})[1].grad_dtype is DType.BF16


def test_a_gpt_row_without_a_dropout_cell_is_priced_with_its_framework_s_default():
    """llm-foundry's MPT configurations (composer-fsdp) train without dropout; Megatron's GPT with
    0.1. A stated cell wins either way."""
    from planner.measure.runs_table import row_specs
    head = HEADER.split(",") + ["dropout"]
    row = dict(zip(head, GOOD.strip().split(",") + [""]))
    assert row["arch"] == "gpt"
    for framework, default in (("composer-fsdp", False), ("megatron-lm", True), ("other", True)):
        assert row_specs({**row, "framework": framework})[0].dropout is default
        for cell, stated in (("yes", True), ("no", False)):
            assert row_specs({**row, "framework": framework, "dropout": cell})[0].dropout is stated


def test_a_gpt_row_with_fewer_kv_heads_is_priced_with_them(tmp_path):
    """Grouped-query attention on a LayerNorm GPT (Nemotron-4's): the row's kv_heads, not heads."""
    from planner.measure.validate import validate
    rows = [GOOD.replace("ok,", "mha,", 1), GOOD.replace("ok,", "gqa,", 1).replace(",16,16,51200,", ",16,4,51200,")]
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + "\n" + "".join(rows))
    (mha, gqa), _ = validate(path)
    assert gqa.plan is not None and gqa.predicted != mha.predicted


def test_a_stated_memory_is_compared_where_the_row_states_what_sets_it(tmp_path):
    """memory_gb against the predicted allocator reservation; not where the micro-batch was
    searched (the planner's plan, not the run's)."""
    from planner.measure.validate import validate
    stated = GOOD.replace("ok,", "stated,", 1).replace(",1,1,,,64,", ",1,1,none,2,64,").replace("\n", ",20\n")
    searched = GOOD.replace("ok,", "searched,", 1).replace("\n", ",20\n")
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + ",memory_gb\n" + stated + searched)
    (row, other), summary = validate(path)
    from costmodel.hardware import parse_cluster
    reserved = parse_cluster("1x8xA100-SXM4-80GB").allocator_reserved_bytes(max(row.estimate.peak_memory_bytes))
    assert row.memory_error_pct == pytest.approx(100 * (reserved - 20e9) / 20e9)
    assert other.memory_error_pct is None and summary["memory_rows"] == 1


def test_a_row_cut_short_of_its_empty_trailing_cells_reads_them_as_empty(tmp_path):
    """A spreadsheet drops a row's trailing empty cells: those columns are read as unstated."""
    path = tmp_path / "runs.csv"
    path.write_text(HEADER + ",notes,memory_gb\n" + GOOD)
    results, summary = validate(path)
    assert summary["n"] == 1 and results[0].filled and results[0].memory_error_pct is None
    path.write_text(HEADER + "\n" + GOOD.replace("\n", ",\n"))   # and a stray empty cell past the header's
    assert validate(path)[1]["n"] == 1


def test_a_stated_split_is_the_plan_s(tmp_path):
    """layers_per_stage: the split the run's framework made (DeepSpeed's partition_method), priced
    as stated; the stage holding more layers sets the pace."""
    path = tmp_path / "runs.csv"
    row = "r,x,gpt,24,2048,,16,16,51200,2048,A100-SXM4-80GB,8,8,1,2,4,1,,1,1,none,1,64,bf16,iteration_time_s,1.0"
    path.write_text(HEADER + ",layers_per_stage\n" + row + ',"12,12"\n' + row.replace("r,", "u,", 1) + ',"9,15"\n')
    even, uneven = validate(path)[0]
    assert even.plan.layers_per_stage == (12, 12) and uneven.plan.layers_per_stage == (9, 15)
    assert uneven.estimate.step_time_s > even.estimate.step_time_s


def test_a_stated_split_the_framework_cannot_run_is_one_line_also_where_cells_are_searched(tmp_path):
    """The search fills a row's unstated cells and lays its plans out on the stated split, which it
    did not choose: a split its framework cannot run is the row's error, not a price."""
    from costmodel.inputs import UserError
    path = tmp_path / "runs.csv"
    row = "r,x,gpt,24,2048,,16,16,51200,2048,A100-SXM4-80GB,8,8,1,2,4,1,,1,1,,1,64,bf16,iteration_time_s,1.0"
    path.write_text(HEADER + ",layers_per_stage\n" + row + ',"24,0"\n')
    with pytest.raises(UserError, match="row 'r': no valid plan for the stated fields: every pipeline stage needs"):
        validate(path)


def test_a_stated_split_that_overflows_is_priced_as_stated_not_as_the_search_s(tmp_path):
    """A run's stated split (layers_per_stage) is the plan even where it overflows and the
    search's own split would fit: the row is called not fitting, never quietly re-split."""
    path = tmp_path / "runs.csv"
    row = "r,x,gpt,24,3072,,24,24,51200,2048,A100-SXM4-40GB,8,8,1,2,4,1,,1,0,,1,64,bf16,iteration_time_s,1.0"
    path.write_text(HEADER + ",layers_per_stage\n" + row + ',"23,1"\n' + row.replace("r,", "u,", 1) + ',"12,12"\n')
    lopsided, even = validate(path)[0]
    assert lopsided.plan.layers_per_stage == (23, 1) and not lopsided.fits
    assert even.plan.layers_per_stage == (12, 12) and even.fits


def test_a_run_that_fits_the_device_but_not_the_planner_s_budget_is_said(tmp_path):
    """MPT-30B at 8k on eight A100s (kept out of the calibration for it: unmodelled_runs.csv) fits
    the device but not the budget the search plans with (its headroom and the profile's
    fragmentation): flagged in the row, the table and the summary, with the search's own budget;
    its 4k sibling, inside it, is not."""
    import csv

    from costmodel.hardware import parse_cluster
    from planner.measure.runs_table import default_runs_path
    from reports.tables import validate_table
    wanted = ("mpt_30b_a100_80gb_s8192_g8", "mpt_30b_a100_80gb_s4096_g8")
    tables = (default_runs_path().with_name("unmodelled_runs.csv"), default_runs_path())
    rows = [row for table in tables for row in csv.DictReader(table.open()) if row["id"] in wanted]
    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for row in rows for k in row)))
        writer.writeheader()
        writer.writerows(rows)
    (edge, inside), summary = validate(path)
    peak, budget = edge.past_budget
    assert edge.fits and peak == max(edge.estimate.peak_memory_bytes) > budget
    assert budget == pytest.approx(parse_cluster("1x8xA100-SXM4-80GB").memory_budget_bytes)
    assert inside.fits and inside.past_budget is None
    assert summary["past_budget_ids"] == [edge.id] and edge.to_dict()["past_budget"] == [peak, budget]
    shown = f"yes, past budget: {peak / 2**30:.1f} of {budget / 2**30:.1f} GiB"
    assert shown in validate_table((edge, inside), summary)


def test_an_unknown_framework_s_float8_run_is_priced_faster_than_its_bf16_run():
    """Generic traits cast float8 operands with fused kernels, as every framework publishing float8
    runs does (Transformer Engine, compiled torchao): MLPerf's GPT-3 175B layout relabelled to an
    unknown framework gains from float8 what it gains under Megatron-Core (0.72 of its bf16 step
    against 0.68). With eager torchao's casts (six kernels, 33 bytes an element, every weight cast
    each micro-batch) its float8 step was priced 1.8x its bf16 step."""
    import csv

    from planner.measure.runs_table import default_runs_path
    from planner.measure.validate import validate_row
    with open(default_runs_path()) as f:
        row = next(r for r in csv.DictReader(f) if r["id"] == "mlperf31_gpt3_h100_eos_512")
    unknown = {**row, "framework": "some-new-trainer"}

    def float8_gain(r: dict[str, str]) -> float:
        return validate_row(r).estimate.step_time_s / validate_row({**r, "precision": "bf16"}).estimate.step_time_s
    assert float8_gain(unknown) == pytest.approx(float8_gain(row), abs=0.1)
