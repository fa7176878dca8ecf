"""Float8 experts (costmodel.frameworks `float8_experts`): Megatron-Core runs a mixture's expert
projections in float8 (Transformer Engine's GroupedLinear and Linear), our runtime does not;
how the grouped float8 projections and their casts are priced, and who may plan them."""
import json

import pytest

from costmodel.check import check_plan
from costmodel.frameworks import FRAMEWORKS
from costmodel.hardware import parse_cluster, run_by
from costmodel.kernels.gemm import (
    FP8_CAST_FUSED,
    _moe_gemms_s,
    fp8_gemm_s,
    fp8_passes_s,
    gemm_s,
    grouped_gemm_s,
    linear_shapes,
)
from costmodel.kernels.roofline import memory_bound_s
from costmodel.registry import resolve_model
from costmodel.specs import TrainSpec
from planner.cli import main
from planner.space import Choice, build_plan

H100 = parse_cluster("1x8xH100").device
TRAIN = TrainSpec(seq_len=4096, global_batch_size=256, float8=True)
QWEN3_30B = resolve_model("qwen3-30b-a3b")


def _cast_s(elements: int) -> float:
    """A fused float8 cast, by hand: an amax read and a scaled cast (5 bytes an element, 2 kernels)."""
    assert FP8_CAST_FUSED == (5, 2)
    return memory_bound_s(5 * elements, H100, 2)


def test_a_large_grouped_float8_gemm_runs_at_the_fp8_peak_ratio():
    """16 experts of 4,096 rows, 4096 x 1536: every tile count fills whole waves alike in both
    dtypes, both kernels are compute-bound, so float8 takes 989.4 / 1978.9 of bf16's time."""
    groups, m, k, n = 16, 4096, 4096, 1536
    bf16 = grouped_gemm_s(groups, m, k, n, H100, TRAIN)
    fp8 = fp8_gemm_s(m, k, n, H100, groups)
    ratio = H100.peak_for("fp8") / H100.peak_for("bf16")
    launch = H100.efficiency.kernel_overhead_s
    assert ratio == pytest.approx(2.0, rel=1e-3)
    assert (bf16 - launch) / (fp8 - launch) == pytest.approx(ratio, rel=1e-9)
    assert fp8_gemm_s(m, k, n, H100) == pytest.approx(fp8_gemm_s(m, k, n, H100, 1))   # one group: the plain GEMM


def test_the_grouped_float8_projection_pays_its_casts_once_for_all_groups():
    """Forward: the GEMM, the input rows of all groups and their weights cast (one multi-tensor
    cast each); input gradient: the GEMM and the output gradient's cast; weight gradient: the
    GEMM alone (fused casts: the forward's reused). Casts and all, float8 stays faster than
    bf16 at this size, by much less than the peak ratio: the input's cast (5 bytes an element
    at the memory rate, against 2n FLOPs an element at the fp8 rate) costs about four fifths
    of the GEMM at n = 1536."""
    groups, m, k, n = 16, 4096, 4096, 1536
    gf, gb, gw = (fp8_gemm_s(*shape, H100, groups) for shape in linear_shapes(m, k, n))
    fwd, bwd_in, bwd_w = fp8_passes_s(m, k, n, H100, True, groups)
    assert fwd == pytest.approx(gf + _cast_s(groups * m * k) + _cast_s(groups * k * n))
    assert bwd_in == pytest.approx(gb + _cast_s(groups * m * n))
    assert bwd_w == pytest.approx(gw)
    bf16 = sum(grouped_gemm_s(groups, *shape, H100, TRAIN) for shape in linear_shapes(m, k, n))
    assert 1.2 < bf16 / (fwd + bwd_in + bwd_w) < 1.4
    assert 0.75 < _cast_s(groups * m * k) / gf < 0.85


def test_a_mixture_in_float8_keeps_its_router_in_bf16():
    """Qwen3-30B-A3B's mixture on 8 experts a device (ep 16), 4,096 tokens: the router (and
    there is no shared expert) in bf16, each expert projection one grouped float8 projection
    over the rows routed to a device's experts (4,096 x 8 x the stated imbalance over 8)."""
    tokens, ep = 4096, 16
    local = QWEN3_30B.num_experts // ep
    rows = round(tokens * QWEN3_30B.experts_per_token * TRAIN.expert_load_imbalance / local)
    assert not QWEN3_30B.shared_expert_ffn_hidden_size and not QWEN3_30B.shared_expert_gate
    h, f = QWEN3_30B.hidden_size, QWEN3_30B.moe_ffn_hidden_size
    router = gemm_s(tokens, h, QWEN3_30B.num_experts, H100, TRAIN)
    up = fp8_passes_s(rows, h, f, H100, True, local)
    down = fp8_passes_s(rows, f, h, H100, True, local)
    priced = _moe_gemms_s(QWEN3_30B, TRAIN, H100, tokens, ep, grouped=True, fp8=True, fused_casts=True)
    assert priced == pytest.approx(tuple(router + 2 * u + d for u, d in zip(up, down)))
    bf16 = _moe_gemms_s(QWEN3_30B, TRAIN, H100, tokens, ep, grouped=True)
    assert bf16 == pytest.approx(tuple(router + 2 * grouped_gemm_s(local, *up_shape, H100, TRAIN)
                                       + grouped_gemm_s(local, *down_shape, H100, TRAIN)
                                       for up_shape, down_shape in zip(linear_shapes(rows, h, f),
                                                                       linear_shapes(rows, f, h))))


def test_megatron_core_may_run_float8_experts_and_our_runtime_may_not():
    cluster = parse_cluster("2x8xH100")
    core = run_by(cluster, FRAMEWORKS["megatron-core"])
    plan = build_plan(QWEN3_30B, TRAIN, core, Choice(ep=8, fp8_linears=True))
    assert not check_plan(QWEN3_30B, TRAIN, core, plan, memory=False)
    ours = build_plan(QWEN3_30B, TRAIN, cluster, Choice(ep=8, fp8_linears=True))
    assert check_plan(QWEN3_30B, TRAIN, cluster, ours, memory=False) == [
        "fp8_linears: model qwen3-30b-a3b is a mixture of experts; planner runs float8 for dense models only "
        "(Megatron-Core runs experts in float8: --framework megatron)"]
    assert FRAMEWORKS["megatron-core"].float8_experts and not FRAMEWORKS["planner"].float8_experts


def test_deepseeks_shared_expert_runs_in_float8_beside_its_routed_ones():
    """DeepSeek-V3's shared expert is a plain Transformer Engine MLP over every token: its three
    projections in float8 with their casts, one GEMM each; the routed experts grouped."""
    model = resolve_model("deepseek-v3")
    tokens, ep = 4096, 8
    local = model.num_experts // ep
    rows = round(tokens * model.experts_per_token * TRAIN.expert_load_imbalance / local)
    h, f, fs = model.hidden_size, model.moe_ffn_hidden_size, model.shared_expert_ffn_hidden_size
    assert fs and not model.shared_expert_gate
    router = gemm_s(tokens, h, model.num_experts, H100, TRAIN)
    parts = [fp8_passes_s(rows, h, f, H100, True, local)] * 2 + [fp8_passes_s(rows, f, h, H100, True, local)]
    parts += [fp8_passes_s(tokens, h, fs, H100, True)] * 2 + [fp8_passes_s(tokens, fs, h, H100, True)]
    priced = _moe_gemms_s(model, TRAIN, H100, tokens, ep, grouped=True, fp8=True, fused_casts=True)
    assert priced == pytest.approx(tuple(router + sum(p) for p in zip(*parts)))


def test_the_megatron_search_emits_float8_experts_and_ours_does_not(capsys):
    args = ["search", "--model", "qwen3-30b-a3b", "--cluster", "4x8xH100", "--dtype", "fp8", "--top", "3", "--json"]
    assert main(args + ["--framework", "megatron"]) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and all(p["plan"]["fp8_linears"] for p in plans)
    assert main(args) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert plans and not any(p["plan"]["fp8_linears"] for p in plans)


def test_float8_with_experts_in_our_runtime_is_one_line_and_exit_2(capsys):
    assert main(["predict", "--model", "qwen3-30b-a3b", "--cluster", "2x8xH100", "--dtype", "fp8", "--ep", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["planner predict: error: invalid plan: fp8_linears: model qwen3-30b-a3b is a mixture of experts; "
                   "planner runs float8 for dense models only (Megatron-Core runs experts in float8: --framework megatron)"]


def test_a_megatron_plan_with_float8_experts_is_refused_by_planner_run(tmp_path, capsys):
    """A plan.json made for Megatron-Core (--framework megatron) may run float8 experts; `planner
    run` refuses it before anything starts, in one line naming the framework it was made for."""
    from costmodel.plan import PlanFile
    core = run_by(parse_cluster("2x8xH100"), FRAMEWORKS["megatron-core"])
    plan = build_plan(QWEN3_30B, TRAIN, core, Choice(ep=8, fp8_linears=True))
    path = tmp_path / "plan.json"
    PlanFile(plan=plan, model=QWEN3_30B, train=TRAIN, cluster=core).save(path)
    assert main(["run", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"planner run: error: {path} was planned for megatron-core, whose float8 this runtime does not run: "
                   "fp8_linears: model qwen3-30b-a3b is a mixture of experts; planner runs float8 for dense models only "
                   "(Megatron-Core runs experts in float8: --framework megatron)"]
