"""The Plan contract and `plan.json` (versioned, loaded strictly)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import Any

from costmodel.hardware import ClusterSpec, cluster_from_dict
from costmodel.inputs import UserError, dataclass_from_json, read_json_object, write_text_atomic
from costmodel.schedules import Schedule, owned_stages, stage_owner
from costmodel.specs import ModelSpec, TrainSpec

PLAN_FORMAT_VERSION = 1

AXES = ("pp", "dp", "cp", "tp")
DEFAULT_AXIS_ORDER = ("pp", "dp", "cp", "tp")  # outermost first: TP innermost, inside a node


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"  # attention core only (Korthikanti et al. 2022)
    FULL = "full"            # whole layer; only the layer input is kept


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """Every field concrete, no sentinels.

    `layers_per_stage` lists the transformer layers of each virtual stage in model order
    (pp x vpp entries); virtual stage j runs on pipeline rank `stage_rank(j)`.
    `recompute_num_layers[r]` says how many of pipeline rank r's layers run under `recompute`.
    `mesh_axis_order` names the mesh axes outermost first; the innermost axis gets adjacent ranks.
    `ep` (expert parallelism, mixtures of experts only) shards each layer's routed experts over
    groups of `ep` ranks: consecutive data-parallel ranks as our runtime carves them (an expert's
    gradients then reduced over the dp/ep ranks holding it, `edp`, with cp), or under a framework
    that folds EP (Megatron-Core) the ep innermost of the tp x cp x dp ranks
    (costmodel.placement.expert_layout, costmodel.params.expert_dp). Absent from a plan.json
    written before it existed: 1.
    `etp` (expert tensor parallelism, Megatron-Core's `--expert-tensor-parallel-size`) splits each
    routed expert's projections over `etp` ranks, column- then row-parallel as the dense MLP: the
    etp innermost ranks of the expert grid etp x ep x edp that re-decomposes tp x cp x dp
    (costmodel.placement.expert_layout); the routed rows are all-gathered over them before the
    experts and reduce-scattered after. Only where the framework has it (costmodel.frameworks
    `expert_tensor_parallel`). Absent from a plan.json (it is left out at 1): 1.
    `offload_optimizer` (ZeRO-Offload, Ren et al. 2021, as FSDP2's CPUOffloadPolicy runs it) keeps
    the sharded fp32 master weights, the optimizer moments and the reduced gradient shards in host
    memory and runs the optimizer step on the host's cores; each parameter gather copies the shard
    over PCIe, each gradient reduction copies it back. Needs ZeRO >= 1 (the sharded states are what
    moves) and a device profile with a [host]. Absent from older plan.json files: False.
    `fp8_linears`: the transformer layers' linear projections run their three GEMMs in float8 as
    torchao's tensorwise recipe does (e4m3 forward, e5m2 output gradients, one dynamic scale per
    tensor; the LM head, attention, norms and the states stay as they were); needs a device with
    float8 tensor cores and a TrainSpec that accepts float8. Absent from older plan.json: False.
    `offload_activations`: what the transformer layers save for backward (activations, not the
    weights) is copied to host memory as it is saved and back when backward needs it
    (saved-tensor hooks, pinned on CUDA): an alternative to recomputation, not combined with it,
    nor with zero-bubble schedules (their split backward reads each saved tensor twice). Absent
    from older plan.json: False.
    `group_order`: on a mixed cluster, the order in which its device groups take the ranks (a
    permutation of ClusterSpec.groups; costmodel.groups): the pipeline's stages run on the
    groups in that order. Empty (and absent from plan.json): the groups as the cluster lists them.
    `dp_replicate`: hybrid sharding (HSDP): ZeRO shards the states over dp / dp_replicate
    consecutive data-parallel ranks (with the cp ranks) and keeps dp_replicate replicas of each
    shard, the outer data-parallel axis; a gradient is reduce-scattered inside its shard group and
    the shard then all-reduced over the replicas (costmodel.rank_time.spans: `shard`, `replicas`).
    Only under a framework that runs it (costmodel.frameworks `hybrid_shard`), with ZeRO >= 1, on a
    dense model. Absent from a plan.json (left out at 1): 1, every data-parallel rank one shard.
    `micro_batch_sizes`: on a mixed cluster without a pipeline (pp = 1, each data-parallel
    replica inside one group), the micro-batch size of the replicas of each group (in
    ClusterSpec.groups order): every replica runs the same `num_micro_batches` (FSDP2's
    collectives are per micro-batch, so the counts must agree) and takes its group's share of the
    global batch; its loss is weighted by that share (costmodel.groups.replica_samples).
    `micro_batch_size` is then the largest of them. Empty (and absent from plan.json): every
    replica runs `micro_batch_size`.
    """

    dp: int
    tp: int
    pp: int
    cp: int
    zero_stage: int
    recompute: Recompute
    recompute_num_layers: tuple[int, ...]
    sequence_parallel: bool
    micro_batch_size: int
    num_micro_batches: int
    schedule: Schedule
    vpp: int
    layers_per_stage: tuple[int, ...]
    mesh_axis_order: tuple[str, ...]
    ep: int = 1
    etp: int = 1
    offload_optimizer: bool = False
    fp8_linears: bool = False
    offload_activations: bool = False
    group_order: tuple[int, ...] = ()
    micro_batch_sizes: tuple[int, ...] = ()
    dp_replicate: int = 1

    @property
    def edp(self) -> int:
        """Data-parallel ranks holding the same experts (the expert gradients' group)."""
        return self.dp // self.ep if self.ep > 0 else self.dp

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks a ZeRO shard group holds (dp without hybrid sharding)."""
        return self.dp // self.dp_replicate if self.dp_replicate > 0 else self.dp

    @property
    def zero_ranks(self) -> int:
        """Ranks over which ZeRO shards the replicated parameters' states: the shard group's
        data-parallel ranks times cp (context-parallel ranks hold the same weights)."""
        return self.dp_shard * self.cp

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def num_virtual_stages(self) -> int:
        return self.pp * self.vpp

    def stage_rank(self, virtual_stage: int) -> int:
        """Pipeline rank of a virtual stage: loop placement, or V placement (ZBV, DualPipeV)."""
        return stage_owner(virtual_stage, self.pp, self.schedule.traits.v_placement)

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """The virtual stages pipeline rank `rank` holds, in pipeline order."""
        return owned_stages(rank, self.pp, self.vpp, self.schedule.traits.v_placement)

    def layers_on_rank(self, rank: int) -> int:
        return _layers_by_rank(self)[rank]

    def recompute_per_stage(self, placement: str = "first") -> tuple[int, ...]:
        """Recomputed layers of each virtual stage, rank r recomputing recompute_num_layers[r] of
        its layers (costmodel.frameworks `recompute_placement`):
        - first: its first layers in model order (its stages in increasing order), as our runtime;
        - each_chunk: the same number at the start of each of its virtual stages (one layer of each
          in turn, a short stage's share going to the others), Megatron's block method;
        - every_nth: every n-th of its layers counted across its stages in order (n from
          every_nth_interval), torchtitan's layer-level checkpointing; `first` where no n says
          the counts."""
        stages: list[list[int]] = [[] for _ in range(self.pp)]
        for j in range(self.num_virtual_stages):
            stages[self.stage_rank(j)].append(j)
        out = [0] * self.num_virtual_stages
        interval = every_nth_interval(self) if placement == "every_nth" else None
        for r in range(self.pp):
            left = min(self.recompute_num_layers[r], sum(self.layers_per_stage[j] for j in stages[r]))
            if interval is not None:
                seen = 0
                for j in stages[r]:
                    out[j] = (seen + self.layers_per_stage[j]) // interval - seen // interval
                    seen += self.layers_per_stage[j]
            elif placement == "each_chunk":
                while left > 0:
                    for j in stages[r]:
                        if left > 0 and out[j] < self.layers_per_stage[j]:
                            out[j] += 1
                            left -= 1
            else:
                for j in stages[r]:
                    out[j] = min(self.layers_per_stage[j], left)
                    left -= out[j]
        return tuple(out)

    def degree(self, axis: str) -> int:
        return {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}[axis]

    def __str__(self) -> str:   # the label tables print; repr() keeps every field
        return self.short()

    def short(self) -> str:
        """One-line human summary, e.g. `dp8 tp8 pp1 z1 sel mbs1x128 1f1b` (`z3+offload`: optimizer
        states on the host)."""
        text = f"dp{self.dp} tp{self.tp}{'+sp' if self.sequence_parallel else ''} pp{self.pp}"
        if self.vpp > 1:
            text += f"x{self.vpp}v"
        if self.cp > 1:
            text += f" cp{self.cp}"
        if self.ep > 1:
            text += f" ep{self.ep}"
        if self.etp > 1:
            text += f" etp{self.etp}"
        rc = "" if self.recompute is Recompute.NONE else f" rc={self.recompute}"
        held = [self.layers_on_rank(r) for r in range(self.pp)]
        if self.recompute is not Recompute.NONE and len(set(self.recompute_num_layers)) > 1:
            rc += "[" + ",".join(map(str, self.recompute_num_layers)) + "]"
        elif self.recompute is not Recompute.NONE and list(self.recompute_num_layers) != held:
            # every rank recomputes the same part of its layers: said, so that `rc=full` means all
            rc += f":{self.recompute_num_layers[0]}/{held[0] if len(set(held)) == 1 else '/'.join(map(str, held))}"
        mesh = "" if self.mesh_axis_order == DEFAULT_AXIS_ORDER else " mesh=" + ">".join(self.mesh_axis_order)
        off = "+offload" if self.offload_optimizer else ""
        off += " fp8" if self.fp8_linears else ""
        off += " act-offload" if self.offload_activations else ""
        # hybrid sharding: replicas x shard group, after the ZeRO stage it shards
        off = (f" hsdp{self.dp_replicate}x{self.dp_shard}" if self.dp_replicate > 1 else "") + off
        mbs = "/".join(map(str, self.micro_batch_sizes)) if self.micro_batch_sizes else str(self.micro_batch_size)
        return (f"{text} z{self.zero_stage}{off}{rc} mbs{mbs}x{self.num_micro_batches}"
                f" {self.schedule}{mesh}")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["recompute"], out["schedule"] = str(self.recompute), str(self.schedule)
        for key in ("recompute_num_layers", "layers_per_stage", "mesh_axis_order", "group_order",
                    "micro_batch_sizes"):
            out[key] = list(out[key])
        for key in ("group_order", "micro_batch_sizes"):   # a uniform cluster's plan.json stays as older readers know it
            if not out[key]:
                del out[key]
        for key in ("etp", "dp_replicate"):   # so does a plan without expert TP or hybrid sharding
            if out[key] == 1:
                del out[key]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "plan") -> "Plan":
        return dataclass_from_json(cls, data, where)


@lru_cache(maxsize=65536)
def _layers_by_rank(plan: Plan) -> tuple[int, ...]:
    """Layers each pipeline rank holds (the search asks this hundreds of thousands of times)."""
    stages, pp = plan.layers_per_stage, plan.pp
    if not plan.schedule.traits.v_placement and len(stages) == pp * plan.vpp:  # loop placement
        return tuple(sum(stages[r::pp]) for r in range(pp))
    counts = [0] * pp
    for j, n in enumerate(stages):
        r = plan.stage_rank(j)
        if 0 <= r < pp:
            counts[r] += n
    return tuple(counts)


@lru_cache(maxsize=4096)
def every_nth_interval(plan: Plan) -> int | None:
    """n where every rank recomputes 1 in n of its layers (torchtitan's layer-level selective
    checkpointing, `selective_ac_option`: the n-th, 2n-th, ... layer a rank builds), the least
    such; 1 for all; None where no n says the plan's counts."""
    for n in range(1, max(plan.layers_on_rank(r) for r in range(plan.pp)) + 1):
        if all(c == plan.layers_on_rank(r) // n for r, c in enumerate(plan.recompute_num_layers)):
            return n
    return None


def embedding_loss_split(num_layers: int, num_stages: int, mtp_depth: int = 0) -> tuple[int, ...] | None:
    """Megatron-Core's split with the embedding and the loss each counted as a layer
    (`account_for_embedding_in_pipeline_split`, `account_for_loss_in_pipeline_split`): num_layers + 2
    units in equal (virtual) stages, the first and the last one layer short, as NeMo's Llama 3.1
    405B recipes run 126 layers on pp 8 x vpp 8; at one unit a stage the first and the last hold
    the embedding or the loss alone (the model zoo's Qwen3-235B: 94 layers on pp 32 x vpp 3).
    `mtp_depth` multi-token-prediction modules count as units of the last stage too, as
    Megatron-Core's explicit pipeline layout places them: NVIDIA's H100 recipes for DeepSeek-V3
    run its 61 layers, embedding, MTP module and loss as 64 units in 32 chunks, "Et|(tt|)*30mL"
    (Megatron-Bridge src/megatron/bridge/perf_recipes/deepseek/h100/deepseek_v3.py). None where
    the units do not divide equally, or a stage's units cannot hold the MTP modules and the loss."""
    units, rest = divmod(num_layers + 2 + mtp_depth, num_stages)
    if rest or units < 1 + mtp_depth or num_stages < 2:
        return None
    return (units - 1,) + (units,) * (num_stages - 2) + (units - 1 - mtp_depth,)


def virtual_stage_options(num_layers: int, pp: int, empty_ends: bool = False, mtp_depth: int = 0) -> list[int]:
    """Virtual stages per pipeline rank (vpp > 1) as Megatron-Core interleaves them: pp x vpp
    chunks of equal layers, or equal once the embedding and the loss (and a model's MTP modules)
    count as a layer each (embedding_loss_split); with `empty_ends` (the framework's
    `empty_end_stages`) also chunks whose first or last holds no layer beside those units."""
    if pp < 2:
        return []

    def loss_split(v: int, mtp: int) -> bool:
        split = embedding_loss_split(num_layers, pp * v, mtp)
        return split is not None and (empty_ends or min(split) >= 1)
    return [v for v in range(2, (num_layers + 2 + mtp_depth) // pp + 1)
            if num_layers % (pp * v) == 0 or loss_split(v, 0) or (mtp_depth > 0 and loss_split(v, mtp_depth))]


def even_layers(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Split layers as evenly as possible; the remainder goes to the middle stages, which carry
    neither the embedding nor the LM head."""
    base, extra = divmod(num_layers, num_stages)
    counts = [base] * num_stages
    order = sorted(range(num_stages), key=lambda j: (j in (0, num_stages - 1), abs(j - num_stages / 2)))
    for j in order[:extra]:
        counts[j] += 1
    return tuple(counts)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanFile:
    """What `plan.json` holds: the plan and the specs it was made for."""

    plan: Plan
    model: ModelSpec
    train: TrainSpec
    cluster: ClusterSpec

    def to_dict(self) -> dict[str, Any]:
        return {"version": PLAN_FORMAT_VERSION, "plan": self.plan.to_dict(),
                "model": self.model.to_dict(), "train": self.train.to_dict(),
                "cluster": self.cluster.to_dict()}

    def save(self, path: Path) -> None:
        """plan.json for tests and scripts, replacing `path`. No command writes through it: the
        command line publishes every output through planner.outputs (strict JSON, never over a
        file that appeared meanwhile), which this package cannot import."""
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "plan file") -> "PlanFile":
        expected = {"version", "plan", "model", "train", "cluster"}
        if set(data) != expected:
            raise UserError(f"{where}: expected keys {sorted(expected)}, got {sorted(data)}")
        if data["version"] != PLAN_FORMAT_VERSION:
            raise UserError(f"{where}: version {data['version']!r} is not supported "
                             f"(this planner reads version {PLAN_FORMAT_VERSION})")
        return cls(plan=Plan.from_dict(data["plan"], f"{where}: plan"),
                   model=ModelSpec.from_dict(data["model"], f"{where}: model"),
                   train=TrainSpec.from_dict(data["train"], f"{where}: train"),
                   cluster=cluster_from_dict(data["cluster"], f"{where}: cluster"))

    @classmethod
    def load(cls, path: Path) -> "PlanFile":
        return cls.from_dict(read_json_object(path, "plan file"), str(path))
