"""DeepSpeed's ZeRO-3 parameter gathers as its coordinator runs them
(deepspeed/runtime/zero/partitioned_param_coordinator.py, `fetch_sub_module` and
`__params_to_release`; the same logic from 0.6 to 0.19). DeepSpeed hooks every module, in the
order the first step traced: a module's weights are gathered on demand unless a prefetch brought
them, and at every module's start, weightless ones included (the layer, its norms, whose small
weights persist, the attention and MLP blocks, the attention core), the next weights of the
trace are prefetched on the one gather stream: min(max_live - available, bucket) elements of them,
at least one weight where that is positive. A module's weights are released after it unless the
trace uses them again within fewer than max_reuse_distance parameters, or a prefetch passed their
next use while they were there. So the prefetch runs ahead a few weights per layer until the
live weights reach max_live (1e9 by default), and a weight of max_live or more blocks it.

FrameworkTraits.zero3_prefetch_bucket None is the whole-unit prefetch FSDP runs, which
costmodel.rank_time.dp_terms prices, and what planner.exports.deepspeed writes DeepSpeed's knobs
for; a published DeepSpeed run ran its own knobs, DeepSpeed's defaults unless it set them
(planner.measure.row_traits). Mixtures of experts are not walked: DeepSpeed's engine refuses them
under ZeRO-3.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from costmodel.comm import Collective, collective_time_s
from costmodel.flops import attention_core_forward_flops, linear_forward_flops
from costmodel.frameworks import FrameworkTraits, float8_params
from costmodel.hardware import ClusterSpec
from costmodel.layout import dense_blocks
from costmodel.params import linear_params
from costmodel.placement import AxisSpan
from costmodel.plan import Plan, Recompute
from costmodel.specs import ModelSpec, TrainSpec

# DeepSpeed's defaults (deepspeed/runtime/zero/config.py): stage3_prefetch_bucket_size (elements),
# stage3_max_live_parameters, stage3_max_reuse_distance
DEEPSPEED_PREFETCH_BUCKET = 50_000_000
DEEPSPEED_MAX_LIVE = 1_000_000_000
DEEPSPEED_MAX_REUSE = 1_000_000_000


@dataclass(frozen=True, slots=True)
class Use:
    """One module's run in the step's trace."""
    module: int        # which module of the rank (layer x its modules): weights gathered once are its
    params: int        # its weights on this device (0: a weightless module, the attention core among them)
    compute_s: float   # the run's compute


def coordinates(model: ModelSpec, plan: Plan, traits: FrameworkTraits) -> bool:
    """Whether the plan's ZeRO-3 gathers run as DeepSpeed's coordinator with the traits' knobs."""
    return plan.zero_stage == 3 and traits.zero3_prefetch_bucket is not None and not model.is_moe


# the weightless modules whose hooks run before a layer's attention projections (the layer, its
# norm, whose weights persist, the attention block) and before its MLP's (the norm, the MLP block)
HOOKS_BEFORE_ATTENTION, HOOKS_BEFORE_MLP = 3, 2


def layer_modules(model: ModelSpec, tp: int, num_sequences: int, seq_len: int) -> tuple[tuple[int, int], ...]:
    """(weights on this device, forward FLOPs) of one layer's hooked modules in forward order: the
    weightless ones before each block, the attention's projections with its core before the output
    projection, the MLP's projections."""
    tokens = num_sequences * seq_len
    out = []
    for block in dense_blocks(model):
        out += [(0, 0)] * (HOOKS_BEFORE_ATTENTION if block.name == "attention" else HOOKS_BEFORE_MLP)
        last = len(block.linears) - 1
        for i, lin in enumerate(block.linears):
            if block.name == "attention" and i == last:
                out.append((0, attention_core_forward_flops(model, num_sequences, seq_len) // tp))
            out.append((linear_params(lin, tp), linear_forward_flops(lin, tokens) // tp))
    return tuple(out)


EMBEDDING, HEAD = -1, -2   # the modules of a rank's embedding and head in a trace


def step_trace(model: ModelSpec, train: TrainSpec, plan: Plan, layers: int, times: tuple[float, float, float],
               edges: tuple[int, int] = (0, 0)) -> tuple[Use, ...]:
    """One micro-batch's modules on a rank of `layers` layers, `edges` its embedding's and head's
    weights: the forward pass, then per layer from the last its recomputed forward (full
    recomputation) and its backward in reverse. `times` (forward, backward, recompute per
    micro-batch) are shared over the layers' modules by their FLOPs; the edges' lookups and the
    head's GEMM, small beside them, run in that time."""
    forward_s, backward_s, recompute_s = times
    modules = layer_modules(model, plan.tp, plan.micro_batch_size, train.seq_len // plan.cp)
    total = sum(f for _, f in modules) * layers
    n = len(modules)

    def run(layer: int, pass_s: float, order) -> list[Use]:
        return [Use(layer * n + i, modules[i][0], pass_s * modules[i][1] / total) for i in order]

    embedding, head = (Use(EMBEDDING, edges[0], 0.0),) if edges[0] else (), (Use(HEAD, edges[1], 0.0),) if edges[1] else ()
    trace = [*embedding, *(u for layer in range(layers) for u in run(layer, forward_s, range(n))), *head, *head]
    for layer in reversed(range(layers)):
        if plan.recompute is Recompute.FULL:
            trace += run(layer, recompute_s, range(n))
        trace += run(layer, backward_s, reversed(range(n)))
    return tuple(trace + list(embedding))


@lru_cache(maxsize=512)
def _kept(trace: tuple[Use, ...], max_reuse: float) -> tuple[bool, ...]:
    """Per use, whether its weights stay for the module's next use: the trace uses fewer than
    max_reuse parameters in between (a module's last use releases them)."""
    prefix = [0]
    for use in trace:
        prefix.append(prefix[-1] + use.params)
    kept = [False] * len(trace)
    last: dict[int, int] = {}
    for k, use in enumerate(trace):
        if (before := last.get(use.module)) is not None:
            kept[before] = prefix[k] - prefix[before + 1] < max_reuse
        last[use.module] = k
    return tuple(kept)


@lru_cache(maxsize=512)
def walk(trace: tuple[Use, ...], gather_s: tuple[float, ...], bucket: float, max_live: float,
         max_reuse: float) -> tuple[float, int]:
    """(seconds the step's compute waits on gathers, the most weights live at once) over the
    trace, with `gather_s[k]` the all-gather of use k's weights."""
    kept = _kept(trace, max_reuse)
    there: set[int] = set()     # modules whose weights are gathered (or on their way)
    # a module whose later use the prefetch passed while its weights were there keeps them for
    # that use (DeepSpeed's __params_to_release: "don't release params whose reuse was skipped")
    pinned: dict[int, int] = {}
    arrival: dict[int, float] = {}
    t = stream = 0.0
    queue = 0     # the next use of the trace no fetch has taken yet
    live = peak = 0
    for k, use in enumerate(trace):
        if use.params and use.module not in there:   # fetched on demand
            stream = max(t, stream) + gather_s[k]
            arrival[use.module], live = stream, live + use.params
            there.add(use.module)
        t = max(t, arrival.get(use.module, t))
        queue = max(queue, k + 1)
        room, fetched = min(max_live - live, bucket), 0
        while room > 0 and fetched < room and queue < len(trace):
            nxt = trace[queue]
            queue += 1
            if nxt.params and nxt.module not in there:
                stream = max(t, stream) + gather_s[queue - 1]
                arrival[nxt.module], live, fetched = stream, live + nxt.params, fetched + nxt.params
                there.add(nxt.module)
            elif nxt.params:
                pinned[nxt.module] = queue - 1
        peak = max(peak, live)
        t += use.compute_s
        # released, to be gathered again at its next use (a prefetch that passed a later use keeps
        # them for it; DeepSpeed compares that use with its step counter, already at k + 1)
        if use.params and not kept[k] and pinned.get(use.module, -1) <= k + 1:
            there.discard(use.module)
            live -= use.params
    return t - sum(use.compute_s for use in trace), peak


def coordinator_wait_s(model: ModelSpec, train: TrainSpec, plan: Plan, cluster: ClusterSpec, shard: AxisSpan,
                       rank: int, times: tuple[float, float, float], edges: tuple[int, int]) -> float:
    """Seconds per micro-batch pipeline rank `rank` waits on its ZeRO-3 gathers over the shard
    group, each at the device's DP efficiency (costmodel.hardware.Efficiency.dp_comm), in the
    compute dtype or float8 where the framework gathers float8 weights."""
    traits = cluster.framework
    w = 1 if float8_params(plan, traits) else train.compute_dtype.num_bytes
    trace = step_trace(model, train, plan, plan.layers_on_rank(rank), times, edges)
    dp_comm = cluster.device.efficiency.dp_comm
    gather_s = tuple(collective_time_s(Collective.ALL_GATHER, w * use.params, shard, cluster) / dp_comm
                     if use.params else 0.0 for use in trace)
    return walk(trace, gather_s, traits.zero3_prefetch_bucket, traits.zero3_max_live, DEEPSPEED_MAX_REUSE)[0]


def live_params(model: ModelSpec, train: TrainSpec, plan: Plan, traits: FrameworkTraits, layers: int,
                edges: tuple[int, int]) -> int:
    """The most weights the coordinator holds gathered at once on a rank of `layers` layers (its
    prefetches follow the parameter counts, not the times)."""
    trace = step_trace(model, train, plan, layers, (0.0, 0.0, 0.0), edges)   # no times: none is read
    return walk(trace, tuple(0.0 for _ in trace), traits.zero3_prefetch_bucket, traits.zero3_max_live,
                DEEPSPEED_MAX_REUSE)[1]
