"""llm-foundry's fused cross entropy (costmodel.frameworks `fused_cross_entropy`, composer-fsdp):
the loss keeps the 16-bit logits and a log-sum-exp per row, and writes a 16-bit gradient, where
torch's cross entropy keeps fp32 log-probabilities and writes an fp32 gradient before the cast.
On MPT-1B's benchmark row (A100-40GB, micro-batch 10 of 2,048 tokens, vocabulary 50,368, no
recomputation) that is the difference between a run that ran and one predicted not to fit."""
from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.frameworks import framework_traits
from costmodel.hardware import parse_cluster
from costmodel.memory import logits_held_bytes
from costmodel.registry import resolve_model
from costmodel.specs import DType, TrainSpec
from planner.measure.runs_table import read_runs
from planner.measure.validate import validate_row
from planner.space import Choice, build_plan

RUNS = Path(__file__).resolve().parents[2] / "profiles" / "runs" / "published_runs.csv"


def test_the_fused_loss_keeps_16_bit_logits():
    model, train = resolve_model("llama3-8b"), TrainSpec(seq_len=2048, global_batch_size=8, compute_dtype=DType.BF16)
    composer = framework_traits("composer-fsdp")
    cluster = replace(parse_cluster("1x8xA100"), framework=composer)
    plan = build_plan(model, train, cluster, Choice(micro_batch_size=1, zero_stage=3))
    logits = plan.micro_batch_size * train.seq_len * model.vocab_size
    assert logits_held_bytes(model, train, plan, composer) == pytest.approx(2 * logits, rel=1e-3)
    assert logits_held_bytes(model, train, plan, replace(composer, fused_cross_entropy=False)) == 4 * logits


def test_mpt_1b_on_a100_40gb_is_predicted_to_fit():
    row = next(r for r in read_runs(RUNS) if r["id"] == "mpt_1b_a100_40gb_s2048_g128")
    assert validate_row(row).estimate.fits
