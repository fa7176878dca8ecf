"""Where one GPU step's time goes: a plan's training steps under torch.profiler, and the rates of
the exact GEMM, attention, loss and norm shapes of benchmarks/gpu_check.py's model.

    python benchmarks/gpu_trace.py PLAN.json [--out DIR] [--compile]

Writes DIR/kernel_shapes.json (per shape: best and median seconds, TFLOP/s) and DIR/kernels_MODE.json
(per kernel and operator: device microseconds and calls over one warm-up and two timed steps,
the model's build included), and prints the profiler's table sorted by device time. --compile
traces the layers as `planner run --compile` runs them (runtime.compile), the shapes unchanged. An H100's
tables (benchmarks/results/gpu-check-h100-*/run1/torch_profile_*.txt) are what
costmodel.kernels._host_or_device and the `eager_layer` trait rest on. Needs CUDA.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

HIDDEN, FFN, KV, VOCAB, HEADS, HEAD_DIM = 2048, 5632, 512, 32000, 16, 128   # gpu_check.model_config


def _best_and_median_s(fn, calls: int = 10) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times), sorted(times)[len(times) // 2]


def shapes() -> list[dict]:
    dev, rows = torch.device("cuda"), []
    for tokens in (2048, 4096, 8192, 16384):
        for op, (k, n) in {"qkv": (HIDDEN, HIDDEN + 2 * KV), "o": (HIDDEN, HIDDEN), "gate_up": (HIDDEN, 2 * FFN),
                           "down": (FFN, HIDDEN), "head": (HIDDEN, VOCAB)}.items():
            for dtype in (torch.bfloat16, torch.float32):
                a, w = torch.randn(tokens, k, dtype=dtype, device=dev), torch.randn(n, k, dtype=dtype, device=dev)
                best, median = _best_and_median_s(lambda: F.linear(a, w))
                rows.append({"tokens": tokens, "op": op, "dtype": str(dtype), "flops": 2 * tokens * k * n,
                             "best_s": best, "median_s": median, "tflops": 2 * tokens * k * n / best / 1e12})
        for seq in (2048, 4096):
            if tokens % seq:
                continue
            q, k_, v = (torch.randn(tokens // seq, HEADS, seq, HEAD_DIM, dtype=torch.bfloat16, device=dev,
                                    requires_grad=True) for _ in range(3))
            out = F.scaled_dot_product_attention(q, k_, v, is_causal=True)
            grad = torch.randn_like(out)
            fwd, _ = _best_and_median_s(lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True))
            both, _ = _best_and_median_s(lambda: torch.autograd.grad(
                F.scaled_dot_product_attention(q, k_, v, is_causal=True), (q, k_, v), grad))
            flops = 2 * tokens * seq * HEAD_DIM * HEADS   # causal: half of 4 b h s^2 d
            rows.append({"tokens": tokens, "op": f"sdpa seq {seq}", "forward_s": fwd, "forward_backward_s": both,
                         "forward_tflops": flops / fwd / 1e12})
        logits = torch.randn(tokens, VOCAB, dtype=torch.bfloat16, device=dev, requires_grad=True)
        labels = torch.randint(0, VOCAB, (tokens,), device=dev)
        fwd, _ = _best_and_median_s(lambda: F.cross_entropy(logits.float(), labels))
        both, _ = _best_and_median_s(lambda: torch.autograd.grad(F.cross_entropy(logits.float(), labels), logits))
        rows.append({"tokens": tokens, "op": "cross entropy (bf16 logits, fp32 softmax)", "forward_s": fwd,
                     "forward_backward_s": both})
    return rows


def trace(plan: Path, out: Path, compile: bool) -> Path:
    """The plan's steps under torch.profiler; returns where their kernels' times were written."""
    from torch.profiler import ProfilerActivity, profile

    from costmodel.plan import PlanFile
    from runtime.train import RunConfig, init_distributed, run_rank
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed()
    pf = PlanFile.load(plan)
    config = RunConfig(steps=2, warmup=1, quiet=True, compile=compile)
    run_rank(pf, config)   # CUDA, cuBLAS and cuDNN warmed up (and the layer compiled) first
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        raw = run_rank(pf, config)
        torch.cuda.synchronize()
    print("timed steps (s):", raw["step_times_s"])
    table = prof.key_averages()
    print(table.table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=70))
    kernels = {e.key: (e.self_device_time_total, e.count) for e in table if e.self_device_time_total}
    written = out / f"kernels_{'compiled' if compile else 'eager'}.json"
    written.write_text(json.dumps(kernels, indent=0))
    dist.destroy_process_group()
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plan", type=Path, help="a single-GPU plan.json (gpu_check writes them)")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu-trace"))
    parser.add_argument("--compile", action="store_true", help="the layers compiled, as `planner run --compile`")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_trace: no CUDA device here; nothing to trace", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_shapes.json").write_text(json.dumps(shapes(), indent=1))
    kernels = trace(args.plan, args.out, args.compile)
    print(f"wrote {args.out / 'kernel_shapes.json'} and {kernels}; command: "
          + " ".join(["python benchmarks/gpu_trace.py", *sys.argv[1:]]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
