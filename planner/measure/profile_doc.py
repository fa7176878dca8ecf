"""The document `planner profile` writes: what was measured, under [measured]; the probes' fit
under [efficiency] and [efficiency.<dtype>]; each probe under [probes]; every number with its
source as a comment (planner.measure.profile_file writes it)."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from costmodel import machine
from costmodel.comm import fit_alpha_beta, kind_factors
from costmodel.hardware import PROBE_FIT_VERSION, PROFILE_FORMAT_VERSION
from planner.measure import profile_file as pf_io


@dataclass(frozen=True)
class Setup:
    out: Path
    name: str
    mode: str
    nproc: int
    device_type: str
    threads: int
    command: str
    budget_s: float | None = None   # --budget-s: the total, instead of the mode's
    overwrite: bool = True          # the cached profile is replaced; an --out file only with --overwrite
    started_s: float = field(default_factory=time.perf_counter)   # the budget counts from here


def measured_profile(setup: Setup, micro: dict, probed=None, elapsed_s: float = 0.0, skipped: tuple[str, ...] | list[str] = ()):
    """The profile document. Without `probed` (the probes' results and fit) it is the base the
    probes are predicted with: the measured curves, efficiencies 1, no per-kernel cost.
    `skipped`: the probes the budget left no time for, named under [probes]."""
    from runtime import profiler as prof
    date, ident = time.strftime("%Y-%m-%d"), machine.identity()
    how = f"measured {date} by `{setup.command}` on {machine.describe(ident)}, {setup.threads} thread(s) per rank"
    memory = sorted(micro["memory"].points)
    net = _network(setup, micro.get("collectives"))
    device = probed[1] if probed else None
    doc = pf_io.document([
        f"Device profile of this machine: {how}, {elapsed_s:.0f} s.",
        "Peaks are the best measured rates; the curves under [measured] are what the cost model uses.",
        f"All {setup.nproc} ranks measured at once (each shares cores, caches and memory bandwidth with the",
        "others, as the ranks of a run do); rank 0's figures are written. [efficiency] holds what",
        "training steps add to the microbenchmarks, fitted to the probes at the end of this file."])
    doc.add("format_version", PROFILE_FORMAT_VERSION)
    doc.add("device", pf_io.table(_device_rows(setup, micro, memory)))
    doc.add("network", pf_io.networks(_network_rows(setup, net, device)))
    doc.add("efficiency", _efficiency(micro, device, how, len(probed[0]) if probed else 0, setup.device_type))
    doc.add("measured", pf_io.table(_measured_rows(setup, micro, memory, net, date, ident)))
    for key, c in micro["gemm"].items():
        if c.stopped_before:
            doc["measured"].add(pf_io.tomlkit.comment(
                f"gemm_{key}: the budget stopped before {c.stopped_before:.3g} FLOPs per call; larger GEMMs are "
                "priced at the largest measured rate (extrapolated)"))
        if not c.accelerated:
            doc["measured"].add(pf_io.tomlkit.comment(
                f"gemm_{key}: NOT ACCELERATED here (below {prof.ACCELERATED_RATIO} of fp32's rate at equal FLOPs); "
                "measured at small sizes only"))
    if probed:
        doc.add("probes", _probes(probed, skipped))
    return doc


@dataclass(frozen=True)
class _Net:
    alpha_s: float
    beta_bytes_per_s: float
    p2p_s: float
    how: str
    samples: dict | None
    kinds: tuple[tuple[str, float, float], ...] = ()


def _network(setup: Setup, samples: dict | None) -> _Net:
    if not samples:   # one GPU: no peer to measure; single-device plans never use the network
        return _Net(1e-5, 1e10, 1e-5, "not measured (one device, no peer): a placeholder that single-device "
                    "plans never use", None)
    alpha, beta, rms, p2p = fit_alpha_beta(samples, setup.nproc)
    count = sum(len(v) for k, v in samples.items() if k != "p2p")
    return _Net(alpha, beta, p2p, f"alpha-beta ring fit over {count} collective samples on {setup.nproc} ranks "
                f"(rms {100 * rms:.0f}%)", samples, kind_factors(samples))


def _device_rows(setup: Setup, micro: dict, memory) -> list[pf_io.Row]:
    cpu = setup.device_type == "cpu"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 2**34
    peaks = {k: max(r for _, r in c.points) for k, c in micro["gemm"].items()}
    return [("name", setup.name, None), ("kind", "cpu" if cpu else "gpu", None), ("aliases", [], None),
            ("peak_flops_per_s", peaks, "measured: best GEMM rate of the curves below"),
            ("memory_bytes", int(ram // setup.nproc if cpu else _cuda_memory()),
             f"this machine's RAM / {setup.nproc} ranks (a choice)" if cpu
             else "device memory (torch.cuda.get_device_properties)"),
            *([("memory_ranks", setup.nproc, "the ranks the RAM is divided among; a cluster of another count "
                                              "per node divides it among its own")] if cpu else []),
            ("memory_bandwidth_bytes_per_s", max(r for _, r in memory), "measured: best rate of the memory-bound kernel mix below")]


def _network_rows(setup: Setup, net: _Net, device) -> list[list[pf_io.Row]]:
    tier = device.intra_node if device else None
    factor = tier.latency_s / net.alpha_s if tier else 1.0
    node = [("scope", "node", None), ("name", f"{'gloo' if setup.device_type == 'cpu' else 'nccl'}-local", None),
            ("bandwidth_bytes_per_s", net.beta_bytes_per_s, f"measured: {net.how}"),
            ("latency_s", tier.latency_s if tier else net.alpha_s,
             f"probes: the measured {net.alpha_s:.3g} s per ring step x {factor:.3g}" if tier
             else "measured: same fit, per ring step"),
            ("p2p_latency_s", tier.p2p_latency_s if tier else net.p2p_s,
             f"probes: the measured {net.p2p_s:.3g} s x {factor:.3g}" if tier
             else "measured: send/recv of the smallest messages (median)")]
    stand_in = "no second machine measured: the node figure stands in"
    cluster = [("scope", "cluster", None), ("name", "unmeasured", None),
               ("bandwidth_bytes_per_s", net.beta_bytes_per_s, stand_in), ("latency_s", net.alpha_s, stand_in)]
    if net.kinds:
        factors = {k: {"latency": lat, "bandwidth": bw} for k, lat, bw in net.kinds}
        node.append(("kind_factors", factors,
                     "measured: each collective's own alpha-beta fit over the one above (costmodel.comm.kind_factors)"))
        cluster.append(("kind_factors", factors, stand_in))
    return [node, cluster]


def _dp_rows(device_type: str, eff, fitted: str) -> list:
    """overlap (and on a CPU dp_comm and pp_stage): a GPU's probes fit the overlap, a CPU's keep
    it at 0 and fit DP's collectives a factor of their own; pipeline stages get one from
    calibrate (planner.measure.calibrate.CPU_COMM_PARAMS)."""
    from planner.measure.probes import start_overlap
    if device_type == "cuda":
        return [("overlap", eff.overlap if eff else start_overlap("gpu"),
                 f"{fitted}: share of data-parallel communication hidden by compute" if eff
                 else "a starting point for the probes' fit")]
    return [("overlap", start_overlap("cpu"), "on a CPU DP's collectives do not hide: the ranks wait on gloo "
             "on the cores compute uses (planner.measure.calibrate.CPU_COMM_PARAMS)"),
            ("dp_comm", eff.dp_comm if eff else 1.0, f"{fitted}: DP's collectives' speed over the tier's fitted rate"
             if eff else "a starting point for the probes' fit"),
            ("pp_stage", 1.0, "a pipeline stage's work over its price: `planner calibrate` fits it on runs "
             "with a pipeline (the probes' one PP step a dtype is too noisy for it)")]


def measured_share(kind: str) -> str:
    """[efficiency]'s note on a factor a CPU profile measured in its probe layer (planner.measure.probes.layer_factors)."""
    return f"measured (fp32's): a probe layer's {kind} kernels in training over the curve, [measured] layer_ops"



def _efficiency(micro: dict, device, how: str, probes: int, device_type: str):
    fitted = f"fitted to {probes} probe training steps (see [probes])"
    eff, tier = (device.efficiency, device.intra_node) if device else (None, None)
    first = next(iter(micro["attention"]))
    rows: list[pf_io.Row] = [
        ("gemm", eff.gemm if eff else 1.0, (measured_share("GEMM") if micro.get("layer_ops") else
                                            f"{fitted}: training's share of the measured GEMM curve") if eff
         else "the measured GEMM curve already is the achieved rate"),
        ("attention", eff.attention if eff else micro["attention"][first],
         f"measured causal SDPA / GEMM ({first}) x the gemm factor"
         + ("; a CPU's attention is priced at [measured] sdpa_* instead" if micro.get("sdpa") else "")),
        *([("attention_backward_ratio", micro["attention_backward"][first],
            f"measured ({first}'s): causal SDPA's backward rate over its forward's, [measured] attention_backward_ratio")]
          if micro.get("attention_backward") else []),
        ("memory", eff.memory if eff else 1.0, (measured_share("memory-bound") if micro.get("layer_ops") else
                                                f"{fitted}: share of the measured memory-bound curve") if eff
         else "the measured memory-bound curve already is the achieved rate"),
        ("kernel_overhead_s", eff.kernel_overhead_s if eff else 0.0,
         f"{fitted}: eager work per kernel (autograd, modules, hooks; bare operator {micro['overhead_s']:.2g} s)"
         if eff else "the curves include each call's cost"),
        ("intra_node_comm", tier.efficiency if tier else 1.0,
         f"{fitted}: collectives inside FSDP / DTensor / pipelining over the microbenchmark fit" if tier
         else "the fit above is the achieved rate"),
        ("inter_node_comm", 1.0, None),
        *_dp_rows(device_type, eff, fitted),
        *([("step_overhead_s", eff.step_overhead_s, f"{fitted}: the step's own host work, once per step")]
          if eff and eff.step_overhead_s else []),
        ("reserved_memory_bytes", 268435456, "assumed: interpreter + torch runtime, ~256 MiB"),
        ("source", how, None)]
    out = pf_io.table(rows)
    own = dict(device.dtype_efficiency) if device else {}
    # Attention is priced at fp32's measured SDPA / GEMM ratio for every dtype: the probes (128
    # tokens) barely see attention, and on a CPU bf16's own ratio, well below fp32's, prices bf16
    # plans of a larger model far too slow where fp32's comes close. Each dtype's own ratio stays
    # in the comment and under [measured].
    ratio = micro["attention"][first]
    for dtype, measured in micro["attention"].items():
        e = own.get(dtype)
        note = f"fp32's causal SDPA / GEMM {ratio:.3g}" + (" x the gemm factor" if e else "") + \
            f" ({dtype}'s own: {measured:.3g})"
        out.add(dtype, pf_io.table([
            ("gemm", e.gemm if e else 1.0, None), ("attention", e.attention if e else ratio, note),
            ("memory", e.memory if e else 1.0, None), ("kernel_overhead_s", e.kernel_overhead_s if e else 0.0, None),
            *([("step_overhead_s", e.step_overhead_s, None)] if e and e.step_overhead_s else [])],
            comment=(("gemm and memory measured ([measured] layer_ops), the rest " if micro.get("layer_ops") else "")
                     + f"{fitted}, the one-rank probes in {dtype}") if e else "measured"))
    return out


def _measured_rows(setup: Setup, micro: dict, memory, net: _Net, date: str, ident: dict) -> list[pf_io.Row]:
    from runtime.profiler import CPU_SDPA_SHAPES
    rows: list[pf_io.Row] = [
        ("date", date, None), ("command", setup.command, None), ("machine", machine.describe(ident), None),
        ("machine_key", machine.machine_key(ident), "costmodel.machine: processor, cores, torch, GPU"),
        ("threads_per_rank", setup.threads, "`planner run` gives each CPU rank this many threads"),
        *[(f"gemm_{k}", c.points, "[FLOPs per call, FLOP/s]") for k, c in micro["gemm"].items()],
        ("memory_bound", memory, "[bytes moved per kernel, bytes/s] of an add, an RMS norm and a softmax "
         "together (runtime.profiler.memory_points)" + (
            f"; the budget stopped before {micro['memory'].stopped_before:.3g} bytes per kernel, larger kernels "
            "are priced at the largest measured rate" if micro["memory"].stopped_before else "")),
        *[(k, [list(pt) for pt in c], "[sequence, head dim, seconds per head]: costmodel.kernels.sdpa_head_s"
           + (f"; {len(c)} of {len(CPU_SDPA_SHAPES)} shapes in the budget, longer calls priced at the longest's "
              "time per query-key pair" if len(c) < len(CPU_SDPA_SHAPES) else ""))
          for k, c in micro.get("sdpa", {}).items()],
        ("attention_efficiency", dict(micro["attention"]), "causal SDPA rate / GEMM rate at equal FLOPs"
         + ("; from sdpa_<dtype>_forward, which the pricing reads" if micro.get("sdpa") else "")
         + (", each shape's over the flash tile efficiency at its length (a long sequence's)"
            if micro.get("attention_long_sequence") else "")),
        *([("attention_long_sequence", True, "GPU: see attention_efficiency; older GPU profiles lack it (planner.measure.probes.long_sequence_attention)")]
          if micro.get("attention_long_sequence") else []),
        *([("attention_backward_ratio", dict(micro["attention_backward"]), "GPU: causal SDPA's backward rate "
            "(counted as 2.5 forwards) over its forward's, the median over the shapes; older GPU profiles lack "
            "it and price the backward at the forward's rate")]
          if micro.get("attention_backward") else []),
        *([("layer_ops", micro["layer_ops"], "a probe layer's forward and backward, each kernel timed where it "
            "runs, seconds by kind (runtime.layer_ops; the faster of two passes): the GEMM and memory factors "
            "under [efficiency.<dtype>] are its kernels priced at the curves over these (planner.measure.probes.layer_factors)")]
          if micro.get("layer_ops") else []),
        ("op_overhead_s", micro["overhead_s"], "a one-element add, the bare dispatch cost"),
        ("optimizer_s_per_param", micro["optimizer_s_per_param"],
         f"AdamW (foreach, fp32) over {_timed_params(setup.device_type) >> 20}M parameters: "
         "costmodel.kernels.optimizer_step_s prices the step with it"),
        ("grad_accumulate_s_per_param", micro["grad_accumulate_s_per_param"],
         f"one micro-batch's gradients added in place into fp32 ones, by the dtype they come in, over "
         f"{_timed_params(setup.device_type) >> 20}M parameters: costmodel.kernels.gradient_add_s"),
        ("fsdp_sync_s_per_param", micro["fsdp_sync_s_per_param"],
         "FSDP2's reduce and gather on a one-rank group, per parameter, by compute dtype (runtime.profiler."
         "fsdp_sync_s_per_param): costmodel.kernels.fsdp_sync_s prices a one-replica plan's with it"),
        ("dropout_s_per_element", micro["dropout_s_per_element"],
         "torch's dropout (F.dropout, fp32: draw, scale, multiply), per element: costmodel.kernels.dropout_s"
         + ("" if setup.device_type == "cpu" else "; 0 on a GPU, whose dropout draws inside the multiply's kernel")),
        *([("gelu_s_per_element", micro["gelu_s_per_element"],
            "torch's GeLU (F.gelu, fp32) per element by approximation, [forward, backward]: costmodel.kernels.gelu_s")]
          if micro.get("gelu_s_per_element") else []),
        ("collective_alpha_s", net.alpha_s, "the microbenchmark fit, before the probes"),
        ("collective_p2p_latency_s", net.p2p_s, None)]
    return rows + [(f"collective_{k}", v, "[bytes, seconds]") for k, v in (net.samples or {}).items()]


def _probes(probed, skipped):
    from planner.measure.calibrate import Run, predict_with
    from planner.measure.probes import probe_name
    measured, device, params, before, after = probed
    steps = pf_io.tomlkit.array()
    for p in measured:
        predicted = predict_with(Run(path=Path("probe"), pf=p.pf, measured_step_s=p.step_time_s), device)
        row = pf_io.tomlkit.inline_table()
        row.update({"plan": probe_name(p.pf),
                    "measured_s": round(p.step_time_s, 6), "predicted_s": round(predicted.step_time_s, 6)})
        steps.append(row)
    steps.multiline(True)
    out = pf_io.table([("fit_version", PROBE_FIT_VERSION, "the cost model the fit belongs to (costmodel.hardware)"),
                       ("fitted_factors", params, None)],
                      comment=f"step-time MAPE of the probes: {before['mape_pct']:.1f}% with the microbenchmarks "
                      f"alone, {after['mape_pct']:.1f}% fitted (max {after['max_abs_error_pct']:.1f}%)")
    out.add("steps", steps)
    if skipped:   # a fit without them is a different fit: say which, not only how many
        names = pf_io.tomlkit.array()
        names.extend(skipped)
        names.multiline(True)
        out.add(pf_io.tomlkit.comment("the budget left no time for these probes; the fit above is without them"))
        out.add("skipped", names)
    return out


def _timed_params(device_type: str) -> int:
    """How many parameters the profiler's per-parameter costs (AdamW, gradient adds) are timed over."""
    from runtime import profiler as prof
    return prof.persisting_params(device_type)[0]


def _cuda_memory() -> int:
    import torch
    return torch.cuda.get_device_properties(0).total_memory
