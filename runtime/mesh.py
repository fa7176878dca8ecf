"""The world device mesh a plan runs on, and the sub-meshes each kind of parallelism takes.

Dims in the plan's axis order, outermost first: the same row-major rank layout
costmodel.placement prices. A plan axis an expert-parallel group or hybrid sharding cuts is two
world-mesh dims (`<axis>_out`, `<axis>_in`), flattened back under its own name; "ep", "etp" and
"edp" (the ranks holding the same expert shards) are flattened from their dims; the unit dims
keep a group that may have one member (ZeRO-0's shard group, an edp group) a mesh dim.
"""
from __future__ import annotations

import warnings

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from costmodel.placement import ExpertLayout, expert_layout, hybrid_layout
from costmodel.plan import Plan

UNIT_AXIS = "dp_unit"   # size-1 shard axis that turns FSDP2 into plain replication (ZeRO-0)
EP_UNIT_AXIS = "ep_unit"   # size-1 dim in every "edp" group, so that one is never empty


def expert_layout_for(plan: Plan, fold: bool) -> ExpertLayout | None:
    """The plan's expert-parallel and expert-TP groups (costmodel.placement.expert_layout, the
    layout the cost model prices): carved from dp, or folded over tp x cp x dp where `fold` (the
    framework's `ep_folds_over_tp`; expert TP needs it); None without either."""
    if plan.ep * plan.etp == 1:
        return None
    order = plan.mesh_axis_order
    layout = expert_layout(order, tuple(plan.degree(a) for a in order), plan.ep, fold, plan.etp)
    assert layout is not None, \
        f"etp x ep = {plan.etp} x {plan.ep} has no layout over {order} (check_structure refuses it)"
    return layout


def _root_name(axis: str) -> str:
    """A world-mesh dim of a cut layout's axis (expert parallelism, hybrid sharding): a cut plan
    axis as `<axis>_out`, `<axis>_in` (the carved layout's edp and ep are dp's outer and inner
    parts)."""
    return {"edp": "dp_out", "ep": "dp_in"}.get(axis, axis.replace(".", "_"))


def mesh_layout(plan: Plan, fold: bool = False) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(axis names, sizes) of the world mesh, outermost first: the plan's axes, each one an
    expert-parallel group cuts as two (expert_layout_for), and the free unit axes."""
    layout = expert_layout_for(plan, fold)
    if layout is None and plan.dp_replicate > 1:   # hybrid sharding: the replicas outer, the shard group inner
        order = plan.mesh_axis_order
        names, sizes = hybrid_layout(order, tuple(plan.degree(a) for a in order), plan.dp_replicate)
        return (*map(_root_name, names), UNIT_AXIS), (*sizes, 1)
    if layout is None:
        order = plan.mesh_axis_order
        return (*order, UNIT_AXIS), (*(plan.degree(a) for a in order), 1)
    return (*map(_root_name, layout.order), EP_UNIT_AXIS, UNIT_AXIS), (*layout.degrees, 1, 1)


def build_mesh(plan: Plan, device_type: str, fold: bool = False) -> DeviceMesh:
    """The world mesh in the plan's axis order (outermost first), the same row-major rank layout
    `costmodel.placement` prices. Under expert parallelism a cut plan axis is its two parts
    flattened, "ep" the expert-parallel group's dims flattened (where ep > 1), "etp" the expert-TP
    group's (where etp > 1) and "edp" those of the ranks holding the same expert shards (with a
    unit dim, so never empty)."""
    names, shape = mesh_layout(plan, fold)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    for axis in plan.mesh_axis_order:   # a plan axis cut in two (EP, hybrid sharding): its parts as one
        if axis not in names:
            mesh[root_dims(mesh, axis)]._flatten(axis)
    layout = expert_layout_for(plan, fold)
    if layout is not None:
        for group, axes in (("ep", layout.ep_axes), ("etp", layout.etp_axes)):
            if axes:
                mesh[in_root_order(mesh, *map(_root_name, axes))]._flatten(group)
        mesh[in_root_order(mesh, *map(_root_name, layout.edp_axes), EP_UNIT_AXIS)]._flatten("edp")
    return mesh


def root_dims(mesh: DeviceMesh, axis: str) -> tuple[str, ...]:
    """The world mesh's dims of a plan axis: itself, or its two parts where EP cut it."""
    return (axis,) if axis in mesh.mesh_dim_names else (f"{axis}_out", f"{axis}_in")


def mesh_coords(mesh: DeviceMesh, plan: Plan) -> dict[str, int]:
    """This rank's coordinate on each of the plan's axes."""
    return {axis: sliced_mesh(mesh, axis).get_local_rank() for axis in plan.mesh_axis_order}


def sliced_mesh(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """The sub-mesh of these dims (one name: that dim's 1-D mesh)."""
    with warnings.catch_warnings():   # slicing a flattened dim from the root: fine in 2.13
        warnings.filterwarnings("ignore", message=".*flattened dim.*")
        return mesh[names if len(names) > 1 else names[0]]


def dp_mesh_for(mesh: DeviceMesh, plan: Plan) -> DeviceMesh:
    """ZeRO shards over dp x cp (CP ranks hold the same weights), as costmodel.memory counts;
    under hybrid sharding (Plan.dp_replicate) over the shard group's dp_in x cp ranks, the dp_out
    replicas the outer dim of FSDP2's 2-D mesh (HSDP: reduce-scatter inside the shard group, then
    all-reduce over the replicas)."""
    if plan.dp_replicate > 1:
        if plan.cp == 1:
            return sliced_mesh(mesh, "dp_out", "dp_in")
        mesh[in_root_order(mesh, "dp_in", "cp")]._flatten("dp_in_cp")
        return sliced_mesh(mesh, "dp_out", "dp_in_cp")
    if plan.cp == 1:
        return sliced_mesh(mesh, "dp", UNIT_AXIS) if plan.zero_stage == 0 else sliced_mesh(mesh, "dp")
    flat = mesh[in_root_order(mesh, "dp", "cp")]._flatten("dp_cp")
    return flat if plan.zero_stage > 0 else sliced_mesh(mesh, "dp_cp", UNIT_AXIS)


def expert_dp_mesh_for(mesh: DeviceMesh, plan: Plan) -> DeviceMesh:
    """The experts' ZeRO group: the ranks holding the same experts (build_mesh's "edp": edp x cp
    where EP is carved from dp, the rest of tp x cp x dp where it folds), as costmodel.memory
    counts (params.expert_dp)."""
    return sliced_mesh(mesh, "edp") if plan.zero_stage > 0 else sliced_mesh(mesh, "edp", UNIT_AXIS)


def in_root_order(mesh: DeviceMesh, *names: str) -> tuple[str, ...]:
    """Mesh dims as a slice must name them: the world mesh's own dims (a plan axis EP cut as its
    two parts, root_dims), in its order (the plan's mesh order)."""
    dims = [d for name in names for d in root_dims(mesh, name)]
    return tuple(sorted(dims, key=mesh.mesh_dim_names.index))
