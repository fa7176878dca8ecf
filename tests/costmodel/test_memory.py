"""Memory against the ZeRO paper and Korthikanti et al. 2022, term by term."""
import pytest

from costmodel.frameworks import GENERIC, RUNTIME, framework_traits
from costmodel.hardware import parse_cluster
from costmodel.memory import in_flight_micro_batches, layer_activation_bytes, state_bytes, state_bytes_for
from costmodel.params import total_params
from costmodel.plan import Recompute
from costmodel.registry import MODELS
from costmodel.schedules import Schedule
from costmodel.specs import AttentionKernel, DType, TrainSpec
from planner.space import Choice, build_plan

ZERO_TRAIN = TrainSpec(seq_len=2048, global_batch_size=64, grad_dtype=DType.BF16)


@pytest.mark.parametrize("zero,expected_bytes_per_param", [
    (0, 2 + 2 + 12), (1, 2 + 2 + 12 / 64), (2, 2 + (2 + 12) / 64), (3, (2 + 2 + 12) / 64)])
def test_zero_paper_state_bytes(zero, expected_bytes_per_param):
    """ZeRO paper Sec. 5.1: (2 + 2 + K) psi replicated; 2psi + 2psi + K psi/Nd with P_os;
    2psi + (2 + K) psi/Nd with P_os+g; (2 + 2 + K) psi/Nd with P_os+g+p; K = 12 for mixed Adam."""
    m = MODELS["llama2-7b"]
    plan = build_plan(m, ZERO_TRAIN, parse_cluster("8x8xA100"), Choice(zero_stage=zero))
    psi = total_params(m)
    assert sum(state_bytes(m, ZERO_TRAIN, plan, 0, GENERIC)) == pytest.approx(expected_bytes_per_param * psi)


def test_zero_paper_figure1_7_5b_on_64_gpus():
    """ZeRO paper Fig. 1: psi = 7.5B, Nd = 64: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB per device."""
    m = MODELS["llama2-7b"]
    for z, gb in ((0, 120), (1, 31.4), (2, 16.6), (3, 1.9)):
        plan = build_plan(m, ZERO_TRAIN, parse_cluster("8x8xA100"), Choice(zero_stage=z))
        assert sum(state_bytes_for(ZERO_TRAIN, plan, 7.5e9, GENERIC)) / 1e9 == pytest.approx(gb, abs=0.05)


@pytest.mark.parametrize("zero,expected_bytes_per_param", [
    (0, 4 + 2 + 2 + 8), (1, (4 + 8) / 64 + 2 + 2), (2, (4 + 2 + 8) / 64 + 2), (3, (4 + 2 + 8) / 64)])
def test_fsdp_mixed_precision_keeps_the_fp32_shard_as_master(zero, expected_bytes_per_param):
    """FSDP (our runtime, torchtitan, Composer): the sharded fp32 parameter is the master weight
    and a 16-bit copy exists while gathered (all step below ZeRO-3)."""
    m = MODELS["llama2-7b"]
    plan = build_plan(m, ZERO_TRAIN, parse_cluster("8x8xA100"), Choice(zero_stage=zero))
    assert sum(state_bytes_for(ZERO_TRAIN, plan, 1.0, RUNTIME)) == pytest.approx(expected_bytes_per_param)


def _gpt_plan(tp, sp, recompute=Recompute.NONE):
    m = MODELS["megatron-18b"]
    train = TrainSpec(seq_len=2048, global_batch_size=8, attention_kernel=AttentionKernel.EAGER)
    plan = build_plan(m, train, parse_cluster(f"1x{tp}xA100"),
                      Choice(tp=tp, sequence_parallel=sp, recompute=recompute, micro_batch_size=1))
    return m, train, plan


@pytest.mark.parametrize("tp,sp,recompute,coefficient", [
    (1, False, Recompute.NONE, lambda t, r: 34 + 5 * r),            # Eq. 2
    (8, False, Recompute.NONE, lambda t, r: 10 + 24 / t + 5 * r / t),  # Eq. 3
    (8, True, Recompute.NONE, lambda t, r: 34 / t + 5 * r / t),      # Eq. 4
    (8, True, Recompute.SELECTIVE, lambda t, r: 34 / t),            # Eq. 6
    (8, False, Recompute.FULL, lambda t, r: 2),                     # Sec. 5: input only
    (8, True, Recompute.FULL, lambda t, r: 2 / t),
])
def test_korthikanti_activation_coefficients(tp, sp, recompute, coefficient):
    """Per layer, per micro-batch: s b h x coefficient, with r = a s / h (Korthikanti et al. 2022),
    for Megatron-LM, which keeps the sequence shard of a projection's input under SP."""
    m, train, plan = _gpt_plan(tp, sp, recompute)
    s, b, h, a = 2048, 1, m.hidden_size, m.num_heads
    expected = s * b * h * coefficient(tp, a * s / h)
    megatron = framework_traits("megatron-lm")
    assert layer_activation_bytes(m, train, plan, recompute, megatron) == pytest.approx(expected)


def test_torch_sequence_parallelism_keeps_the_gathered_projection_inputs():
    """torch's DTensor SP (torchtitan) saves the all-gathered input of the QKV and first MLP
    projections: 2 x 2sbh whole instead of 2 x 2sbh / t; our runtime keeps the shard as
    Megatron-LM does (runtime.sequence_parallel; measured: tests/runtime)."""
    m, train, plan = _gpt_plan(8, True)
    s, h = 2048, m.hidden_size
    megatron = layer_activation_bytes(m, train, plan, Recompute.NONE, framework_traits("megatron-lm"))
    assert layer_activation_bytes(m, train, plan, Recompute.NONE, framework_traits("torchtitan")) == pytest.approx(
        megatron + 2 * 2 * s * h * (1 - 1 / 8))
    assert layer_activation_bytes(m, train, plan, Recompute.NONE, RUNTIME) == pytest.approx(megatron)


def test_flash_attention_drops_the_quadratic_term():
    m, train, plan = _gpt_plan(8, True)
    flash = TrainSpec(seq_len=2048, global_batch_size=8)
    lse = 4 * 1 * (m.num_heads // 8) * 2048
    assert layer_activation_bytes(m, flash, plan, Recompute.NONE, framework_traits("megatron-lm")) == pytest.approx(
        2048 * m.hidden_size * 34 / 8 + lse)


def test_in_flight_micro_batches_per_schedule():
    m = MODELS["megatron-145b"]
    train = TrainSpec(seq_len=2048, global_batch_size=64)
    cluster = parse_cluster("8x8xA100")
    one_f_one_b = build_plan(m, train, cluster, Choice(tp=8, pp=8))
    assert [in_flight_micro_batches(one_f_one_b, r) for r in (0, 3, 7)] == [8, 5, 1]
    gpipe = build_plan(m, train, cluster, Choice(tp=8, pp=8, schedule=Schedule.GPIPE))
    assert in_flight_micro_batches(gpipe, 0) == 64
    inter = build_plan(m, train, cluster, Choice(tp=8, pp=8, vpp=2))
    # Korthikanti et al. Sec. 4.2.3: the first rank holds p (1 + (p - 1)/(p v)) micro-batches
    assert in_flight_micro_batches(inter, 0) == pytest.approx(8 * (1 + 7 / 16))


def test_zero2_and_zero3_under_a_pipeline_are_priced_as_our_runtime_runs_them():
    """torch pipelining turns FSDP's gradient sync off until the last micro-batch: under pp > 1
    our runtime holds full gradients (and ZeRO-3 the gathered weights) all step; a framework
    that keeps them sharded (GENERIC) gets the ZeRO paper's figures."""
    m = MODELS["llama2-7b"]
    cluster = parse_cluster("8x8xA100")
    n = 1e9
    for zero in (2, 3):
        piped = build_plan(m, ZERO_TRAIN, cluster, Choice(zero_stage=zero, pp=2, dp=32))
        flat = build_plan(m, ZERO_TRAIN, cluster, Choice(zero_stage=zero, dp=64))
        w, g, _ = state_bytes_for(ZERO_TRAIN, piped, n, RUNTIME)
        assert g == pytest.approx(n * 2)  # whole bf16 gradients
        assert w == pytest.approx(n * 4 / 32 + n * 2)   # fp32 master shard + the held 16-bit copy
        assert state_bytes_for(ZERO_TRAIN, piped, n, GENERIC)[1] == pytest.approx(n * 2 / 32)
        assert state_bytes_for(ZERO_TRAIN, flat, n, RUNTIME)[1] == pytest.approx(n * 2 / 64)


def test_loss_keeps_fp32_log_probs_whatever_the_dtype():
    from costmodel.memory import logits_held_bytes
    m = MODELS["llama2-7b"]
    cluster = parse_cluster("1x8xA100")
    for dtype in (DType.BF16, DType.FP32):
        train = TrainSpec(seq_len=1024, global_batch_size=8, compute_dtype=dtype)
        flat = build_plan(m, train, cluster, Choice(dp=8, micro_batch_size=1))
        piped = build_plan(m, train, cluster, Choice(dp=4, pp=2, micro_batch_size=1))
        elems = 1024 * m.vocab_size
        assert logits_held_bytes(m, train, flat) == elems * 4
        assert logits_held_bytes(m, train, piped) == elems * (4 + dtype.num_bytes)


def test_the_loss_runs_on_vocabulary_shards_only_where_the_framework_does():
    """Megatron's vocab-parallel cross entropy keeps 1/t of the logits; our runtime gathers them
    (ColwiseParallel to Replicate) and every TP rank keeps the whole vocabulary's."""
    from costmodel.memory import logits_held_bytes
    m = MODELS["llama2-7b"]
    train = TrainSpec(seq_len=1024, global_batch_size=8)
    plan = build_plan(m, train, parse_cluster("1x8xA100"), Choice(tp=4, dp=2, micro_batch_size=1))
    whole = logits_held_bytes(m, train, plan, RUNTIME)
    assert whole == 1024 * m.vocab_size * 4
    assert logits_held_bytes(m, train, plan, framework_traits("megatron-lm")) == pytest.approx(whole / 4)


@pytest.mark.parametrize("schedule,pp,m,vpp", [(Schedule.ZB_H1, 4, 8, 1), (Schedule.ZB_H1, 4, 16, 2),
                                               (Schedule.ZBV, 4, 8, 2), (Schedule.ZB_H1, 8, 64, 1),
                                               (Schedule.DUALPIPEV, 4, 8, 2), (Schedule.DUALPIPEV, 3, 13, 2)])
def test_deferred_weight_passes_bound_the_simulated_ones(schedule, pp, m, vpp):
    """Unit costs, unit weight-pass inputs: the simulator's peak of deferred inputs on each rank
    is what the closed form counts, and with activations too the closed form bounds the peak."""
    from costmodel.memory import deferred_weight_passes
    from costmodel.pipeline_simulation import StageCost, simulate
    from costmodel.plan import Plan
    n = pp * vpp
    plan = Plan(dp=1, tp=1, pp=pp, cp=1, zero_stage=0, recompute=Recompute.NONE,
                recompute_num_layers=(0,) * pp, sequence_parallel=False, micro_batch_size=1,
                num_micro_batches=m, schedule=schedule, vpp=vpp, layers_per_stage=(1,) * n,
                mesh_axis_order=("pp", "dp", "cp", "tp"))

    def peaks(act, w):
        cost = StageCost(forward_s=1.0, recompute_s=0.0, backward_s=2.0, backward_weight_s=1.0, send_s=0.0,
                         activation_bytes=act, transient_bytes=0.0, weight_input_bytes=w)
        return simulate(plan, [cost] * n).peak_activation_bytes

    for r, (deferred, both) in enumerate(zip(peaks(0.0, 1.0), peaks(1.0, 0.5))):
        assert deferred == pytest.approx(deferred_weight_passes(plan, r) * vpp)
        closed = (in_flight_micro_batches(plan, r) + 0.5 * deferred_weight_passes(plan, r)) * vpp
        assert both <= closed + 1e-9


@pytest.mark.parametrize("framework", ["planner", "torchtitan", "megatron-core"])
@pytest.mark.parametrize("model_name,choice", [
    ("llama2-13b", Choice(tp=2, pp=4, recompute=Recompute.SELECTIVE, micro_batch_size=2)),
    ("llama2-13b", Choice(tp=1, pp=2, vpp=2, schedule=Schedule.INTERLEAVED, recompute=Recompute.FULL)),
    ("llama2-13b", Choice(tp=2, pp=2, schedule=Schedule.ZB_H1)),
    ("mixtral-8x7b", Choice(tp=2, pp=2, ep=2, recompute=Recompute.FULL)),
    ("deepseek-v2-lite", Choice(tp=2, pp=2, ep=2, recompute=Recompute.FULL)),
])
def test_zero2_prices_as_zero1_where_a_pipeline_keeps_whole_gradients(framework, model_name, choice):
    """costmodel.memory.keeps_whole_grads_under_pp: there the whole estimate of a ZeRO-2 plan
    (time and memory, part by part, every rank) is its ZeRO-1 twin's, which the search relies on
    (it names ZeRO-2 as ZeRO-1's alternative); a framework that shards gradients between
    micro-batches (Megatron-Core) prices them apart."""
    import dataclasses

    from costmodel.estimate import estimate
    from costmodel.memory import keeps_whole_grads_under_pp
    from costmodel.registry import resolve_model
    traits = framework_traits(framework)
    cluster = dataclasses.replace(parse_cluster("2x8xH100"), framework=traits)
    model, train = resolve_model(model_name), TrainSpec(seq_len=4096, global_batch_size=64)
    z1, z2 = (estimate(model, train, cluster, build_plan(model, train, cluster,
                                                           dataclasses.replace(choice, zero_stage=z)))
              for z in (1, 2))
    alike = (z1.step_time_s, z1.peak_memory_bytes, z1.time_breakdown_s, z1.memory_breakdown_bytes) == \
        (z2.step_time_s, z2.peak_memory_bytes, z2.time_breakdown_s, z2.memory_breakdown_bytes)
    assert alike is keeps_whole_grads_under_pp(choice.pp, traits), framework


def test_an_unknown_framework_s_fused_swiglu_keeps_what_megatron_core_s_does():
    """Generic traits run a layer's memory-bound work fused, so their SwiGLU keeps a fused one's
    three f-wide tensors, as Megatron-Core's; a row stating compiled = no runs it eager and keeps
    eager PyTorch's four (planner.measure.row_traits): at 8k tokens a Llama 3.1 405B layer under
    TP 8 keeps 109 MB a micro-batch less than with four."""
    from planner.measure.row_traits import _compiled
    m = MODELS["llama3-405b"]
    train = TrainSpec(seq_len=8192, global_batch_size=64)
    cluster = parse_cluster("8x8xH100")
    plan = build_plan(m, train, cluster, Choice(tp=8, pp=8, dp=1, sequence_parallel=True, micro_batch_size=1,
                                                recompute=Recompute.NONE, schedule=Schedule.ONE_F_ONE_B))
    generic, core = framework_traits("some-new-trainer"), framework_traits("megatron-core")
    fused = layer_activation_bytes(m, train, plan, Recompute.NONE, generic)
    assert fused == pytest.approx(layer_activation_bytes(m, train, plan, Recompute.NONE, core))
    eager = layer_activation_bytes(m, train, plan, Recompute.NONE, _compiled(generic, compiled=False))
    assert eager - fused == pytest.approx(2 * 8192 * m.ffn_hidden_size / 8)


def test_megatron_s_last_stage_keeps_the_fp32_softmax_and_not_the_logits():
    """Megatron's last stage returns the loss (its schedule keeps that), and the vocab-parallel
    cross entropy saves the fp32 softmax of its own cast: the 16-bit logits are not held under a
    pipeline as torch pipelining and DeepSpeed's engine hold them (frameworks `pipeline_output_kept`)."""
    from costmodel.memory import logits_held_bytes
    m, cluster = MODELS["llama2-7b"], parse_cluster("1x8xA100")
    train = TrainSpec(seq_len=1024, global_batch_size=8)
    piped = build_plan(m, train, cluster, Choice(dp=4, pp=2, micro_batch_size=1))
    elems = 1024 * m.vocab_size
    assert logits_held_bytes(m, train, piped, framework_traits("megatron-core")) == elems * 4
    assert logits_held_bytes(m, train, piped, framework_traits("megatron-lm")) == elems * 4
    assert logits_held_bytes(m, train, piped, framework_traits("deepspeed")) == elems * (4 + 2)


def test_a_fused_weight_gradient_holds_no_16_bit_copy_in_the_backward():
    """With gradient-accumulation fusion the weight-gradient GEMM adds into the fp32 main
    gradient itself: the backward's working memory is the widest block's input gradients alone,
    the compute-dtype weight gradient of the widest weight gone (frameworks `fused_grad_accumulation`)."""
    import dataclasses

    from costmodel.memory import backward_working_bytes
    m, cluster = MODELS["llama2-7b"], parse_cluster("1x8xA100")
    train = TrainSpec(seq_len=1024, global_batch_size=8)
    plan = build_plan(m, train, cluster, Choice(dp=2, tp=4, micro_batch_size=1))
    fused = framework_traits("megatron-core")
    unfused = dataclasses.replace(fused, fused_grad_accumulation=False)
    # the widest weight, bf16, over TP 4: Llama 2 7B's QKV projection (3h) is wider than its MLP's (f)
    widest_weight = 2 * m.hidden_size * max(m.ffn_hidden_size, 3 * m.hidden_size) / 4
    assert backward_working_bytes(m, train, plan, False, unfused) - backward_working_bytes(m, train, plan, False, fused) \
        == pytest.approx(widest_weight)


@pytest.mark.parametrize("model_name,choice", [
    ("llama2-13b", Choice(tp=4, pp=2, dp=4, fp8_linears=True)),
    ("mixtral-8x7b", Choice(tp=2, pp=2, ep=4, dp=8, fp8_linears=True, recompute=Recompute.FULL)),
    ("deepseek-v3", Choice(tp=2, pp=4, ep=4, dp=4, fp8_linears=True)),
])
def test_transformer_engine_s_cached_float8_weights_are_held_without_float8_parameters(model_name, choice):
    """Megatron-Core's float8 linears keep Transformer Engine's float8 weight and its transpose
    through the step (2 bytes a layer weight, experts' included) unless the weights are float8
    themselves (--fp8-param-gather, with the distributed optimizer); torchtitan's torchao keeps
    none. The search's affine shapes and its states floor count them as the estimate does."""
    import dataclasses

    from costmodel.memory import stage_memory_at, stage_memory_shapes
    from costmodel.params import rank_params
    from planner.bounds import states_floor
    model = MODELS[model_name]
    train = TrainSpec(seq_len=4096, global_batch_size=64)
    for framework, cached in (("megatron-core", True), ("torchtitan", False)):
        traits = framework_traits(framework)
        cluster = dataclasses.replace(parse_cluster("4x8xH100"), framework=traits)
        for zero in (0, 1):
            fp8 = build_plan(model, train, cluster, dataclasses.replace(choice, zero_stage=zero))
            bf16 = dataclasses.replace(fp8, fp8_linears=False)
            for rank in range(fp8.pp):
                held = rank_params(model, fp8, rank, traits)
                layers = fp8.layers_on_rank(rank)
                extra = (stage_memory_at(model, train, fp8, rank, layers, 0, 0.0, traits).params_bytes
                         - stage_memory_at(model, train, bf16, rank, layers, 0, 0.0, traits).params_bytes)
                expected = 2 * (held.layers + held.experts + held.mtp_linears) if cached and zero == 0 else 0
                assert extra == pytest.approx(expected)
            shapes = stage_memory_shapes(model, train, fp8, 0.0, traits)
            floor = states_floor(model, train, fp8, 0.0, traits)
            for rank, shape in enumerate(shapes):
                for layers in (1, 5):
                    recomputed = layers if fp8.recompute is Recompute.FULL else 0
                    mem = stage_memory_at(model, train, fp8, rank, layers, recomputed, 0.0, traits).total_bytes
                    shaped = (shape.base + shape.per_layer * layers + shape.per_recomputed * recomputed
                              + shape.jump * (recomputed > 0))
                    assert shaped == pytest.approx(mem)
                assert floor.per_layer <= shape.per_layer + shape.per_recomputed


def test_blackwell_keeps_one_float8_copy_of_a_cached_weight():
    """Hopper's float8 GEMMs take the TN layout only, so Transformer Engine keeps a transposed
    copy beside each cached float8 weight; Blackwell's (compute capability 10.x) take any layout
    and one copy serves both (TE's is_non_tn_fp8_gemm_supported; the profile's
    float8_gemm_any_layout, which the cluster's traits read)."""
    import dataclasses

    from costmodel.memory import float8_weight_cache_bytes
    traits = framework_traits("megatron-core")
    train = TrainSpec(seq_len=4096, global_batch_size=64)
    for device, copies in (("H100", 2), ("H200", 2), ("B200", 1), ("GB200", 1), ("B300", 1), ("GB300", 1)):
        cluster = dataclasses.replace(parse_cluster(f"1x4x{device}"), framework=traits)
        plan = build_plan(MODELS["llama2-7b"], train, cluster, Choice(tp=2, dp=2, zero_stage=0, fp8_linears=True))
        assert cluster.framework.float8_transposed_copy == (copies == 2), device
        assert float8_weight_cache_bytes(plan, cluster.framework) == copies, device
