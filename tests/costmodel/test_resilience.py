"""Checkpoint interval and throughput with failures (Young/Daly) against their sources."""
import json
import math

import pytest

from costmodel.params import total_params
from costmodel.registry import resolve_model
from costmodel.resilience import (
    FAILURES_PER_DEVICE_HOUR,
    HASH_BYTES_PER_S_PER_DEVICE,
    STORAGE_BYTES_PER_S_PER_DEVICE,
    checkpoint_cost,
)
from costmodel.specs import TrainSpec
from planner.cli import main


def test_llama3_failure_rate_gives_its_own_interruption_interval():
    """419 interruptions in 54 days on 16,384 GPUs: one every 3.1 hours at that size."""
    model = resolve_model("llama3-405b")
    cost = checkpoint_cost(model, TrainSpec(seq_len=8192, global_batch_size=2048), 16_384, 10.0, 1e6)
    assert cost.mtbf_s / 3600 == pytest.approx(54 * 24 / 419)
    assert FAILURES_PER_DEVICE_HOUR * 16_384 * 54 * 24 == pytest.approx(419)


def test_young_daly_interval_and_lost_share():
    model = resolve_model("llama-70b")
    train = TrainSpec(seq_len=4096, global_batch_size=1024)
    cost = checkpoint_cost(model, train, 64, 1.0, 1000.0)   # 1 s steps: tau in whole steps ~ exact
    assert cost.state_bytes == total_params(model) * 12   # fp32 master weights + AdamW moments
    assert cost.interval_s == pytest.approx(math.sqrt(2 * cost.write_s * cost.mtbf_s), abs=1.0)
    delta, tau, m = cost.write_s, cost.interval_s, cost.mtbf_s
    assert cost.lost_fraction == pytest.approx(delta / (tau + delta) + (tau / 2 + delta) / m)
    assert cost.effective_tokens_per_s == pytest.approx(1000.0 * (1 - cost.lost_fraction))
    # more devices: failures come sooner, so checkpoints come more often
    assert checkpoint_cost(model, train, 4096, 1.0, 1000.0).interval_s < cost.interval_s


def test_a_checkpoint_waits_for_its_write_and_its_checksum_pass():
    """Each rank writes its share, then reads it back and hashes it for the manifest
    (runtime.manifest): 70B x 12 bytes over 64 ranks, at 122 MB/s and 1.4 GB/s."""
    model = resolve_model("llama-70b")
    cost = checkpoint_cost(model, TrainSpec(seq_len=4096, global_batch_size=1024), 64, 1.0, 1000.0)
    share = total_params(model) * 12 / 64
    assert cost.write_s == pytest.approx(share / STORAGE_BYTES_PER_S_PER_DEVICE + share / HASH_BYTES_PER_S_PER_DEVICE)
    assert share / HASH_BYTES_PER_S_PER_DEVICE == pytest.approx(0.080 * cost.write_s, rel=0.01)   # the hash: 8 %


def test_search_prints_and_returns_the_checkpoint_plan(capsys):
    args = ["search", "--model", "llama2-7b", "--cluster", "1x8xA100", "--seq-len", "2048", "--global-batch", "64"]
    assert main(args) == 0
    assert "checkpoint every" in capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    ckpt = json.loads(capsys.readouterr().out)["checkpoint"]
    assert ckpt["interval_steps"] >= 1 and 0 < ckpt["lost_fraction"] < 0.1 and "Llama 3" in ckpt["source"]


def test_a_stated_failure_rate_and_storage_bandwidth_replace_llama3s(capsys):
    args = ["search", "--model", "llama2-7b", "--cluster", "1x8xA100", "--seq-len", "2048", "--global-batch", "64"]
    assert main([*args, "--json"]) == 0
    llama3 = json.loads(capsys.readouterr().out)["checkpoint"]
    assert main([*args, "--json", "--device-mtbf-hours", "1000"]) == 0
    often = json.loads(capsys.readouterr().out)["checkpoint"]
    # 50x the failures: M shrinks 50x, so tau = sqrt(2 delta M) shrinks about sqrt(50)x
    assert often["mtbf_s"] == pytest.approx(1000 * 3600 / 8)
    assert often["interval_s"] < llama3["interval_s"] / 5
    assert often["source"].startswith("stated: --device-mtbf-hours 1000; storage bandwidth from Llama 3")
    assert main([*args, "--storage-mb-s-per-device", "1220"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("long run"))
    assert "(1,220 MB/s per device)" in line and "at Llama 3's rate" in line
    assert main(["predict", "--model", "llama2-7b", "--cluster", "1x8xA100", "--device-mtbf-hours", "0"]) == 2
    assert "--device-mtbf-hours: 0 is not positive" in capsys.readouterr().err


def test_fp32_and_sgd_checkpoints_keep_the_weights():
    """Without 16-bit compute the weights are the fp32 masters; SGD has no moments: still 4 bytes."""
    from costmodel.specs import DType, Optimizer
    model = resolve_model("llama-70b")
    fp32 = TrainSpec(seq_len=4096, global_batch_size=1024, compute_dtype=DType.FP32)
    assert checkpoint_cost(model, fp32, 64, 1.0, 1000.0).state_bytes == total_params(model) * 12
    sgd = TrainSpec(seq_len=4096, global_batch_size=1024, compute_dtype=DType.FP32, optimizer=Optimizer.SGD)
    assert checkpoint_cost(model, sgd, 64, 1.0, 1000.0).state_bytes == total_params(model) * 4
