"""The rules a plan's parallel degrees obey against the model, the sequence and the framework:
TP, CP, SP, hybrid sharding, expert and expert-tensor parallelism. costmodel.check applies
them to a plan; the search enumerates from them (planner.candidates asks these, not copies of them)."""
from __future__ import annotations

from costmodel.frameworks import RUNTIME, FrameworkTraits, shards_in_part
from costmodel.memory.dispatcher import DEEPEP_NVL_PEERS, DEEPEP_RECV_ROWS, uses_per_node_dispatcher
from costmodel.placement import expert_layout
from costmodel.plan import AXES, DEFAULT_AXIS_ORDER
from costmodel.specs import ModelSpec, TrainSpec


def tp_problems(model: ModelSpec, tp: int) -> list[str]:
    return [f"tp={tp} does not divide the model's {what} ({n})"
            for what, n in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads),
                            ("ffn_hidden_size", model.ffn_hidden_size)) if n % tp]


def moe_tp_problem(model: ModelSpec, tp: int, sequence_parallel: bool) -> str | None:
    """Experts are not split over TP (expert TP 1): each TP rank routes its own sequence shard,
    which needs sequence parallelism (without it every TP rank would train on the same tokens)."""
    if model.is_moe and tp > 1 and not sequence_parallel:
        return f"tp={tp} with experts needs sequence parallelism (each TP rank routes its sequence shard)"
    return None


def cp_problems(model: ModelSpec, train: TrainSpec, cp: int) -> list[str]:
    # runtime.context_parallel cuts each sequence into 2·cp chunks (causal load balance)
    return [f"cp={cp} needs seq_len {train.seq_len} to split into 2*cp = {2 * cp} equal chunks"] \
        if cp > 1 and train.seq_len % (2 * cp) else []


def shared_expert_tp_problems(model: ModelSpec, tp: int, traits: FrameworkTraits) -> list[str]:
    """A framework that splits the shared expert over the TP group (`shared_expert_tp`:
    Megatron-Core's column-parallel fc1 divides its width by tp, as torchtitan's colwise split)."""
    width = model.shared_expert_ffn_hidden_size
    if traits.shared_expert_tp and width and width % tp:
        return [f"tp={tp} does not divide the shared expert's width {width}, which {traits.name} splits over "
                "tensor-parallel ranks"]
    return []


def mtp_cp_problems(model: ModelSpec, cp: int, traits: FrameworkTraits) -> list[str]:
    """Multi-token prediction shifts its labels by one token per depth; under context parallelism
    the shift crosses the CP chunks, which only a framework that exchanges them runs."""
    if model.mtp_depth and cp > 1 and not traits.mtp_with_cp:
        return [f"cp={cp} with multi-token prediction: {traits.name} does not shift its labels "
                "across the context-parallel chunks (Megatron-Core does: --framework megatron)"]
    return []


def hsdp_problems(model: ModelSpec, dp: int, dp_replicate: int, zero_stage: int,
                  traits: FrameworkTraits) -> list[str]:
    """Hybrid sharding (Plan.dp_replicate): replicas of ZeRO shard groups of dp / dp_replicate
    data-parallel ranks each, under a framework that runs it (`hybrid_shard`)."""
    if dp_replicate == 1:
        return []
    what = f"dp_replicate={dp_replicate} (hybrid sharding)"
    if traits.partial_distributed_optimizer and not traits.hybrid_shard and zero_stage != 1:
        return [f"{what}: {traits.name} shards over part of the data-parallel ranks at ZeRO-1 only "
                f"(zero_stage {zero_stage})"]
    if not shards_in_part(traits, zero_stage):
        return [f"{what}: {traits.name} does not shard over part of the data-parallel ranks "
                "(torchtitan, FSDP frameworks, Megatron-Core at ZeRO-1 and this planner's runtime do)"]
    if dp % dp_replicate or dp == dp_replicate:
        return [f"{what} must divide dp={dp} and leave a shard group of at least 2 ranks"]
    if zero_stage < 1:
        return [f"{what} needs ZeRO >= 1 (zero_stage {zero_stage} shards nothing)"]
    if model.is_moe:
        return [f"{what} with experts: the experts' hybrid sharding is not modelled"]
    return []


def etp_problems(model: ModelSpec, etp: int, traits: FrameworkTraits) -> list[str]:
    """Expert tensor parallelism (Plan.etp) splits each routed expert's width over etp ranks,
    where the framework has it (costmodel.frameworks `expert_tensor_parallel`). The shared
    expert is not split by it: Megatron-Core splits it over the dense TP group (SharedExpertMLP
    takes pg_collection.tp)."""
    if etp == 1:
        return []
    if not traits.expert_tensor_parallel:
        return [f"etp={etp}: {traits.name} does not split experts over tensor-parallel ranks "
                "(Megatron-Core does: --framework megatron)"]
    if not model.is_moe:
        return [f"etp={etp}: expert tensor parallelism needs a mixture of experts ({model.name} is dense)"]
    if model.moe_ffn_hidden_size % etp:
        return [f"etp={etp} does not divide the experts' width moe_ffn_hidden_size={model.moe_ffn_hidden_size}"]
    return []


def ep_problems(model: ModelSpec, ep: int, *, dp: int, tp: int = 1, cp: int = 1, pp: int = 1,
                order: tuple[str, ...] = DEFAULT_AXIS_ORDER, traits: FrameworkTraits = RUNTIME,
                etp: int = 1) -> list[str]:
    """Experts are sharded over `ep` ranks, each holding num_experts/ep (their ZeRO group: the
    ranks holding the same ones, params.expert_dp), each split over `etp` ranks (etp_problems).
    The ranks as the framework lays them out (placement.expert_layout): carved from data
    parallelism, or folded over TP, CP and DP."""
    out = etp_problems(model, etp, traits)
    if ep == 1 and (etp == 1 or out):
        return out
    if not model.is_moe:
        return [f"ep={ep}: expert parallelism needs a mixture of experts ({model.name} is dense)"]
    if model.num_experts % ep:
        out.append(f"ep={ep} does not divide the model's {model.num_experts} experts")
    if etp > 1 and out:
        return out
    order = order if sorted(order) == sorted(AXES) else DEFAULT_AXIS_ORDER   # a bad order: said apart
    degrees = tuple({"pp": pp, "dp": dp, "cp": cp, "tp": tp}[a] for a in order)
    if expert_layout(order, degrees, ep, traits.ep_folds_over_tp, etp) is not None:
        return out
    grid = f"etp x ep = {etp} x {ep}" if etp > 1 else f"ep={ep}"
    if not traits.ep_folds_over_tp:
        out.append(f"ep={ep} does not divide dp={dp}: {traits.name} carves the expert-parallel group from the "
                   "data-parallel one (Megatron-Core folds it over TP x CP x DP: --framework megatron)")
    elif etp * ep > tp * cp * dp:
        out.append(f"{grid} is more than the tp x cp x dp = {tp * cp * dp} ranks of a pipeline stage")
    else:
        inner = " x ".join(f"{a}{d}" for a, d in reversed(list(zip(order, degrees))) if d > 1)
        what = "the etp innermost ranks, then the next ep" if etp > 1 else "the ep innermost ranks"
        out.append(f"{grid} does not fold over {inner} ({traits.name} takes {what}: whole "
                   "axes, then a divisor of the next, never part of the pipeline, and all of the ranks inside it "
                   "where ranks lie outside it)")
    return out


def dispatcher_problems(model: ModelSpec, ep: int, etp: int, traits: FrameworkTraits,
                        devices_per_node: int) -> list[str]:
    """An expert group the framework runs with DeepEP (memory.dispatcher.uses_per_node_dispatcher)
    has a size DeepEP has a configuration for (it refuses others at start-up) and, across nodes,
    nodes of 8 GPUs: its kernels take ranks r and r + 1 .. r + 7 for one node's NVLink peers
    (LEGACY_NUM_MAX_NVL_PEERS), so a group over nodes of fewer would reach another node by IPC."""
    group = ep * etp
    if not uses_per_node_dispatcher(model, traits, group, devices_per_node):
        return []
    grid = f"etp x ep = {etp} x {ep}" if etp > 1 else f"ep={ep}"
    if group not in DEEPEP_RECV_ROWS:
        sizes = ", ".join(map(str, DEEPEP_RECV_ROWS))
        return [f"{grid}: {traits.name} runs this expert group with DeepEP (the flex dispatcher), which runs "
                f"groups of {sizes} ranks only"]
    if group > devices_per_node and devices_per_node < DEEPEP_NVL_PEERS:
        return [f"{grid}: {traits.name} runs this expert group with DeepEP (the flex dispatcher), whose kernels "
                f"across nodes take nodes of {DEEPEP_NVL_PEERS} GPUs, not {devices_per_node}: use an expert group "
                f"within a node (etp x ep <= {devices_per_node})"]
    return []


def sp_problems(train: TrainSpec, tp: int, cp: int) -> list[str]:
    if tp == 1:
        return ["sequence parallelism needs tp > 1"]
    local = train.seq_len // cp
    return [f"sequence parallelism needs tp={tp} to divide the local sequence {local}"] if local % tp else []
