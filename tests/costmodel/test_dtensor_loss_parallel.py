"""torch's DTensor loss parallel (costmodel.frameworks `dtensor_loss_parallel`, torchtitan under
TP): its backward holds a zero-filled fp32 gradient, exp of the saved log-probs and their sum,
12 bytes a logit beside the saved 4, where torch's cross entropy holds 8. On torchtitan's Llama
3.1 70B row (FSDP 32 x TP 8, local batch 16 of 8,192 tokens, 128,256 / 8 logits a token) that is
7.8 GiB more at the loss, the difference between priced and measured peak memory."""
from dataclasses import replace
from pathlib import Path

from costmodel.frameworks import framework_traits
from costmodel.hardware import parse_cluster
from costmodel.memory import backward_working_bytes
from costmodel.registry import resolve_model
from costmodel.specs import DType, TrainSpec
from planner.measure.runs_table import read_runs
from planner.measure.validate import validate_row
from planner.space import Choice, build_plan

RUNS = Path(__file__).resolve().parents[2] / "profiles" / "runs" / "published_runs.csv"


def _loss_working(tp: int, loss_parallel: bool) -> float:
    model, train = resolve_model("llama3-8b"), TrainSpec(seq_len=4096, global_batch_size=64, compute_dtype=DType.BF16)
    titan = replace(framework_traits("torchtitan"), dtensor_loss_parallel=loss_parallel)
    cluster = replace(parse_cluster("1x8xH100"), framework=titan)
    plan = build_plan(model, train, cluster, Choice(tp=tp, micro_batch_size=8, zero_stage=3))
    return backward_working_bytes(model, train, plan, True, titan)


def test_under_tp_the_loss_backward_holds_three_fp32_tensors_a_logit():
    logits = 8 * 4096 * -(-128_256 // 8)
    assert _loss_working(8, True) - _loss_working(8, False) == 4 * logits   # 12 bytes, not 8
    assert _loss_working(1, True) == _loss_working(1, False)   # no TP: torch's own cross entropy


def test_torchtitans_70b_row_is_priced_within_12_percent_of_its_measured_memory():
    row = next(r for r in read_runs(RUNS) if r["id"] == "tt25a_l31_70b_256_2d_fp8")
    assert abs(validate_row(row).memory_error_pct) < 12   # 24 % short with torch's cross entropy's bytes
