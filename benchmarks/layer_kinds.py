"""How fast each kind of kernel runs inside a training layer against a profile's curves: the
measurement `planner profile` makes on its probe layer (runtime.layer_ops; planner.probes
.layer_factors), here at the probe's shape and at the closed loop's hidden model's, so one can
see whether the probe's factors carry to a larger layer.

    python benchmarks/layer_kinds.py --profile PROFILE.toml [--repeats 5]

Per layer and dtype: its GEMM, SDPA and memory-bound kernels priced at the profile's curves
(costmodel.compute.layer_parts_s), timed in the layer's forward and backward (each kind's
fastest of --repeats passes, with the profile's threads per rank), and the price over the time.
First the profile's own timing ([measured] layer_ops, "profiled"): the GEMM and memory factors it
holds, and SDPA's, which the pricing does not use. Then the layers timed now ("now"): the curves
were measured when the profile was, so on a shared machine the two moments' speeds differ;
compare the layers' factors with each other more than with 1. Llama-style layers only: a GPT
layer's GeLU and dropout are priced per element outside these kinds.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import tomllib

from costmodel.cluster import load_profile
from costmodel.compute import LAYER_KINDS
from costmodel.inputs import InputError
from costmodel.registry import llama_spec
from costmodel.specs import DType
from planner.probes import LAYER_PROBE, LayerTiming, layer_priced_s, unfitted
from runtime.layer_ops import layer_op_seconds
from runtime.profiler import DTYPES

# the closed loop's hidden model (benchmarks/closed_loop.py HIDDEN), one layer of it
HIDDEN_LAYER = llama_spec("hidden-llama-layer", layers=1, hidden=384, heads=6, kv_heads=2, ffn=1024, vocab=6000,
                          max_pos=512, source="benchmarks/closed_loop.py HIDDEN")
LAYERS = [(LAYER_PROBE.model, LAYER_PROBE.micro_batch_size, LAYER_PROBE.seq_len),
          (HIDDEN_LAYER, 2, 256), (HIDDEN_LAYER, 4, 256)]


def _row(label: str, dtype: str, priced: dict[str, float], timed: dict[str, float]) -> None:
    cells = [f"{1e3 * priced[k]:9.2f} / {1e3 * timed[k]:8.2f} ({priced[k] / timed[k]:4.2f})" for k in LAYER_KINDS]
    print(f"{label:34s} {dtype:5s} " + "  ".join(f"{c:>34s}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True, help="a CPU profile written by `planner profile`")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per layer (default 5)")
    args = parser.parse_args()
    try:
        dev = load_profile(args.profile)
        stored = tomllib.loads(args.profile.read_text())["measured"].get("layer_ops", {})
        timings = {d: LayerTiming.parse(e, f"{args.profile}: [measured] layer_ops.{d}") for d, e in stored.items()}
    except (InputError, OSError, KeyError, ValueError) as exc:
        sys.exit(f"layer_kinds: {exc}")
    torch.set_num_threads(max(dev.threads_per_rank, 1))   # as the profile's ranks timed its layer
    print(f"{'layer':34s} {'dtype':5s} " + "  ".join(f"{k + ' priced/measured ms (factor)':>34s}" for k in LAYER_KINDS))
    # the profile's own timing first: what its factors were taken from, at profile time
    base = unfitted(dev, tomllib.loads(args.profile.read_text())["measured"])
    for dtype, t in timings.items():
        priced = layer_priced_s(t.model, dtype, t.micro_batch_size, t.seq_len, base)
        _row(f"{t.model.name} {t.micro_batch_size}x{t.seq_len} (profiled)", dtype, priced, dict(t.seconds))
    for model, mbs, seq in LAYERS:
        for dtype in (DType.FP32, DType.BF16):
            priced = layer_priced_s(model, str(dtype), mbs, seq, base)
            _row(f"{model.name} {mbs}x{seq} (now)", str(dtype), priced,
                 layer_op_seconds(model, DTYPES[str(dtype)], mbs, seq, args.repeats))
    print(f"\ncommand: python benchmarks/layer_kinds.py --profile {args.profile} --repeats {args.repeats}")


if __name__ == "__main__":
    main()
