"""The traits a runs-table row is priced with (planner.measure.row_traits): its framework's, with
the settings the row states that the framework leaves to its user."""
import pytest

from tests.planner.test_validate import HEADER


def test_fms_fsdp_runs_its_layer_op_by_op():
    """IBM's fms-fsdp Llama (eager, no compile) is priced with the eager layer's memory-bound
    kernels (costmodel.frameworks `eager_layer`): slower than the same framework with fused ones."""
    from dataclasses import replace

    from costmodel.estimate import estimate
    from costmodel.frameworks import framework_traits
    from costmodel.hardware import parse_cluster
    from costmodel.registry import resolve_model
    from costmodel.specs import TrainSpec
    from planner.space import Choice, build_plan
    fms = framework_traits("fms-fsdp")
    assert fms.eager_layer and fms.fsdp_master_params and not framework_traits("other").eager_layer
    model, train = resolve_model("llama2-7b"), TrainSpec(seq_len=4096, global_batch_size=16)
    step_s = []
    for traits in (fms, replace(fms, eager_layer=False)):
        cluster = replace(parse_cluster("1x8xA100"), framework=traits)
        step_s.append(estimate(model, train, cluster, build_plan(model, train, cluster, Choice(zero_stage=3))).step_time_s)
    assert step_s[0] > 1.02 * step_s[1]


def test_the_deepspeed_frameworks_run_their_layers_op_by_op():
    """Megatron-DeepSpeed keeps apex's fused norms but runs SwiGLU and RoPE as torch ops; a
    Hugging Face model under DeepSpeed runs its RMSNorm op by op too (costmodel.frameworks): FlagPerf's
    Megatron-DeepSpeed and DeepSpeed runs, priced with fused layers, were 15-22 % too fast."""
    from dataclasses import replace

    from costmodel.estimate import estimate
    from costmodel.frameworks import composite_rms_norm, framework_traits
    from planner.measure.runs_table import default_runs_path, read_runs, row_specs
    from planner.measure.validate import validate_row
    mds, ds = framework_traits("megatron-deepspeed"), framework_traits("deepspeed")
    assert mds.eager_layer and not composite_rms_norm(mds)
    assert ds.eager_layer and composite_rms_norm(ds)
    row = next(r for r in read_runs(default_runs_path()) if r["id"] == "flagperf_chatglm3_6b_ds_h100_g8")
    result = validate_row(row)
    model, train, cluster = row_specs(row)
    fused = replace(cluster, framework=replace(cluster.framework, eager_layer=False, eager_rms_norm_composite=False))
    assert result.estimate.step_time_s > 1.1 * estimate(model, train, fused, result.plan).step_time_s


def _tt_row(**cells: str) -> dict[str, str]:
    """Llama 3.1 70B as torchtitan's async-TP benchmark ran it on 32 Grand Teton nodes (FSDP 32,
    TP 8 with sequence parallelism, full recomputation, local batch 16), one GPU node of it."""
    head = HEADER.split(",") + ["framework", "compiled", "async_tp"]
    row = dict.fromkeys(head, "")
    row.update(id="tt", source="x", arch="llama", layers="80", hidden="8192", ffn_hidden="28672", heads="64",
               kv_heads="8", vocab="128256", seq_len="8192", gpu="H100-HBM2e-96GB", num_gpus="256",
               gpus_per_node="8", tp="8", pp="1", dp="32", sp="yes", cp="1", zero_stage="3", recompute="full",
               micro_batch="16", global_batch="512", precision="bf16", metric_name="tokens_per_sec_per_gpu",
               metric_value="600", framework="torchtitan", **cells)
    return row


def test_compiled_and_async_tp_are_the_rows_traits():
    """compiled: torch.compile's fused layer and float8 casts, or torch's eager layer; async_tp:
    the sequence-parallel collectives overlapped with their GEMMs (torch's async TP, on an SM90
    profile), each a trait of the row's framework (costmodel.frameworks)."""
    from planner.measure.runs_table import row_specs
    stated = lambda **cells: row_specs(_tt_row(**cells))[2].framework  # noqa: E731
    default, compiled, eager, overlapped = stated(), stated(compiled="yes"), stated(compiled="no"), stated(async_tp="yes")
    assert compiled.compiled_layer and not compiled.eager_layer and compiled.float8_casts_fused
    assert eager.eager_layer and not eager.compiled_layer and not eager.float8_casts_fused
    # torchtitan compiles by default; a row that ran it eager keeps eager's SwiGLU tensors
    assert (default.swiglu_saved_tensors, compiled.swiglu_saved_tensors, eager.swiglu_saved_tensors) == (3, 3, 4)
    assert overlapped.tp_comm_overlap and not default.tp_comm_overlap
    assert stated(async_tp="no") == default


def _megatron_row(**cells) -> dict:
    """A Megatron-Core run on 64 H100 (FlagPerf's Llama 3 70B case): TP 8, PP 4, DP 2."""
    from planner.measure.runs_table import default_runs_path, read_runs
    row = next(r for r in read_runs(default_runs_path()) if r["id"] == "flagperf_llama3_70b_h100_bf16_g64")
    return {**row, **cells}


def test_dp_overlap_no_leaves_the_data_parallel_collectives_after_the_backward():
    """dp_overlap: whether the run hid its gradients' reduction and its weights' gather behind
    compute (Megatron-Core's --overlap-grad-reduce / --overlap-param-gather, off by default); `no`
    leaves both exposed, and `yes` on a framework that cannot overlap them is the row's error."""
    from costmodel.inputs import UserError
    from planner.measure.runs_table import row_specs
    from planner.measure.validate import validate_row
    traits = lambda **cells: row_specs(_megatron_row(**cells))[2].framework  # noqa: E731
    assert traits(dp_overlap="yes").dp_grad_overlap and traits(dp_overlap="yes").dp_param_overlap
    assert not traits(dp_overlap="no").dp_grad_overlap and not traits(dp_overlap="no").dp_param_overlap
    dp_s = lambda cell: validate_row(_megatron_row(dp_overlap=cell)).estimate.time_breakdown_s.get("comm/dp_exposed", 0)  # noqa: E731
    assert dp_s("no") > 2 * dp_s("yes")
    with pytest.raises(UserError, match="row 'r': dp_overlap = yes, but framework 'megatron-lm'"):
        row_specs(_megatron_row(id="r", framework="megatron-lm", dp_overlap="yes"))


def _sc21_row(size: str, **cells) -> dict:
    """A row of Narayanan et al.'s SC'21 Table 1 (Megatron-LM of 2021, fp16, full recomputation)."""
    from planner.measure.runs_table import default_runs_path, read_runs
    row = next(r for r in read_runs(default_runs_path()) if r["id"] == f"sc21_t1_{size}")
    return {**row, **cells}


def test_megatron_lm_s_torch_ddp_all_reduces_during_the_last_backward():
    """Megatron-LM before Megatron-Core ran torch's DDP where asked (--DDP-impl torch): without a
    pipeline, every micro-batch but the last under no_sync, the all-reduce behind the last
    backward; its own DDP all-reduced after the backward. A row states it with dp_overlap = yes,
    which needs zero_stage 0 and pp 1 (its pipeline schedules never enter no_sync)."""
    from costmodel.inputs import UserError
    from planner.measure.runs_table import row_specs
    from planner.measure.validate import validate_row
    assert row_specs(_sc21_row("18", dp_overlap="yes"))[2].framework.dp_grad_overlap
    assert not row_specs(_sc21_row("18", dp_overlap=""))[2].framework.dp_grad_overlap
    dp_s = lambda cell: validate_row(_sc21_row("18", dp_overlap=cell)).estimate.time_breakdown_s.get("comm/dp_exposed", 0)  # noqa: E731
    assert dp_s("") > 2 * dp_s("yes")
    for cells in ({"zero_stage": "1"}, {"zero_stage": ""}, {"pp": "2", "dp": "16"}):
        with pytest.raises(UserError, match="row 'sc21_t1_18': dp_overlap = yes, but framework 'megatron-lm' "
                                            "overlaps only torch DDP's all-reduce"):
            row_specs(_sc21_row("18", dp_overlap="yes", **cells))


def test_a_run_without_gradient_accumulation_fusion_adds_every_micro_batch_s_gradients():
    """grad_accumulation_fusion = no (a Megatron-LM before the fusion): each micro-batch's gradients
    are added into the step's by a kernel of their own, a pass over the rank's gradients (SC'21's
    530B: 280 micro-batches of 1.9 billion fp16 gradients a rank, seconds a step); yes: the
    framework's fused accumulation, only the embedding's gradient added (0.2 s); empty: the
    framework's, unless an arXiv paper from before the fusion describes the run. yes under a
    framework without the fusion is refused."""
    from costmodel.inputs import UserError
    from planner.measure.runs_table import default_runs_path, read_runs, row_specs
    from planner.measure.validate import validate_row
    fused = lambda row: row_specs(row)[2].framework.fused_grad_accumulation  # noqa: E731
    assert not fused(_sc21_row("530")) and fused(_sc21_row("530", grad_accumulation_fusion="yes"))
    # empty: the framework's, less the fusion where the source is an arXiv paper from before it
    assert not fused(_sc21_row("530", grad_accumulation_fusion=""))   # arXiv 2104.04473
    korthikanti = next(r for r in read_runs(default_runs_path()) if r["id"] == "korthikanti_530B_full")
    assert fused(korthikanti) and not korthikanti["grad_accumulation_fusion"]   # arXiv 2205.05198
    add_s = lambda cell: validate_row(_sc21_row("530", grad_accumulation_fusion=cell)).estimate.time_breakdown_s["grads/accumulation"]  # noqa: E731
    assert add_s("no") > max(1.0, 5 * add_s("yes"))
    with pytest.raises(UserError, match="row 'r': grad_accumulation_fusion = yes, but framework 'deepspeed'"):
        row_specs(_megatron_row(id="r", framework="deepspeed", grad_accumulation_fusion="yes"))


def test_vendor_attention_no_runs_flash_attention_2_under_transformer_engine():
    """vendor_attention = no: a Megatron-Core run with Transformer Engine's cuDNN attention off
    (NVTE_FUSED_ATTN=0) ran FlashAttention-2, the profile's attention without the vendor speedup;
    `yes` where the framework has no such kernel is the row's error."""
    from costmodel.hardware import resolve_device
    from costmodel.inputs import UserError
    from planner.measure.runs_table import row_specs
    cluster = lambda **cells: row_specs(_megatron_row(**cells))[2]  # noqa: E731
    fused, flash = cluster(vendor_attention="yes"), cluster(vendor_attention="no")
    assert fused.framework.vendor_attention and not flash.framework.vendor_attention
    profile = resolve_device("H100-SXM5-80GB").efficiency
    assert flash.device.efficiency.attention == pytest.approx(profile.attention)
    assert fused.device.efficiency.attention == pytest.approx(profile.attention * profile.vendor_attention_speedup)
    with pytest.raises(UserError, match="vendor_attention = yes, but framework 'torchtitan'"):
        row_specs(_megatron_row(framework="torchtitan", vendor_attention="yes"))


def test_attention_flash1_is_flash_attentions_first_generation():
    """attention = flash1: a run whose fused attention was FlashAttention's first generation
    (torch's SDPA before 2.2, flash-attn 1.x) is priced at that generation's speed, below the
    profile's FlashAttention-2 and without Transformer Engine's kernel; with vendor_attention = yes
    it is the row's error, and an unknown kernel lists the choices."""
    from costmodel.frameworks import FLASH1_SLOWDOWN
    from costmodel.hardware import resolve_device
    from costmodel.inputs import UserError
    from costmodel.specs import AttentionKernel
    from planner.measure.runs_table import row_specs
    _, train, first = row_specs(_megatron_row(attention="flash1"))
    assert train.attention_kernel is AttentionKernel.FLASH
    assert first.framework.flash_attention_1 and not first.framework.vendor_attention
    profile = resolve_device("H100-SXM5-80GB").efficiency
    assert first.device.efficiency.attention == pytest.approx(profile.attention / FLASH1_SLOWDOWN)
    assert not row_specs(_megatron_row(attention="flash"))[2].framework.flash_attention_1
    with pytest.raises(UserError, match="attention = flash1 is FlashAttention's first generation"):
        row_specs(_megatron_row(attention="flash1", vendor_attention="yes"))
    with pytest.raises(UserError, match="flash1"):
        row_specs(_megatron_row(attention="flash3"))


def test_llm_foundry_s_triton_attention_runs_at_its_published_speed():
    """Composer's llm-foundry rows ran MosaicML's Triton port of FlashAttention (attn_impl triton),
    which the FlashAttention-2 paper measured 1.3-1.5x slower forward and about 2x slower backward
    than FlashAttention-2: priced at that pair weighted by the passes' FLOPs, between
    FlashAttention-2 and the first generation's CUDA kernel; a composer row stating flash1 gets the
    CUDA kernel's speed instead."""
    from costmodel.frameworks import FLASH1_SLOWDOWN, FLASH_TRITON_SLOWDOWN, attention_speedup, framework_traits
    from costmodel.kernels.attention import FLASH_BACKWARD_FACTOR
    from planner.measure.runs_table import row_specs
    composer = framework_traits("composer-fsdp")
    assert composer.flash_attention_triton and not composer.flash_attention_1
    assert FLASH_TRITON_SLOWDOWN == pytest.approx((1.4 + FLASH_BACKWARD_FACTOR * 2.0) / (1 + FLASH_BACKWARD_FACTOR))
    assert 1.0 < FLASH_TRITON_SLOWDOWN < FLASH1_SLOWDOWN
    assert attention_speedup(composer, 1.7) == pytest.approx(1 / FLASH_TRITON_SLOWDOWN)
    first = row_specs(_megatron_row(framework="composer-fsdp", attention="flash1"))[2].framework
    assert first.flash_attention_1 and not first.flash_attention_triton
    assert attention_speedup(first, 1.7) == pytest.approx(1 / FLASH1_SLOWDOWN)


def test_the_dispatcher_cell_is_the_expert_all_to_all_that_ran():
    """dispatcher: Megatron-Core's plain all-to-all sends every routed copy of a token across the
    nodes, DeepEP and HybridEP one copy a node (frameworks `dispatch_per_node`): on an EP group
    over four nodes the plain one moves more and takes longer; empty keeps the framework's."""
    from planner.measure.runs_table import default_runs_path, read_runs, row_specs
    from planner.measure.validate import validate_row
    row = next(r for r in read_runs(default_runs_path()) if r["id"] == "modelzoo_h100_qwen3_235b_deepep_tp2pp8ep32")
    assert row["dispatcher"] == "deepep"
    traits = lambda cell: row_specs({**row, "dispatcher": cell})[2].framework  # noqa: E731
    assert traits("deepep").dispatch_per_node and traits("hybridep").dispatch_per_node
    assert not traits("alltoall").dispatch_per_node and traits("").dispatch_per_node
    ep_s = lambda cell: validate_row({**row, "dispatcher": cell}).estimate.time_breakdown_s["comm/ep_exposed"]  # noqa: E731
    assert ep_s("alltoall") > 1.5 * ep_s("deepep")


def test_async_tp_hides_most_of_the_tp_collectives():
    """The same run with and without async TP: the overlap hides all but one of the tp ring steps
    of each sequence-parallel collective, except the backward's reduce-scatters, which torch's
    pass leaves unfused (frameworks `tp_backward_reduce_scatter_exposed`): of the forward's, the
    backward's and the full recomputation's collectives (equal bytes each) 1/8, (1 + 1/8)/2 and
    1/8 stay exposed; the hidden rest slows the GEMMs by the device's comm_contention of its time
    (costmodel.rank_time.parts._contended)."""
    from costmodel.hardware import resolve_device
    from planner.measure.validate import validate_row
    vanilla = validate_row(_tt_row(compiled="yes", async_tp="no"))
    overlapped = validate_row(_tt_row(compiled="yes", async_tp="yes"))
    exposed = lambda r: r.estimate.time_breakdown_s["comm/tp_exposed"]  # noqa: E731
    c = resolve_device("H100-HBM2e-96GB").efficiency.comm_contention
    paid = [share + c * (1 - share) for share in (1 / 8, 9 / 16, 1 / 8)]
    assert exposed(vanilla) > 1.0   # seconds: 70B's activations over NVLink, 16 x 8k tokens a rank
    assert exposed(overlapped) == pytest.approx(exposed(vanilla) * sum(paid) / 3, rel=0.05)
    saved_s = vanilla.estimate.step_time_s - overlapped.estimate.step_time_s
    assert saved_s == pytest.approx(exposed(vanilla) - exposed(overlapped), rel=0.1)


def test_rms_norm_states_how_a_megatron_lm_fork_ran_its_norm():
    """rms_norm: Megatron-LM's own RMSNorm is torch ops in fp32 (the framework's default); BAAI's
    FlagScale fork calls apex's fused kernel (`fused`, as its FlagPerf rows state). Refused on a
    LayerNorm model and under a fused layer."""
    from costmodel.frameworks import composite_rms_norm
    from costmodel.inputs import UserError
    from planner.measure.runs_table import default_runs_path, read_runs, row_specs
    from planner.measure.validate import validate_row
    row = next(r for r in read_runs(default_runs_path()) if r["id"] == "flagperf_aquila2_7b_a800_tp2pp2dp2_mbs4")
    traits = lambda **cells: row_specs({**row, **cells})[2].framework  # noqa: E731
    assert not composite_rms_norm(traits())                      # the row states fused
    assert composite_rms_norm(traits(rms_norm="")) and composite_rms_norm(traits(rms_norm="torch"))
    step_s = lambda cell: validate_row({**row, "rms_norm": cell}).estimate.step_time_s  # noqa: E731
    assert step_s("torch") > 1.05 * step_s("fused")
    with pytest.raises(UserError, match="row 'r': rms_norm = fused, but framework 'megatron-core' runs a fused layer"):
        row_specs({**row, "id": "r", "framework": "megatron-core"})
    gpt = next(r for r in read_runs(default_runs_path()) if r["id"] == "sc21_t1_18")
    with pytest.raises(UserError, match="row 'g': rms_norm = torch, but the model's norm is layernorm"):
        row_specs({**gpt, "id": "g", "rms_norm": "torch"})


def test_a_whole_iteration_cuda_graph_pays_no_host_cost():
    """A row stating cuda_graph = full (MLPerf's FULL_CUDA_GRAPH) is priced without the per-kernel
    and the per-step host cost (frameworks `iteration_graph`, DeviceProfile.graphed): its step is the
    same plan's on a device with both set to zero, shorter by at least the step's host work; a value
    other than full or none is one line naming the row."""
    from dataclasses import replace

    from costmodel.estimate import estimate
    from costmodel.inputs import UserError
    from planner.measure.runs_table import default_runs_path, read_runs, row_specs
    from planner.measure.validate import best_plan_for_row
    row = next(r for r in read_runs(default_runs_path()) if r["id"] == "mlperf51_l405b_b200_uf_256")
    assert row["cuda_graph"] == "full"
    model, train, graphed = row_specs(row)
    _, _, plain = row_specs({**row, "cuda_graph": ""})
    assert graphed.framework.iteration_graph and not plain.framework.iteration_graph
    eff = graphed.device.efficiency
    assert eff.kernel_overhead_s == eff.step_overhead_s == 0.0 < plain.device.efficiency.step_overhead_s
    plan = best_plan_for_row(row, model, train, graphed)[0]
    bare = replace(plain, device=replace(plain.device, efficiency=replace(
        plain.device.efficiency, kernel_overhead_s=0.0, step_overhead_s=0.0)))
    assert estimate(model, train, graphed, plan).step_time_s == pytest.approx(estimate(model, train, bare, plan).step_time_s)
    assert (estimate(model, train, plain, plan).step_time_s - estimate(model, train, graphed, plan).step_time_s
            >= plain.device.efficiency.step_overhead_s)
    with pytest.raises(UserError, match="row 'mlperf51_l405b_b200_uf_256': cuda_graph = 'layer' is not one of full, none"):
        row_specs({**row, "cuda_graph": "layer"})
