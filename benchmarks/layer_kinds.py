"""How fast each kind of kernel runs inside a training layer against a profile's curves: the
measurement `planner profile` makes on its probe layer (runtime.layer_ops; planner.probes
.layer_factors), here at the probe's shape and at the closed loop's hidden model's, so one can
see whether the probe's factors carry to a larger layer.

    python benchmarks/layer_kinds.py --profile PROFILE.toml [--repeats 5]

Per layer and dtype: its GEMM, SDPA and memory-bound kernels priced at the profile's curves
(costmodel.compute.layer_parts_s), timed in the layer's forward and backward (each kind's fastest of
--repeats passes, with the profile's threads per rank), and the price over the time (the factor a profile takes from the
probe layer). Llama-style layers only: a GPT layer's GeLU and dropout are priced per element
outside these kinds. The curves were measured when the profile was, the layers now: on a
shared machine the two moments' speeds differ, so compare the layers' factors with each other
more than with 1.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from costmodel.cluster import ClusterSpec, load_profile
from costmodel.compute import LAYER_KINDS, layer_parts_s
from costmodel.inputs import InputError
from costmodel.registry import llama_spec
from costmodel.specs import DType, TrainSpec
from planner.probes import LAYER_PROBE
from planner.space import Choice, build_plan
from runtime.layer_ops import layer_op_seconds
from runtime.profiler import DTYPES

# the closed loop's hidden model (benchmarks/closed_loop.py HIDDEN), one layer of it
HIDDEN_LAYER = llama_spec("hidden-llama-layer", layers=1, hidden=384, heads=6, kv_heads=2, ffn=1024, vocab=6000,
                          max_pos=512, source="benchmarks/closed_loop.py HIDDEN")
LAYERS = [(LAYER_PROBE.model, LAYER_PROBE.micro_batch_size, LAYER_PROBE.seq_len),
          (HIDDEN_LAYER, 2, 256), (HIDDEN_LAYER, 4, 256)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, required=True, help="a CPU profile written by `planner profile`")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per layer (default 5)")
    args = parser.parse_args()
    try:
        dev = load_profile(args.profile)
    except (InputError, OSError) as exc:
        sys.exit(f"layer_kinds: {exc}")
    torch.set_num_threads(max(dev.threads_per_rank, 1))   # as the profile's ranks timed its layer
    cluster = ClusterSpec(device=dev, num_nodes=1, devices_per_node=1)
    print(f"{'layer':28s} {'dtype':5s} " + "  ".join(f"{k + ' priced/measured ms (factor)':>34s}" for k in LAYER_KINDS))
    for model, mbs, seq in LAYERS:
        for dtype in (DType.FP32, DType.BF16):
            train = TrainSpec(seq_len=seq, global_batch_size=mbs, compute_dtype=dtype)
            plan = build_plan(model, train, cluster, Choice(micro_batch_size=mbs))
            priced = layer_parts_s(model, train, plan, dev)
            timed = layer_op_seconds(model, DTYPES[str(dtype)], mbs, seq, args.repeats)
            cells = [f"{1e3 * priced[k]:9.2f} / {1e3 * timed[k]:8.2f} ({priced[k] / timed[k]:4.2f})"
                     for k in LAYER_KINDS]
            print(f"{model.name + f' {mbs}x{seq}':28s} {str(dtype):5s} " + "  ".join(f"{c:>34s}" for c in cells))
    print(f"\ncommand: python benchmarks/layer_kinds.py --profile {args.profile} --repeats {args.repeats}")


if __name__ == "__main__":
    main()
