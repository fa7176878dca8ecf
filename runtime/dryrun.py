"""`planner run plan.json --dry-run`: build the real model's share on the meta device for the
first rank of every pipeline stage, under a fake process group of the plan's full world size,
and compare the states it holds with the cost model's memory ledger.

What is counted is what torch actually allocated: TP-local parameter elements after
`parallelize_module` and the FSDP2 shard each rank keeps, priced per element by
`costmodel.memory.state_bytes_from_counts` with the runtime's traits (the fp32 shard is the
master weight; 16-bit copies held below ZeRO-3; whole gradients under a pipeline). Offloaded
states are counted where FSDP2 put them: the shard elements of every parameter whose FSDP2
parameter says it lives on the host, priced by `costmodel.memory.host_state_bytes`.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from costmodel.estimate import host_state_bytes_per_rank, memory_per_rank
from costmodel.frameworks import RUNTIME
from costmodel.groups import representative
from costmodel.memory import host_state_bytes, state_bytes_from_counts
from costmodel.placement import axis_strides
from costmodel.plan import PlanFile
from runtime.job import build_job
from runtime.measure import error_pct
from runtime.moe import Experts
from runtime.parallel import local_tensor


def first_rank_of_stage(pf: PlanFile, pp_rank: int) -> int:
    """Global rank at mesh coordinates (pp = pp_rank, every other axis 0): the placement rule."""
    order = pf.plan.mesh_axis_order
    return pp_rank * axis_strides(order, tuple(pf.plan.degree(a) for a in order))["pp"]


def _count(module: torch.nn.Module) -> dict[str, int]:
    """Elements this rank holds of the module's parameters: routed experts apart (their ZeRO
    group is edp, not dp)."""
    experts = {id(p) for m in module.modules() if isinstance(m, Experts) for p in m.parameters()}
    out = {"replicated": 0, "experts": 0}
    for p in module.parameters():
        out["experts" if id(p) in experts else "replicated"] += local_tensor(p).numel()
    return out


def _offloaded(module: torch.nn.Module) -> int:
    """Shard elements FSDP2 keeps on the host (CPUOffloadPolicy) in the module's units."""
    from torch.distributed.fsdp import FSDPModule
    groups = {}   # by identity: the layers of one unit (runtime.parallel.fsdp_units) share its group
    for sub in module.modules():
        group = sub._get_fsdp_state()._fsdp_param_group if isinstance(sub, FSDPModule) else None
        if group is not None:
            groups[id(group)] = group
    return sum(local_tensor(fp.sharded_param).numel() for group in groups.values()
               for fp in group.fsdp_params if fp.offload_to_cpu)


def _count_rank(pf: PlanFile, rank: int) -> dict[str, dict[str, int]]:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=pf.plan.world_size)
    try:
        unsharded: dict[int, dict[str, int]] = {}

        def count(stage: int, module: torch.nn.Module) -> None:
            unsharded[stage] = _count(module)

        job = build_job(pf, torch.device("cpu"), seed=0, materialize=False, before_data_parallel=count)
        shard = {"replicated": 0, "experts": 0}
        for mod in job.modules.values():
            for kind, n in _count(mod).items():
                shard[kind] += n
        assert all(p.device.type == "meta" for p in job.parameters())
        return {"unsharded": {kind: sum(c[kind] for c in unsharded.values()) for kind in shard}, "shard": shard,
                "host": {"offloaded": sum(_offloaded(mod) for mod in job.modules.values())}}
    finally:
        dist.destroy_process_group()


def dry_run(pf: PlanFile) -> list[dict[str, Any]]:
    """Per pipeline stage: runtime-counted vs predicted parameter, gradient, optimizer bytes."""
    plan, train = pf.plan, pf.train
    predicted = memory_per_rank(pf.model, *representative(train, pf.cluster, plan))   # states: alike in every group
    predicted_host = host_state_bytes_per_rank(pf.model, train, plan, pf.cluster.framework)   # what FSDP2 places
    rows = []
    for pp_rank in range(plan.pp):
        rank = first_rank_of_stage(pf, pp_rank)
        n = _count_rank(pf, rank)
        # the counted elements through the one state formula, with our runtime's traits
        states = [state_bytes_from_counts(train, plan, n["unsharded"][kind], n["shard"][kind], RUNTIME)
                  for kind in ("replicated", "experts")]
        params, grads, optim = (sum(parts) for parts in zip(*states))
        runtime = {"params": params, "grads": grads, "optimizer": optim}
        pred = predicted[pp_rank].to_dict()
        if plan.offload_optimizer:
            runtime["host"] = host_state_bytes(train, plan, n["host"]["offloaded"])
            pred["host"] = predicted_host[pp_rank]
        rows.append({"stage": pp_rank, "rank": rank, "elements_unsharded": sum(n["unsharded"].values()),
                     "elements_shard": sum(n["shard"].values()),
                     **{f"{k}_bytes": {"runtime": v, "predicted": pred[k], "error_pct": _error_pct(v, pred[k])}
                        for k, v in runtime.items()}})
    return rows


def _error_pct(runtime: float, predicted: float) -> float | None:
    """runtime.measure.error_pct, and 0 where both are nothing: None where nothing was predicted
    but the runtime holds something, which no relative error says (the table shows the difference)."""
    return 0.0 if runtime == predicted == 0 else error_pct(runtime, predicted)
