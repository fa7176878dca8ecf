"""What many of a search's candidates share, computed once (SharedModels: rank time models,
ZeRO floors, memory fits; what the search produces is planner.search_result's)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from costmodel.check import check_structure
from costmodel.frameworks import shards_in_part
from costmodel.groups import rank_caps_bytes, rank_groups, views
from costmodel.hardware import ClusterSpec
from costmodel.memory import keeps_whole_grads_under_pp, reserved_bytes
from costmodel.plan import Plan
from costmodel.rank_time import RankTimeModel, Spans, fastest_of, rank_time_model, spans
from costmodel.rank_time.ep_overlap import ep_overlap_factor, ep_overlap_floor_factor
from costmodel.rank_time.parts import TimeShape, rank_time_parts
from costmodel.rank_time.times import parts_time_model
from costmodel.schedules import Schedule
from costmodel.specs import ModelSpec, TrainSpec
from planner.bounds import (
    MemoryFit,
    optimizer_floor_s,
    pipeline_floor_s,
    slowest_rank_floor_s,
    states_floor,
    time_floor_s,
    zero_floor_s,
)
from planner.candidates import Group, hybrid_zero_stage
from planner.dense_spreads import least_memory_shapes_by_zero, least_pipeline_rows, reachable, spread_memory_shapes
from planner.search_options import (
    STATE_OPTIONS,
    SearchOptions,
    States,
    reason_key,
    replicas_beside_parallelism,
    states_allowed,
    states_for_group,
)
from planner.space import Choice, build_plan, degrees_plan


@dataclass(frozen=True, slots=True)
class TimedChoice:
    rtm: RankTimeModel  # priced with one virtual stage (RankTimeModel.with_schedule reads a plan's)
    zero_floors_s: tuple[float, ...]  # planner.bounds.zero_floor_s per state placement (STATE_OPTIONS)
    slowest_floor_s: float = 0.0      # a mixed cluster's planner.bounds.slowest_rank_floor_s


class SharedModels:
    """What many candidates of one search share, computed once: the rank time model (it does
    not depend on the ZeRO stage or the schedule, and on the virtual stages only through the
    pipeline sends), the ZeRO floor, and the memory shapes (they do not depend on placement)."""

    def __init__(self, model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, options: SearchOptions) -> None:
        self.model, self.train, self.cluster, self.options = model, train, cluster, options
        self.zero_allowed = states_allowed(options, cluster)   # per STATE_OPTIONS entry
        # ZeRO-2 under a pipeline whose framework keeps whole gradients prices as ZeRO-1
        # (costmodel.memory.keeps_whole_grads_under_pp): where the search takes ZeRO-1 too, ZeRO-2
        # is named as its alternative (`zero1_twin`), not searched again
        one, two = STATE_OPTIONS.index(States(1, False)), STATE_OPTIONS.index(States(2, False))
        self._twin = (one, two) if self.zero_allowed[one] and self.zero_allowed[two] else None
        self._hybrid_zero = hybrid_zero_stage(cluster.framework, options)
        self._times: dict[tuple, TimedChoice] = {}
        self._zero: dict[tuple, float] = {}
        self._memory: dict[tuple, tuple[MemoryFit, Plan]] = {}
        # memory shapes by _memory_key less the group order (a mixture's: each rank's least over
        # the spreads of its dense first layers), and per placement of them (spread_memory)
        self._shapes: dict[tuple, list] = {}
        self._spread_shapes: dict[tuple, dict] = {}
        self._rows: dict[tuple, tuple[list, list]] = {}
        self._probes: dict[tuple, Plan] = {}
        self._built: dict[tuple, Plan | str] = {}
        self._floors: dict[tuple, MemoryFit] = {}
        self._order_spans: dict[tuple, Spans] = {}
        self._vpp_probes: dict[tuple, Plan] = {}
        self._rtms: dict[tuple, RankTimeModel] = {}
        self._optimizer: dict[tuple, tuple[float, ...]] = {}
        self._placements: dict[tuple, list[int]] = {}
        self._rooms: dict[tuple, bool] = {}
        self._parts = rank_time_parts(model, train, cluster)

    def placements(self, base: Choice) -> list[int]:
        """The state placements (STATE_OPTIONS indices) the search takes for the choice: ZeRO
        needs a group to shard over (states_for_group), ZeRO-2 is ZeRO-1's alternative where it
        prices alike, and a framework's pipeline, or its replicas beside other parallelism, run only
        some stages (FrameworkSpace)."""
        # they read only these (keeps_whole_grads_under_pp: whether there is a pipeline)
        key = (base.dp * base.cp > 1, base.pp > 1, base.dp_replicate, replicas_beside_parallelism(base))
        got = self._placements.get(key)
        if got is None:
            sharded, piped, replicas, beside = key
            skip = self._twin[1] if self._twin and keeps_whole_grads_under_pp(base.pp, self.cluster.framework) else None
            space = self.options.space
            with_pp = space.zero_stages_with_pp if space is not None and piped else None
            with_others = space.zero_stages_beside_parallelism if space is not None and beside else None
            # without a group ZeRO-1 and -2 are stage 0's plan, which stands for them where it is allowed
            alone = sharded or not self.zero_allowed[STATE_OPTIONS.index(States(0, False))]
            got = self._placements[key] = [
                i for i, (o, ok) in enumerate(zip(STATE_OPTIONS, self.zero_allowed))
                if ok and i != skip and states_for_group(o, alone) and (with_pp is None or o.zero_stage in with_pp)
                and (with_others is None or o.zero_stage in with_others)
                and (replicas == 1 or (o.zero_stage >= self._hybrid_zero
                                       and shards_in_part(self.cluster.framework, o.zero_stage)))]
        return got

    def zero1_twin(self, plan: Plan) -> tuple[Plan, ...]:
        """(the plan under ZeRO-2,) where it was left out for pricing as this ZeRO-1 plan."""
        if (self._twin and plan.zero_stage == 1 and not plan.offload_optimizer
                and keeps_whole_grads_under_pp(plan.pp, self.cluster.framework)):
            return (replace(plan, zero_stage=2),)
        return ()

    def time_model(self, base: Choice) -> "TimedChoice":
        """`base`: a choice with one virtual stage and no schedule (time_groups)."""
        key = (base.tp, base.cp, base.pp, base.dp, (base.ep, base.etp, base.dp_replicate), base.micro_batch_size,
               base.sequence_parallel, base.recompute, base.fp8_linears, base.offload_activations, base.mesh_axis_order)
        if key not in self._times:
            if self.cluster.is_mixed:
                probe = replace(self._probe(base), mesh_axis_order=base.mesh_axis_order)
                sp = spans(probe, self.cluster)
                # the least of its groups' (planner.bounds reads only lower bounds from it)
                models = [rank_time_model(self.model, self.train, probe, view, sp) for view in views(self.cluster)]
                self._times[key] = TimedChoice(fastest_of(models), self._zero_floors_s(base, probe.num_micro_batches, sp),
                                               self._slowest_floor_s(probe, models))
            else:
                sp = self._spans(base, base.mesh_axis_order)
                m = self.train.global_batch_size // base.dp // base.micro_batch_size
                self._times[key] = TimedChoice(self._rtm(base, sp), self._zero_floors_s(base, m, sp))
        return self._times[key]

    def _probe(self, base: Choice) -> Plan:
        """A plan of the choice under some placement (the same choice under another differs only in its order)."""
        key = (base.tp, base.cp, base.pp, base.dp, (base.ep, base.etp, base.dp_replicate), base.micro_batch_size,
               base.sequence_parallel, base.recompute, base.fp8_linears, base.offload_activations)
        if key not in self._probes:
            self._probes[key] = build_plan(self.model, self.train, self.cluster, base)
        return self._probes[key]

    def _spans(self, base: Choice, order: tuple[str, ...]) -> Spans:
        key = (base.tp, base.cp, base.pp, base.dp, (base.ep, base.etp, base.dp_replicate), order)
        if key not in self._order_spans:
            self._order_spans[key] = spans(degrees_plan(dp=base.dp, tp=base.tp, pp=base.pp, cp=base.cp, ep=base.ep,
                                                        etp=base.etp, mesh_axis_order=order,
                                                        dp_replicate=base.dp_replicate), self.cluster)
        return self._order_spans[key]

    def _rtm(self, base: Choice, sp: Spans, shape: TimeShape | None = None) -> RankTimeModel:
        """The rank time model of a uniform cluster, shared by the choices it prices alike: those
        of one TimeShape (the choice's fields rank_time_model reads; `shape`, when the caller has
        it) whose TP, CP and EP groups span alike; the pipeline's span changes only the sends."""
        shape = shape or TimeShape.of(base)
        key = (shape, sp.tp, sp.cp, sp.ep, sp.etp)
        placed = (key, sp.pp)
        got = self._rtms.get(placed)
        if got is None:
            c = self._parts.compute(shape)
            rtm = self._rtms.get(key)
            if rtm is None:
                rtm = self._rtms[key] = parts_time_model(self._parts, c, sp, base.vpp)
            got = self._rtms[placed] = rtm.with_pp_sends(self._parts.pp_rank_sends_s(c, sp.pp))
        return got

    def plan_rtm(self, rtm: RankTimeModel, plan: Plan) -> RankTimeModel:
        """A shared rank time model (time_model) as `plan` is priced (rank_time_model): its
        virtual stages and micro-batches, and the expert all-to-all overlap they decide."""
        rtm = rtm.with_schedule(plan.vpp, plan.num_micro_batches)
        return rtm.with_ep_scaled(ep_overlap_factor(rtm.per_layer, plan, self.cluster))

    def floor_rtm(self, rtm: RankTimeModel, ep: int) -> RankTimeModel:
        """A shared rank time model for a bound over plans of any schedule and micro-batch count:
        the expert all-to-all overlap at its least (ep_overlap_floor_factor)."""
        return rtm.with_ep_scaled(ep_overlap_floor_factor(rtm.per_layer, ep, self.cluster))

    def _slowest_floor_s(self, probe: Plan, models: list[RankTimeModel]) -> float:
        """On a mixed cluster, each rank takes its group's time per layer; which groups hold how
        many ranks does not depend on their order (pp is outermost: a group's share of the nodes)."""
        if not self.cluster.is_mixed:
            return 0.0
        return slowest_rank_floor_s(self.model, [models[g].per_layer.total_s for g in rank_groups(probe, self.cluster)])

    def _zero_floors_s(self, c: Choice, num_micro_batches: int, sp: Spans) -> tuple[float, ...]:
        key = (c.tp, c.pp, c.dp * c.cp, num_micro_batches, sp.dp, sp.edp, sp.shard, sp.replicas, c.ep, c.etp)
        if key not in self._zero:
            self._zero[key] = tuple(min(zero_floor_s(self.model, self.train, view, c.tp, c.pp, c.dp * c.cp,
                                                     o.zero_stage, num_micro_batches, sp, c.ep, o.offload_optimizer,
                                                     c.etp)
                                        for view in views(self.cluster))
                                    if allowed else 0.0 for o, allowed in zip(STATE_OPTIONS, self.zero_allowed))
        return self._zero[key]

    def memory(self, base: Choice, vpp: int, schedule: Schedule, zero: int) -> tuple[MemoryFit, Plan | None] | None:
        """What memory says about this candidate, and a plan of it under the placement first seen
        (memory and pipeline shape do not depend on placement); None until `add_memory`."""
        return self._memory.get(self._memory_key(base, vpp, schedule, zero))

    def built(self, base: Choice, vpp: int, schedule: Schedule, zero: int) -> Plan | str:
        """The candidate's plan (under the placement first seen: memory does not depend on it), or
        why it is not a plan (the reason the search counts), built and checked once."""
        key = self._memory_key(base, vpp, schedule, zero)
        if key not in self._built:
            try:
                plan = build_plan(self.model, self.train, self.cluster,
                                  replace(base, **STATE_OPTIONS[zero]._asdict(), vpp=vpp, schedule=schedule))
            except ValueError:
                self._built[key] = "does not divide"
            else:
                problems = check_structure(self.model, self.train, self.cluster, plan)
                self._built[key] = reason_key(problems[0]) if problems else plan
        return self._built[key]

    def add_memory(self, base: Choice, plan: Plan) -> tuple[MemoryFit, Plan | None]:
        """Memory fit of `plan` (where a mixture's dense first layers may spread, each rank's
        least over the spreads: planner.dense_spreads.least_memory_shapes_by_zero), and of the
        same choice under the other state placements (ZeRO stages, offload) the search will come
        to (they share the costly activation shapes). A placement whose states alone leave no
        split room (planner.bounds.states_floor) gets that floor as its fit and no plan (none is
        needed: it fits nowhere); its activations are never priced."""
        key = lambda i: self._memory_key(base, plan.vpp, plan.schedule, i)  # noqa: E731
        current = STATE_OPTIONS.index(States(plan.zero_stage, plan.offload_optimizer))
        taken = self.placements(base)
        indices = [i for i in range(len(STATE_OPTIONS)) if key(i) not in self._memory and (i == current or i in taken)]
        # the placements differ only in where states live: one cap per rank for all of them
        caps, L, traits = rank_caps_bytes(plan, self.cluster), self.model.num_layers, self.cluster.framework
        floors = {i: self._states_fit(base, i, plan, caps) for i in indices}
        plans = {i: plan if i == current else replace(plan, **STATE_OPTIONS[i]._asdict())
                 for i in indices if floors[i].fits}
        # the shapes do not depend on the groups' order (a mixed cluster's), only the caps do
        missing = [i for i in plans if key(i)[:-1] not in self._shapes]
        if missing:   # one reserve for every ZeRO stage
            shapes = least_memory_shapes_by_zero(self.model, self.train, [plans[i] for i in missing],
                                                 self._reserved_bytes(plan), traits)
            self._shapes.update(zip([key(i)[:-1] for i in missing], shapes))
        for i in indices:
            if i in plans:
                self._memory[key(i)] = MemoryFit(self._shapes[key(i)[:-1]], plans[i], caps, L), plans[i]
            else:
                self._memory[key(i)] = floors[i], plan if i == current else None
        return self._memory[key(current)]

    def spread_memory(self, base: Choice, zero: int, plan: Plan) -> dict[tuple[int, ...], list]:
        """planner.dense_spreads.spread_memory_shapes of the candidate, once per choice."""
        key = self._memory_key(base, plan.vpp, plan.schedule, zero)[:-1]
        if key not in self._spread_shapes:
            self._spread_shapes[key] = spread_memory_shapes(self.model, self.train, plan, self._reserved_bytes(plan),
                                                            self.cluster.framework)
        return self._spread_shapes[key]

    def _reserved_bytes(self, plan: Plan) -> float:
        """costmodel.memory.reserved_bytes of the plan on this cluster (its ZeRO stage aside)."""
        return reserved_bytes(self.model, self.train, plan, self.cluster.device, self.cluster.framework,
                              self.cluster.devices_per_node)

    def states_room(self, group: Group, zeros: list[int]) -> bool:
        """Whether the states alone leave a variant of the group, under a placement in `zeros`, room
        for a split (`_states_fit`, asked first by add_memory; no mesh order). If not, not priced."""
        if self.cluster.is_mixed:   # each group order its own caps: add_memory asks
            return True
        base = group.base
        vpps = tuple(dict.fromkeys(v for v, _ in group.variants))
        # what the answer reads: the degrees, the groups' order, the virtual stages, the placements
        room = (base.tp, base.cp, base.pp, base.dp, base.ep, base.etp, base.dp_replicate, base.fp8_linears,
                base.group_order, vpps, tuple(zeros))
        got = self._rooms.get(room)
        if got is None:
            got = self._rooms[room] = self._has_room(base, vpps, zeros)
        return got

    def _has_room(self, base: Choice, vpps: tuple[int, ...], zeros: list[int]) -> bool:
        for vpp in vpps:
            for z in zeros:
                key = self._floor_key(base, z, vpp)
                if key not in self._floors:
                    probe = self._vpp_probes.get(key[:6] + (vpp,))
                    if probe is None:
                        probe = self._vpp_probes[key[:6] + (vpp,)] = build_plan(
                            self.model, self.train, self.cluster, replace(base, vpp=vpp))
                    self._states_fit(base, z, probe, rank_caps_bytes(probe, self.cluster))
                if self._floors[key].fits:
                    return True
        return False

    def _states_fit(self, base: Choice, zero: int, plan: Plan, caps: list[float]) -> MemoryFit:
        """planner.bounds.states_floor's fit under STATE_OPTIONS[zero] (`plan`: the choice, any states'
        placement); it reads the degrees, states' placement, virtual stages, caps: many choices share it."""
        key = self._floor_key(base, zero, plan.vpp)
        if key not in self._floors:
            placed = replace(plan, **STATE_OPTIONS[zero]._asdict())
            floors = {d: states_floor(self.model, self.train, placed, self.cluster.device.efficiency.reserved_memory_bytes,
                                      self.cluster.framework, d) for d in set(reachable(self.model, placed))}
            self._floors[key] = MemoryFit([floors[d] for d in reachable(self.model, placed)], placed, caps,
                                          self.model.num_layers)
        return self._floors[key]

    @staticmethod
    def _floor_key(c: Choice, zero: int, vpp: int) -> tuple:
        """What states_floor reads of a choice: its degrees, float8 linears (the float8 weights a
        framework caches: costmodel.memory.float8_weight_cache_bytes), placement of states and
        virtual stages, and the groups' order (for the caps); its first six, with the virtual
        stages, key the probe plan."""
        return (c.tp, c.cp, c.pp, c.dp, (c.ep, c.etp, c.dp_replicate), c.fp8_linears, zero, vpp, c.group_order)

    @staticmethod
    def _memory_key(c: Choice, vpp: int, schedule: Schedule, zero: int) -> tuple:
        return (c.tp, c.cp, c.pp, c.dp, (c.ep, c.etp, c.dp_replicate), zero, c.recompute, c.sequence_parallel,
                c.micro_batch_size, vpp, schedule, c.fp8_linears, c.offload_activations, c.group_order)

    def pipeline_floor_s(self, base: Choice, zero: int, plan: Plan, fit: MemoryFit,
                         enough_s: float = math.inf) -> float:
        """planner.bounds.pipeline_floor_s + the ZeRO floor, for `plan` under base's placement
        (once it reaches `enough_s`, possibly a smaller bound that still does)."""
        timed = self.time_model(base)
        key = (base, plan.vpp, plan.schedule)
        if key not in self._rows:
            self._rows[key] = least_pipeline_rows(self.model, self.plan_rtm(timed.rtm, plan), plan)
        ts, fs = self._rows[key]
        zero_s = timed.zero_floors_s[zero]
        return pipeline_floor_s(ts, fs, plan, fit, self.model.num_layers, enough_s - zero_s) + zero_s

    def group_floors_s(self, group: Group) -> tuple[list[float], tuple[float, ...]]:
        """Lower bounds on the candidates of `group`: per variant, the least pipeline floor over
        its mesh orders (planner.bounds.time_floor_s), and per state placement (STATE_OPTIONS)
        one that reads no placement (planner.bounds.optimizer_floor_s: the ZeRO floor less its
        DP buckets). Their sum bounds each candidate; the ZeRO floors, which cost more to price,
        wait until a choice of the group is found to fit."""
        base = group.base
        m = self.train.global_batch_size // base.dp // base.micro_batch_size
        if self.cluster.is_mixed:
            timed = [self.time_model(replace(base, mesh_axis_order=order)) for order in group.orders]
            pipeline = [min(time_floor_s(self.model, self.floor_rtm(t.rtm, base.ep), base.pp, m, schedule, vpp, base.recompute,
                                         t.slowest_floor_s) for t in timed) for vpp, schedule in group.variants]
            return pipeline, tuple(min(t.zero_floors_s[z] for t in timed) for z in range(len(STATE_OPTIONS)))
        shape = TimeShape.of(base)   # the orders' alike
        rtms = {id(r): r for r in (self._rtm(base, self._spans(base, order), shape) for order in group.orders)}.values()
        pipeline = [min(time_floor_s(self.model, self.floor_rtm(rtm, base.ep), base.pp, m, schedule, vpp, base.recompute)
                        for rtm in rtms)
                    for vpp, schedule in group.variants]
        return pipeline, self._optimizer_floors_s(base)

    def _optimizer_floors_s(self, c: Choice) -> tuple[float, ...]:
        """planner.bounds.optimizer_floor_s per state placement (STATE_OPTIONS); 0 where the
        search does not allow it."""
        key = (c.tp, c.pp, c.dp * c.cp, c.dp_replicate, c.ep, c.etp)
        if key not in self._optimizer:
            self._optimizer[key] = tuple(
                optimizer_floor_s(self.model, self.train, self.cluster, c.tp, c.pp, c.dp * c.cp, o.zero_stage, c.ep,
                                  o.offload_optimizer, c.etp) if allowed else 0.0
                for o, allowed in zip(STATE_OPTIONS, self.zero_allowed))
        return self._optimizer[key]
