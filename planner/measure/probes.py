"""The training-step probes of `planner profile`: small plans run with the runtime's own step,
and the fit of what a step adds to the microbenchmarks.

Microbenchmarks measure kernels alone. A training step adds eager-mode work per kernel (autograd,
module calls, hooks), collectives wrapped in FSDP / DTensor / pipelining bookkeeping, and on a
CPU ranks that share cores cannot hide communication. `planner calibrate` finds these from the
user's own runs; the probes measure them at profile time, so predictions hold before any
calibration. The probe model is not any model the planner ships: two Llama-style layers with
GQA, at three widths so the fit can tell a per-kernel cost from a rate (each probe's measured
and fitted step time is written under the profile's [probes]).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from costmodel.comm import kind_factors
from costmodel.hardware import RING_COLLECTIVES, ClusterSpec, DeviceProfile
from costmodel.inputs import UserError
from costmodel.kernels import LAYER_KINDS, flash_tile_efficiency, layer_parts_s
from costmodel.plan import PlanFile, Recompute
from costmodel.registry import llama_spec
from costmodel.specs import DType, LayerProbe, ModelSpec, TrainSpec
from planner.measure.calibrate import CPU_OVERLAP, Run, fit_by_dtype, summary
from planner.space import Choice, build_plan

_WHY = "probe of `planner profile`: not a published model"
NARROW = llama_spec("probe-narrow", layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=1024,
                    max_pos=256, source=_WHY)
WIDE = llama_spec("probe-wide", layers=2, hidden=256, heads=4, kv_heads=2, ffn=688, vocab=4096,
                  max_pos=256, source=_WHY)
BROAD = llama_spec("probe-broad", layers=2, hidden=512, heads=8, kv_heads=2, ffn=1376, vocab=4096,
                   max_pos=256, source=_WHY)
SEQ_LEN, GLOBAL_BATCH = 128, 4
# the layer whose kernels `planner profile` times inside a training step (runtime.layer_ops), on
# a CPU: the wide probe's, the narrow one's in a dtype the hardware does not accelerate
LAYER_PROBE = LayerProbe(model=WIDE, small=NARROW, micro_batch_size=4, seq_len=SEQ_LEN)

class Probe(NamedTuple):
    model: ModelSpec
    ranks: int
    choice: Choice
    global_batch: int = GLOBAL_BATCH


# One rank at three widths and two micro-batch sizes (the fit tells a per-kernel cost from a rate
# by them) and with recomputation; then DP, TP + SP and a 1F1B pipeline on two ranks: each
# parallelism the runtime executes (TP at two widths, DP at two widths and two micro-batch sizes).
PROBES = [
    Probe(WIDE, 1, Choice(micro_batch_size=4)),
    Probe(WIDE, 1, Choice(micro_batch_size=1)),
    Probe(NARROW, 1, Choice(micro_batch_size=4)),
    Probe(NARROW, 1, Choice(micro_batch_size=1)),
    Probe(WIDE, 1, Choice(micro_batch_size=2, recompute=Recompute.FULL)),
    Probe(BROAD, 1, Choice(micro_batch_size=4)),   # GEMM-heavy: tells the rate factor from the others
    Probe(WIDE, 2, Choice(micro_batch_size=2, zero_stage=1)),
    # latency-bound: the narrow model's FSDP units synchronise in far less time than they compute
    # on the wide one, so the fit tells the collectives' latency from their overlap (a GPU) or
    # from their bytes (a CPU, whose DP collectives do not hide: dp_comm)
    Probe(NARROW, 2, Choice(micro_batch_size=2, zero_stage=2)),
    Probe(WIDE, 2, Choice(tp=2, micro_batch_size=4)),
    # TP's collectives again, as many a step with a quarter of the elements: what a collective
    # costs per call (gloo's wait, DTensor's redistribution around it) apart from per element.
    # One TP probe cannot tell them apart: its fit puts the excess on the bytes and prices
    # larger tp2 plans too slow
    Probe(NARROW, 2, Choice(tp=2, micro_batch_size=4)),
    Probe(WIDE, 2, Choice(pp=2, micro_batch_size=1)),
    # the first DP probe's collectives (the same bytes: ZeRO-1 reduces once a step) behind a
    # micro-batch four times as long: how much of them hides, apart from how long they take (on a
    # CPU, nothing: it tells DP's collectives from the compute beside them)
    Probe(WIDE, 2, Choice(micro_batch_size=8, zero_stage=1), global_batch=4 * GLOBAL_BATCH),
]
START_OVERLAP = 0.5   # where the fit starts the share of DP communication hidden (the base profile's)


def start_overlap(kind: str) -> float:
    """A base profile's overlap: on a CPU CPU_OVERLAP, and not fitted (planner.measure.calibrate.CPU_COMM_PARAMS)."""
    return START_OVERLAP if kind == "gpu" else CPU_OVERLAP


def probe_name(pf: PlanFile) -> str:
    """How [probes] names a probe: model, dtype and plan."""
    return f"{pf.model.name} {pf.train.compute_dtype} {pf.plan.short()}"


# A GPU profile without [measured] attention_long_sequence holds the raw median ratio over the
# profiler's GPU shapes (runtime.profiler.GPU_ATTENTION_SHAPES: 1k-8k tokens, the median between
# the 2k and 4k ones), which already includes the flash kernel's tile efficiency the pricing
# applies per plan: divided by the tile efficiency at those two lengths, so it is not counted twice.
LEGACY_GPU_ATTENTION_SEQ_LENS = (2048, 4096)


def long_sequence_attention(ratio: float, device: DeviceProfile, measured: dict) -> float:
    """A profile's measured causal SDPA / GEMM ratio as a long sequence's (see above)."""
    if device.kind != "gpu" or measured.get("attention_long_sequence"):
        return ratio
    tiles = [flash_tile_efficiency(s) for s in LEGACY_GPU_ATTENTION_SEQ_LENS]
    return ratio / (sum(tiles) / len(tiles))


def unfitted(device: DeviceProfile, measured: dict) -> DeviceProfile:
    """A fitted profile back as the fit started from it (planner.measure.profile_doc without probes):
    efficiencies 1, no per-kernel cost, fp32's measured attention ratio for every dtype, the
    microbenchmarks' collective latencies, start_overlap, DP's collectives at the tier's
    efficiency. `measured`: the profile's [measured]."""
    ratio = long_sequence_attention(measured["attention_efficiency"]["fp32"], device, measured)

    def bare(e):
        return replace(e, gemm=1.0, memory=1.0, kernel_overhead_s=0.0, step_overhead_s=0.0, attention=ratio)
    tier = replace(device.intra_node, efficiency=1.0, latency_s=measured["collective_alpha_s"],
                   p2p_latency_s=measured["collective_p2p_latency_s"],
                   kind_factors=device.intra_node.kind_factors or _stored_kind_factors(measured))
    return replace(device, efficiency=replace(bare(device.efficiency), overlap=start_overlap(device.kind), dp_comm=1.0,
                                              pp_stage=1.0),
                   intra_node=tier,
                   dtype_efficiency=tuple((d, bare(e)) for d, e in device.dtype_efficiency))


def _stored_kind_factors(measured: dict) -> tuple[tuple[str, float, float], ...]:
    """The kinds' factors (costmodel.comm.kind_factors) from a profile's stored microbenchmark
    samples, for a profile written before the profile kept them (PROBE_FIT_VERSION 12): a refit
    prices its collectives as a new profile would. None stored (one GPU): none."""
    samples = {k: measured[f"collective_{k}"] for k in RING_COLLECTIVES if f"collective_{k}" in measured}
    return kind_factors(samples) if set(samples) == set(RING_COLLECTIVES) else ()


@dataclass(frozen=True)
class ProbeResult:
    pf: PlanFile
    step_time_s: float


def probe_plans(device: DeviceProfile, dtypes: dict[str, bool], ranks: int) -> list[PlanFile]:
    """The probes for `ranks` ranks, per dtype; a dtype the hardware does not accelerate
    (dtypes[name] False) gets the narrow model only, which takes seconds even at 1 GFLOP/s."""
    out = []
    cluster = ClusterSpec(device=device, num_nodes=1, devices_per_node=ranks)
    # probe-major, dtype-minor: when the budget runs out, every dtype has its first probes
    for model, world, choice, global_batch in PROBES:
        if world != ranks:
            continue
        for name, accelerated in dtypes.items():
            train = TrainSpec(seq_len=SEQ_LEN, global_batch_size=global_batch, compute_dtype=DType(name))
            mine = model if accelerated else NARROW
            out.append(PlanFile(plan=build_plan(mine, train, cluster, choice), model=mine, train=train,
                                cluster=cluster))
    return out


def results(plans: list[PlanFile], raws: list[dict | None]) -> list[ProbeResult]:
    return [ProbeResult(pf, statistics.median(raw["step_times_s"]))
            for pf, raw in zip(plans, raws) if raw is not None]


# a CPU's probes fit these per dtype (compute_params)
CPU_PROBE_PARAMS = ("kernel_overhead_s", "step_overhead_s")


def compute_params(base: DeviceProfile) -> tuple[str, ...]:
    """What the one-rank probes fit per dtype: the host's costs, per kernel and per step (one
    or four micro-batches of two layers tell them apart); never a rate. On a GPU their small
    steps are the host's alone (each kernel takes less than the host needs to issue it:
    costmodel.kernels._host_or_device): there a fit of the GEMM and memory factors runs to its
    bounds at no change in the probes' error and prices a larger model's GEMM-bound steps (such
    as benchmarks/gpu_check.py's) far too slow; the measured curves stand for the rates.
    On a CPU the rates' in-training shares are measured (layer_factors). Fitted there, the
    memory-bound factor would take what a step spends between kernels, which the probes' many
    small kernels pay more of than a larger model's: it lands far below the share that training
    layers' memory-bound kernels reach (runtime.layer_ops) and prices a larger model's plans too
    slow."""
    return ("kernel_overhead_s", "step_overhead_s") if base.kind == "gpu" else CPU_PROBE_PARAMS


# A kind's measured in-training share of its curve outside these is no rate but a broken
# measurement (the machine stalled through a pass, or the curve was measured in one): refused,
# naming the profile. Training layers run theirs near 1 (runtime.layer_ops; `planner profile`
# writes the shares as [efficiency.<dtype>] gemm and memory).
LAYER_FACTOR_BOUNDS = (0.1, 3.0)
PROBE_MODELS = {m.name: m for m in (NARROW, WIDE, BROAD)}
MAX_LAYER_MICRO_BATCH = 64   # far above LAYER_PROBE's: a larger one is no probe layer's timing


@dataclass(frozen=True)
class LayerTiming:
    """One dtype's [measured] layer_ops entry, checked: the probe layer it timed (runtime.layer_ops)
    and its seconds by kind (costmodel.kernels.LAYER_KINDS)."""

    model: ModelSpec
    micro_batch_size: int
    seq_len: int
    seconds: tuple[tuple[str, float], ...]

    @property
    def total_s(self) -> float:
        return sum(s for _, s in self.seconds)

    @classmethod
    def parse(cls, entry: object, where: str) -> "LayerTiming":
        """`entry` as a profile holds it; ValueError naming `where` and the field otherwise."""
        if not isinstance(entry, dict):
            raise UserError(f"{where}: not a table of the probe layer's timing")
        name = entry.get("model")
        model = PROBE_MODELS.get(name) if isinstance(name, str) else None
        if model is None:
            raise UserError(f"{where}.model: {name!r} is not a probe model ({', '.join(PROBE_MODELS)})")
        sizes = {}
        for key, top in (("micro_batch_size", MAX_LAYER_MICRO_BATCH), ("seq_len", model.max_position_embeddings)):
            value = entry.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top:
                raise UserError(f"{where}.{key}: {value!r} is not a whole number from 1 to {top}")
            sizes[key] = value
        seconds = []
        for kind in LAYER_KINDS:
            value = entry.get(f"{kind}_s")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
                raise UserError(f"{where}.{kind}_s: {value!r} is not a positive number of seconds")
            seconds.append((kind, float(value)))
        return cls(model=model, seconds=tuple(seconds), **sizes)


def layer_priced_s(model: ModelSpec, dtype: str, micro_batch_size: int, seq_len: int,
                   base: DeviceProfile) -> dict[str, float]:
    """One layer of `model` over `micro_batch_size` sequences of `seq_len` tokens in `dtype`, on
    one rank, priced per kind at `base`'s curves (costmodel.kernels.layer_parts_s)."""
    train = TrainSpec(seq_len=seq_len, global_batch_size=micro_batch_size, compute_dtype=DType(dtype))
    plan = build_plan(model, train, ClusterSpec(device=base, num_nodes=1, devices_per_node=1),
                      Choice(micro_batch_size=micro_batch_size))
    return layer_parts_s(model, train, plan, base)


def layer_factors(layer_ops: object, base: DeviceProfile, where: str, dtypes: set[str] | frozenset[str] = frozenset()
                  ) -> dict[str, dict[str, float]]:
    """Per dtype, the GEMM and memory factors a CPU's profile measured: the probe layer's
    kernels priced at the curves (layer_priced_s) over their seconds timed in training
    (runtime.layer_ops), per kind. `layer_ops`: [measured] layer_ops, which must time every one
    of `dtypes`; `where` names it in errors."""
    if not isinstance(layer_ops, dict):
        raise UserError(f"{where}: not a table of the probe layer's timings by dtype")
    if missing := sorted(set(dtypes) - set(layer_ops)):
        raise UserError(f"{where}: no timing for {', '.join(missing)}, which the probes ran")
    out = {}
    for dtype, entry in layer_ops.items():
        try:
            DType(dtype)
        except ValueError:
            raise UserError(f"{where}.{dtype}: not a dtype ({', '.join(d.value for d in DType)})") from None
        timing = LayerTiming.parse(entry, f"{where}.{dtype}")
        priced = layer_priced_s(timing.model, dtype, timing.micro_batch_size, timing.seq_len, base)
        seconds = dict(timing.seconds)
        factors = {k: priced[k] / seconds[k] for k in ("gemm", "memory")}
        low, high = LAYER_FACTOR_BOUNDS
        if not all(low <= f <= high for f in factors.values()):
            raise UserError(f"{where}.{dtype}: the layer's kernels ran at "
                             + ", ".join(f"{k} {f:.2f}" for k, f in factors.items())
                             + f" of their curves, outside {low}-{high}: measure again")
        out[dtype] = factors
    return out


def with_layer_factors(base: DeviceProfile, factors: dict[str, dict[str, float]]) -> DeviceProfile:
    """`base` with each measured dtype's GEMM and memory factors (layer_factors)."""
    own = dict(base.dtype_efficiency)
    for dtype, f in factors.items():
        own[dtype] = replace(own.get(dtype, base.efficiency), gemm=f["gemm"], memory=f["memory"])
    return replace(base, dtype_efficiency=tuple(own.items()))


def fit_probes(probes: list[ProbeResult], base: DeviceProfile, layer_ops: dict | None = None,
               where: str = "[measured] layer_ops") -> tuple[DeviceProfile, dict[str, float], dict, dict]:
    """planner.measure.calibrate.fit_by_dtype on the probes: per dtype its compute factors on the one-rank
    probes (no prior: the probes are the measurement), then the communication factors on the
    others (on a CPU the links' from the TP probes alone: links_from_tp). `layer_ops` (a CPU's:
    runtime.layer_ops): the GEMM and memory factors measured, set before the fit (layer_factors). The device's own efficiency becomes fp32's
    (dtypes without a table of their own, e.g. fp16, are priced with it). Returns the fitted
    profile, its factors, and the probes' MAPE before and after."""
    if base.kind == "cpu":
        if not layer_ops:
            raise UserError(f"{where}: missing; a CPU's fit needs the probe layer's kernels timed in training, "
                             "which this profile does not hold: run `planner profile` again")
        dtypes = {str(p.pf.train.compute_dtype) for p in probes}
        base = with_layer_factors(base, layer_factors(layer_ops, base, where, dtypes))
    runs = [Run(path=Path(f"probe:{p.pf.plan.short()}"), pf=p.pf, measured_step_s=p.step_time_s) for p in probes]
    device, params = fit_by_dtype(runs, base, rounds=1, max_iter=600, prior_weight=0.0,
                                  compute_on_one_rank=True, compute_params=compute_params(base),
                                  # not from the probes: a recomputing probe's step against the
                                  # others' is a difference as noisy as it is small (a fit on it
                                  # lands at its bound, far below what runs of a larger model show)
                                  fit_recompute=False,
                                  # nor from its PP probe: one step a dtype, which can run far
                                  # further over its price than real pipelined runs do (a fit on
                                  # it prices them too slow); calibrate fits it on runs
                                  # (planner.measure.calibrate.fit_by_dtype)
                                  fit_pp_stage=False,
                                  # the links from the TP probes alone (a CPU's): fitted on every
                                  # multi-rank probe, the PP probe's per-micro-batch work (priced
                                  # nowhere) and the DP probes pulled the links' latency and
                                  # bandwidth apart, pricing larger tp2 plans too slow while the
                                  # TP probes themselves fitted well
                                  links_from_tp=base.kind == "cpu")
    own = dict(device.dtype_efficiency)
    if own:
        first = own.get("fp32") or next(iter(own.values()))
        device = replace(device, efficiency=replace(first, overlap=device.efficiency.overlap,
                                                    dp_comm=device.efficiency.dp_comm,
                                                    pp_stage=device.efficiency.pp_stage))
    return device, params, summary(runs, base), summary(runs, device)


def refit_stored(profile: Path) -> tuple[DeviceProfile, dict[str, float], dict, dict, int, int]:
    """A profile's probe fit redone under the current cost model: the base it started from
    (`unfitted`) fitted to the step times stored under its [probes], with no new measurement.
    Returns the fitted device, its factors, the probes' MAPE before and after, and how many of
    the stored probes were matched (a probe the current PROBES no longer has is left out)."""
    import tomllib

    from costmodel.hardware import load_profile
    doc = tomllib.loads(profile.read_text())
    stored = {s["plan"]: s["measured_s"] for s in doc["probes"]["steps"]}
    base = unfitted(load_profile(profile), doc["measured"])
    layer_ops = doc["measured"].get("layer_ops")
    accelerated = {d: True for d, _ in base.dtype_efficiency}   # narrow-only dtypes match no stored name
    results = [ProbeResult(pf, stored[probe_name(pf)]) for ranks in (1, 2)
               for pf in probe_plans(base, accelerated, ranks) if probe_name(pf) in stored]
    return (*fit_probes(results, base, layer_ops, f"{profile}: [measured] layer_ops"), len(results), len(stored))
