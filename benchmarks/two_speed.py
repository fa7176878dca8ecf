"""A two-speed "cluster" on one machine (issue 17, item 2): one rank at full speed, one held to
a share of a core by a CFS quota, planned as a mixed cluster and run; predicted vs measured.

    sudo python benchmarks/two_speed.py [--share 0.5] [--steps 4]

Needs a writable cgroup cpu controller (root; cgroup v1 `/sys/fs/cgroup/cpu` or v2 `cpu.max`):
elsewhere it says so and stops. It is a benchmark, not a test: CI has no such rights.

1. This machine's `local` profile (measured on first use) describes the fast group. The slow
   group's profile is that one with every rate scaled by the share (GEMM and memory-bound curves,
   peaks, per-kernel and optimizer costs): the profiler's microbenchmarks take the best of short
   calls, which a quota period of 10 ms lets through unthrottled, so it cannot measure the slow
   rank itself. The link between the groups is the node's own (both ranks share the machine).
2. The hidden Llama-style model of benchmarks/closed_loop.py, fp32, is searched on the mixed
   cluster `1x1xfast+1x1xslow` twice: with a pipeline (`--fix pp=2`, the layer split by speed)
   and without (`--fix pp=1`, replicas with their own micro-batch sizes).
3. Each plan runs on two forked ranks (gloo), the slow group's rank inside the quota; the same
   plans run once more with no quota, to show the slowdown is real.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

QUOTA_PERIOD_US = 10_000
LR = 1e-2
CGROUP_V1, CGROUP_V2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")


def make_cgroup(share: float) -> Path | None:
    """A cgroup whose processes together get `share` of one CPU; None where this cannot be made."""
    try:
        if (CGROUP_V1 / "cpu.cfs_quota_us").exists():
            group = CGROUP_V1 / "planner-two-speed"
            group.mkdir(exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(QUOTA_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(int(share * QUOTA_PERIOD_US)))
            return group
        if "cpu" in (CGROUP_V2 / "cgroup.controllers").read_text().split():
            group = CGROUP_V2 / "planner-two-speed"
            group.mkdir(exist_ok=True)
            (group / "cpu.max").write_text(f"{int(share * QUOTA_PERIOD_US)} {QUOTA_PERIOD_US}")
            return group
    except OSError:
        return None
    return None


def slowed(dev, share: float):
    """`dev` with every rate scaled by `share` (see the module docstring)."""
    eff = dev.efficiency
    return replace(
        dev, name=f"{dev.name}-at-{share:g}", path=f"{dev.path} x {share:g}",
        peak_flops=tuple((k, v * share) for k, v in dev.peak_flops),
        memory_bandwidth_bytes_per_s=dev.memory_bandwidth_bytes_per_s * share,
        gemm_curves=tuple((k, tuple((f, r * share) for f, r in c)) for k, c in dev.gemm_curves),
        memory_curve=tuple((b, r * share) for b, r in dev.memory_curve),
        efficiency=replace(eff, kernel_overhead_s=eff.kernel_overhead_s / share),
        dtype_efficiency=tuple((k, replace(e, kernel_overhead_s=e.kernel_overhead_s / share))
                               for k, e in dev.dtype_efficiency),
        optimizer_s_per_param=dev.optimizer_s_per_param / share,
        grad_accumulate_s_per_param=tuple((k, s / share) for k, s in dev.grad_accumulate_s_per_param),
        fsdp_sync_s_per_param=tuple((k, s / share) for k, s in dev.fsdp_sync_s_per_param),
        dropout_s_per_element=dev.dropout_s_per_element / share,
        gelu_s_per_element=tuple((k, f / share, b / share) for k, f, b in dev.gelu_s_per_element),
        sdpa_curves=tuple((k, tuple((s, d, t / share) for s, d, t in c)) for k, c in dev.sdpa_curves))


def _rank(pf, cfg, slow_group: int, cgroup: str | None):
    """One rank: into the quota when its node is the slow group's, one thread, then train."""
    import torch
    import torch.distributed as dist
    from costmodel.groups import node_groups
    from runtime.train import run_rank
    if cgroup and node_groups(pf.plan, pf.cluster)[dist.get_rank()] == slow_group:
        Path(cgroup, "cgroup.procs").write_text(str(os.getpid()))
    torch.set_num_threads(1)
    return run_rank(pf, cfg)


def measure(pf, steps: int, seed: int, slow_group: int, cgroup: Path | None) -> tuple[float, list[float]]:
    """(median step time, every step's loss, warm-up included)."""
    from runtime.fork import run_forked
    from runtime.train import RunConfig
    cfg = RunConfig(steps=steps, warmup=2, seed=seed, lr=LR, quiet=True)
    raw = run_forked(2, _rank, pf, cfg, slow_group, None if cgroup is None else str(cgroup))[0]
    return statistics.median(raw["step_times_s"]), raw["losses"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--share", type=float, default=0.5, help="the slow rank's share of a core (default 0.5)")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if not 0.05 <= args.share < 1:
        sys.exit("--share must be in [0.05, 1)")
    cgroup = make_cgroup(args.share)
    if cgroup is None:
        sys.exit("two_speed: needs a writable cgroup cpu controller (run as root where cgroups allow it); nothing run")
    here = Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent / "tests" / "runtime")]
    from closed_loop import HIDDEN
    from parity import SEED, reference   # the one-process reference the parity tests use
    from costmodel import machine
    from costmodel.cluster import DeviceGroup, local_profile, mixed_cluster
    from costmodel.estimate import estimate
    from costmodel.hf_config import model_from_hf_config
    from costmodel.plan import PlanFile
    from costmodel.specs import DType, TrainSpec
    from planner.commands.profile import measure_local
    from planner.search import SearchOptions, search
    start = time.perf_counter()
    try:
        fast = local_profile()
    except machine.LocalProfileMissing:   # not measured yet: once, as `--cluster 1x2xlocal` would
        measure_local()
        fast = local_profile()
    slow = slowed(fast, args.share)
    cluster = mixed_cluster([DeviceGroup(device=fast, num_nodes=1), DeviceGroup(device=slow, num_nodes=1)], 1)
    config = Path(tempfile.mkdtemp()) / "config.json"
    config.write_text(json.dumps(HIDDEN))
    model = model_from_hf_config(config)
    train = TrainSpec(seq_len=256, global_batch_size=8, compute_dtype=DType.FP32, grad_dtype=DType.FP32)
    print(f"two-speed cluster: rank of group 0 free, group 1 at {args.share:g} of a core ({cgroup})")
    print(f"{'plan':<44}{'predicted ms':>14}{'measured ms':>13}{'error %':>9}{'no quota ms':>13}"
          f"{'losses vs one process':>24}")
    errors = []
    for pp in (2, 1):
        result = search(model, train, cluster, SearchOptions(top_k=1, fixed={"pp": pp}))
        plan = result.plans[0].plan
        pf = PlanFile(plan=plan, model=model, train=train, cluster=cluster)
        predicted = estimate(model, train, cluster, plan).step_time_s
        measured, losses = measure(pf, args.steps, SEED, 1, cgroup)
        free, _ = measure(pf, args.steps, SEED, 1, None)
        ref, _ = reference(pf, steps=len(losses), lr=LR)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        errors.append(100 * (predicted - measured) / measured)
        where = f" layers {list(plan.layers_per_stage)}" if pp > 1 else ""
        print(f"{plan.short() + where:<44}{1e3 * predicted:>14.1f}{1e3 * measured:>13.1f}{errors[-1]:>+9.1f}"
              f"{1e3 * free:>13.1f}{f'max rel. diff {worst:.1e}':>24}")
    print(f"MAPE {statistics.mean(map(abs, errors)):.1f}%   max |error| {max(map(abs, errors)):.1f}%")
    print(f"\n{time.perf_counter() - start:.0f} s; command: python benchmarks/two_speed.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
