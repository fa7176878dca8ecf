"""Published expert recipes (planner/recipes.toml): the layout a framework's maintainers ship
for a model, with where it is written, and that layout placed on the cluster a user asks about
(data parallelism adapted to its size, the user's sequence length and global batch), or the one
line saying why it cannot be."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from costmodel.check import check_structure
from costmodel.hardware import ClusterSpec
from costmodel.inputs import UserError, dataclass_from_json
from costmodel.plan import Plan, Recompute
from costmodel.specs import DType, ModelSpec, TrainSpec
from planner.candidates import fp8_options
from planner.space import Choice, build_plan
from planner.targets import changes, name_for

RECIPES_PATH = Path(__file__).with_name("recipes.toml")


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    model: str            # the registry name it is for (`planner models`)
    framework: str
    name: str
    source: str           # repository, path and commit (or tag)
    says: str             # what the source says, in its own terms
    device: str           # the cluster it was written for
    num_gpus: int
    gpus_per_node: int
    tp: int
    pp: int
    vpp: int
    cp: int
    ep: int
    dp: int
    zero: int
    sp: bool
    recompute: str
    mbs: int
    gbs: int
    seq_len: int
    grad_dtype: str = "fp32"   # what its gradients are reduced in (Megatron's grad_reduce_in_fp32)
    ep_overlap: bool = False   # Megatron-Core's --overlap-moe-expert-parallel-comm (`--ep-overlap`)

    def __post_init__(self) -> None:
        if self.tp * self.pp * self.cp * self.dp != self.num_gpus:
            raise ValueError(f"tp*pp*cp*dp = {self.tp * self.pp * self.cp * self.dp} but num_gpus {self.num_gpus}")
        if self.recompute not in {r.value for r in Recompute}:
            raise ValueError(f"recompute {self.recompute!r} is not one of none, selective, full")
        if self.grad_dtype not in (dtypes := [d.value for d in DType]):
            raise ValueError(f"grad_dtype {self.grad_dtype!r} is not one of {', '.join(dtypes)}")
        if self.ep_overlap and (self.ep == 1 or self.framework != "megatron"):
            raise ValueError("ep_overlap is Megatron-Core's, for a recipe with expert parallelism")

    def layout(self) -> str:
        parts = [f"tp{self.tp}", f"pp{self.pp}"] + [f"{k}{v}" for k, v in
                                                      (("vpp", self.vpp), ("cp", self.cp), ("ep", self.ep)) if v > 1]
        return " ".join(parts + [f"z{self.zero}", f"mbs{self.mbs}"]
                        + ([] if self.recompute == "none" else [f"{self.recompute} recompute"]))


@lru_cache(maxsize=1)
def load_recipes(path: Path = RECIPES_PATH) -> tuple[Recipe, ...]:
    with open(path, "rb") as f:
        doc = tomllib.load(f)
    return tuple(dataclass_from_json(Recipe, entry, f"{path.name} recipe {i + 1}")
                 for i, entry in enumerate(doc.get("recipe", [])))


def recipes_for(model: ModelSpec) -> list[Recipe]:
    return [r for r in load_recipes() if r.model == model.name]


def place(recipe: Recipe, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec,
          fp8_linears: bool = False) -> tuple[Plan | None, str]:
    """The recipe's layout on `cluster` for `train`: tp, pp, vpp, cp, ep, ZeRO, recomputation and
    micro-batch size as written, dp = devices / (tp*pp*cp), its linears in float8 if asked
    (float8_variants says where they may be). Returns (plan, "") or (None, why it is not
    comparable here)."""
    inner = recipe.tp * recipe.pp * recipe.cp
    if cluster.is_mixed:
        return None, "a recipe is written for one kind of device; this cluster mixes several"
    if cluster.world_size % inner:
        return None, f"tp*pp*cp = {inner} does not divide this cluster's {cluster.world_size:,} devices"
    dp = cluster.world_size // inner
    if dp % recipe.ep and not cluster.framework.ep_folds_over_tp:   # a folding framework: check_structure says
        return None, f"ep{recipe.ep} is carved from data parallelism, and this cluster leaves dp{dp}"
    choice = Choice(tp=recipe.tp, pp=recipe.pp, cp=recipe.cp, dp=dp, ep=recipe.ep, zero_stage=recipe.zero,
                    recompute=Recompute(recipe.recompute), sequence_parallel=recipe.sp and recipe.tp > 1,
                    micro_batch_size=recipe.mbs, vpp=recipe.vpp, fp8_linears=fp8_linears)
    try:
        plan = build_plan(model, train, cluster, choice)
    except UserError as exc:
        return None, str(exc)
    if problems := check_structure(model, train, cluster, plan):
        return None, problems[0]
    if found := changes(name_for(cluster.framework), model, train, cluster, plan):
        return None, f"{name_for(cluster.framework)} would have to change it: {found[0]}"
    return plan, ""


def float8_variants(recipe: Recipe, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec) -> list[bool]:
    """The recipe's linears as the plans it is compared with may run theirs (the search's own
    choices, planner.candidates.fp8_options); the comparison prices each and keeps the faster
    that fits."""
    return fp8_options(model, train, cluster, recipe.tp)


def adapted(recipe: Recipe, train: TrainSpec, cluster: ClusterSpec, plan: Plan) -> str:
    """What changed from the recipe as written to the plan priced here (empty when nothing)."""
    changes = []
    if (cluster.world_size, cluster.device.name) != (recipe.num_gpus, recipe.device) and \
            not cluster.device.name.startswith(recipe.device):
        changes.append(f"written for {recipe.num_gpus:,} {recipe.device}")
    elif cluster.world_size != recipe.num_gpus:
        changes.append(f"written for {recipe.num_gpus:,} GPUs")
    if plan.dp != recipe.dp:
        changes.append(f"dp{recipe.dp} -> dp{plan.dp}")
    if (runs := name_for(cluster.framework)) != recipe.framework:   # the layout, not the framework, compared
        changes.append(f"a {recipe.framework} recipe priced as {runs} runs it, as the first plan is")
    if plan.fp8_linears:
        changes.append("its linears in float8 (--dtype fp8): faster than in bf16, or fitting where bf16 does not")
    if train.grad_dtype.value != recipe.grad_dtype:
        changes.append(f"priced with {train.grad_dtype.value} gradients (the recipe's: {recipe.grad_dtype}, "
                       f"--grad-dtype {recipe.grad_dtype})")
    if recipe.ep > 1 and cluster.framework.ep_a2a_overlap != recipe.ep_overlap:
        changes.append("priced without the expert all-to-all overlap its recipe runs (--ep-overlap)"
                       if recipe.ep_overlap else "priced with an expert all-to-all overlap its recipe leaves off")
    if (train.seq_len, train.global_batch_size) != (recipe.seq_len, recipe.gbs):
        changes.append(f"priced at seq {train.seq_len} x global batch {train.global_batch_size} "
                       f"(the recipe's: {recipe.seq_len} x {recipe.gbs})")
    return "; ".join(changes)
