"""The cost model's attention core against torch's, at the closed loop's shapes, on this machine:

    python benchmarks/attention_price.py PROFILE.toml [--repeat 15]

For the closed loop's two models (benchmarks/closed_loop.py: hidden-llama without dropout, the
flash path; held-out-gpt with dropout 0.1, torch's math path on a CPU), fp32 and bf16, micro-batch
2 and 4 and TP 2, one thread as `planner run` gives each CPU rank: the forward and backward of
`costmodel.compute._attention_core_s` under PROFILE (a CPU profile: with its SDPA curves where it
has them, `planner profile` since 2026-11-27) against the median of `repeat` calls of the
runtime's own `runtime.model.core_attention` (the backward: forward + backward less the forward);
then per model and dtype the share of the whole causal call a cp-2 rank's two chunk calls are priced at.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from closed_loop import HELD_OUT_GPT, HIDDEN   # siblings: run as `python benchmarks/attention_price.py`
from cpu_kernels import median_s
from costmodel.cluster import ClusterSpec, load_profile
from costmodel.compute import _attention_core_s
from costmodel.hf_config import model_from_hf_config
from costmodel.specs import AttentionKernel, DType, TrainSpec
from planner.space import Choice, build_plan
from runtime.model import DROPOUT_P, core_attention

SEQ_LEN = 256
SHAPES = ((2, 1), (4, 1), (4, 2))   # (micro-batch, tp)


def measured_s(model, mbs: int, tp: int, dtype: torch.dtype, repeat: int) -> tuple[float, float]:
    heads, kv_heads, d = model.num_heads // tp, model.num_kv_heads // tp, model.head_dim
    q = torch.randn(mbs, heads, SEQ_LEN, d, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(mbs, kv_heads, SEQ_LEN, d, dtype=dtype, requires_grad=True) for _ in range(2))
    p = DROPOUT_P if model.dropout else 0.0
    fwd = median_s(lambda: core_attention(q.detach(), k.detach(), v.detach(), AttentionKernel.FLASH, p), repeat)
    both = median_s(lambda: core_attention(q, k, v, AttentionKernel.FLASH, p).sum().backward(), repeat)
    return fwd, both - fwd


def cp_share(model, train: TrainSpec, dev) -> tuple[float, float]:
    """(forward, backward) of a cp-2 rank's attention core over the cp-1 plan's, as priced."""
    def core(cp: int):
        cluster = ClusterSpec(device=dev, num_nodes=1, devices_per_node=cp)
        plan = build_plan(model, train, cluster, Choice(micro_batch_size=2, cp=cp))
        return _attention_core_s(model, train, plan, dev.for_dtype(train.compute_dtype), False, True)
    (f2, b2), (f1, b1) = core(2), core(1)
    return f2 / f1, b2 / b1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile", type=Path)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dev = load_profile(args.profile)
    print(f"attention core per layer and micro-batch, seq {SEQ_LEN} (ms): priced under {args.profile} / measured")
    for name, config in (("hidden-llama", HIDDEN), ("held-out-gpt", HELD_OUT_GPT)):
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "config.json").write_text(json.dumps(config))
            model = model_from_hf_config(Path(tmp) / "config.json")
        for dtype in (DType.FP32, DType.BF16):
            train = TrainSpec(seq_len=SEQ_LEN, global_batch_size=8, compute_dtype=dtype)
            for mbs, tp in SHAPES:
                cluster = ClusterSpec(device=dev, num_nodes=1, devices_per_node=tp)
                plan = build_plan(model, train, cluster, Choice(micro_batch_size=mbs, tp=tp))
                fwd_p, bwd_p = _attention_core_s(model, train, plan, dev.for_dtype(dtype), False, True)
                fwd_m, bwd_m = measured_s(model, mbs, tp, getattr(torch, "float32" if dtype is DType.FP32
                                                                  else "bfloat16"), args.repeat)
                print(f"  {name:>12} {dtype} mbs {mbs} tp {tp}: forward {fwd_p * 1e3:6.2f} / {fwd_m * 1e3:6.2f}"
                      f" ({100 * (fwd_p / fwd_m - 1):+4.0f} %), backward {bwd_p * 1e3:6.2f} / {bwd_m * 1e3:6.2f}"
                      f" ({100 * (bwd_p / bwd_m - 1):+4.0f} %)")
            print(f"  {name:>12} {dtype} cp 2, mbs 2: a rank's two chunk calls priced at "
                  + ", ".join(f"{k} {r:.2f}" for k, r in zip(("forward", "backward"), cp_share(model, train, dev)))
                  + " of the causal call over the whole sequence (measured: cpu_kernels.py --only 6)")


if __name__ == "__main__":
    main()
