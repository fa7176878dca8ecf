"""Plain-text tables for the terminal. Renders numbers the cost model computed; derives none."""
from __future__ import annotations

from typing import Any, Sequence

from costmodel import resilience
from costmodel.estimate import Estimate
from costmodel.fidelity import PUBLISHED, error_band, long_sequence_caveat
from costmodel.groups import placement_lines, short_device_name, stages_on, views
from costmodel.hardware import ClusterSpec
from costmodel.plan import DEFAULT_AXIS_ORDER, Plan
from costmodel.selective_modules import DEFAULT_SELECTIVE_MODULES
from costmodel.specs import ModelSpec, TrainSpec
from costmodel.units import GIB


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned first column, right-aligned others."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(cells[0]), rule] + [fmt(r) for r in cells[1:]])


def ledger_table(est: Estimate) -> str:
    rows = [(key, f"{value * 1e3:,.1f}", f"{100 * value / est.step_time_s:.1f}")
            for key, value in est.time_breakdown_s.items() if value]
    rows.append(("total", f"{est.step_time_s * 1e3:,.1f}", "100.0"))
    return table(("time ledger (critical rank %d)" % est.critical_rank, "ms", "%"), rows)


def memory_table(est: Estimate) -> str:
    keys = list(est.memory_breakdown_bytes[0])
    rows = []
    caps = est.capacity_per_rank_bytes
    uneven = len(set(caps)) > 1   # a mixed cluster's groups: each stage against its own device
    for rank, (parts, peak, cap) in enumerate(zip(est.memory_breakdown_bytes, est.peak_memory_bytes, caps)):
        over = peak - cap
        status = "ok" if over <= 0 else f"OVER by {over / GIB:.1f}"
        rows.append([f"stage {rank}"] + [f"{parts[k] / GIB:.2f}" for k in keys]
                    + [f"{peak / GIB:.2f}"] + ([f"{cap / GIB:.1f}"] if uneven else []) + [status])
    headers = (["memory per device (GiB)"] + keys + ["peak"] + (["capacity", "fits"] if uneven
                                                                   else [f"of {est.memory_capacity_bytes / GIB:.0f}"]))
    return table(headers, rows)


def _tightest(est: Estimate, between: str, cap_format: str) -> str:
    """The peak of the stage closest to its budget, and that budget (on a uniform cluster the
    highest peak and the one budget; a mixed cluster's groups differ)."""
    r = est.tightest_rank
    return f"{est.peak_memory_bytes[r] / GIB:.1f}{between}{format(est.capacity_per_rank_bytes[r] / GIB, cap_format)}"


def slowest_share(est: Estimate) -> dict:
    """The group whose replicas set the step (replicas on groups)."""
    return max(est.group_shares, key=lambda s: s["step_time_s"])


def share_step_lines(cluster: ClusterSpec, est: Estimate) -> list[str]:
    """Replicas on groups: each group's step and memory, the slowest marked (it sets the step)."""
    if not est.group_shares:
        return []
    slowest = slowest_share(est)
    return ["step per group: " + ", ".join(
        f"{short_device_name(cluster, s['group'])} {s['step_time_s']:.3f} s"
        + (" (slowest)" if s is slowest else "")
        + f", peak {s['peak_memory_bytes'] / GIB:.1f} of {s['capacity_bytes'] / GIB:.1f} GiB" for s in est.group_shares)]


def _options_said(cluster: ClusterSpec) -> str:
    """The framework's options the run sets: the selective recomputation's modules
    (--recompute-modules) and the expert all-to-all overlap (--ep-overlap)."""
    modules = cluster.framework.selective_modules
    said = "" if modules == DEFAULT_SELECTIVE_MODULES else f", selective recomputation of {'+'.join(modules)}"
    return said + (", expert all-to-alls overlapped" if cluster.framework.ep_a2a_overlap else "")


def summary_lines(model: ModelSpec, train: TrainSpec, cluster: ClusterSpec, plan: Plan,
                  est: Estimate, failures: resilience.Failures = resilience.LLAMA3) -> str:
    return "\n".join([
        f"model    {model.name}   train seq {train.seq_len} x global batch {train.global_batch_size} "
        f"({train.compute_dtype}{' with float8 linears' if plan.fp8_linears else ''}, {train.optimizer}, "
        f"{train.attention_kernel} attention)",
        f"cluster  {cluster.name} ({cluster.world_size} device{'s' if cluster.world_size != 1 else ''})   priced as {cluster.framework.name} runs plans"
        + _options_said(cluster),
        f"plan     {plan.short()}   layers/stage {','.join(map(str, plan.layers_per_stage))}"
        # short() names a mesh order other than the default; the default is named here
        + (f"   mesh {'>'.join(plan.mesh_axis_order)}" if plan.mesh_axis_order == DEFAULT_AXIS_ORDER else ""),
        *(f"groups   {line}" for line in placement_lines(plan, cluster, train.global_batch_size)),
        *(f"groups   {line}" for line in share_step_lines(cluster, est)),
        f"step     {est.step_time_s:.3f} s   {est.tokens_per_s:,.0f} tokens/s   "
        f"MFU {100 * est.mfu:.1f}%   HFU {100 * est.hfu:.1f}%   bubble {100 * est.bubble_fraction:.1f}%   "
        f"peak {_tightest(est, ' GiB of ', '.1f')}"
        f" ({'fits' if est.fits else 'DOES NOT FIT'})",
        *([f"host     offloaded states {max(est.host_memory_bytes) / GIB:,.1f} GiB per device of the "
           f"{est.host_capacity_bytes / GIB:,.1f} GiB its share of the node's host may hold; "
           f"optimizer step on the host {est.time_breakdown_s['optimizer/step']:.3f} s"]
          if plan.offload_optimizer else []),
        *([f"host     offloaded activations: {max(est.host_memory_bytes) / GIB:,.1f} GiB per device on the host, "
           f"{est.time_breakdown_s['comm/activation_offload']:.3f} s of copies per step"]
          if plan.offload_activations and not plan.offload_optimizer else []),
        f"         memory: {_memory_basis(cluster)}; MFU counts 6N{' (N: active parameters)' if model.is_moe else ''} "
        f"+ {_attention_flops_phrase(model)} FLOPs per token (full s² "
        f"attention, Megatron Eq. 7 / PaLM; a causal kernel runs half of it), HFU those and the recomputed"
        f"{' against the bf16 peak, float8 linears included' if plan.fp8_linears else ''}"
        f"; expected error +-{100 * error_band(cluster)[0]:.1f}% ({_band_source(cluster)})"
        f"{long_sequence_caveat(train.seq_len, cluster)}",
        "long run   " + resilience.summary_line(resilience.checkpoint_cost(
            model, train, cluster.world_size, est.step_time_s, est.tokens_per_s, failures)),
    ])


def _band_source(cluster: ClusterSpec) -> str:
    """Where the quoted error comes from (costmodel.fidelity.error_band)."""
    source = error_band(cluster)[1]
    return "costmodel.fidelity" if source == PUBLISHED else source


def _capacity_source(device) -> str:
    """Where a device's capacity figure comes from, in the words the memory line uses."""
    if device.kind == "cpu":
        return "per rank as the profile sets it"
    return "as CUDA reports it" if device.reported_memory_bytes else "as the datasheet gives it"


def _attention_flops_phrase(model) -> str:
    """The attention term of the MFU numerator as costmodel.flops counts it (latent attention:
    its query/key and value head sizes apart; MTP modules are one more layer and head pass each)."""
    if not model.is_mla:
        return "12·layers·hidden·seq"
    mtp = f", MTP's {model.mtp_depth} more layer and head pass included" if model.mtp_depth else ""
    return f"6·layers·heads·({model.head_dim}+{model.value_head_dim})·seq{mtp}"


def _memory_basis(cluster: ClusterSpec) -> str:
    """What a device's capacity is made of (each group's, on a mixed cluster)."""
    return ", ".join(f"{short_device_name(cluster, g) + ' ' if cluster.is_mixed else ''}"
                     f"{view.device.usable_memory_bytes / GIB:.2f} GiB {_capacity_source(view.device)}, less "
                     f"{view.memory_headroom:.0%} headroom and {view.device.efficiency.allocator_fragmentation:.0%} "
                     f"allocator fragmentation" for g, view in enumerate(views(cluster)))


def _runs(counts: Sequence[int]) -> str:
    """A split as runs of equal counts: (7, 8, 8, 8, 7) -> 7,8*3,7."""
    runs: list[list[int]] = []
    for c in counts:
        if runs and runs[-1][0] == c:
            runs[-1][1] += 1
        else:
            runs.append([c, 1])
    return ",".join(f"{c}*{n}" if n > 1 else str(c) for c, n in runs)


def validate_table(results: Sequence[Any], summary: dict[str, Any]) -> str:
    rows = []
    for r in results:
        err = "" if r.error_pct is None else f"{r.error_pct:+.1f}"
        pub = r.published if isinstance(r.published, str) else f"{r.published:.4g}"
        pred = r.predicted if isinstance(r.predicted, str) else f"{r.predicted:.4g}"
        filled = " ".join(f"{k}={_runs(v) if isinstance(v, tuple) else v}" for k, v in r.filled.items())
        # a run priced as not fitting: by how much (its tightest stage's peak over what CUDA leaves)
        fits = "yes" if r.fits else f"no: {_tightest(r.estimate, ' of ', '.1f')} GiB"
        if r.past_budget is not None:   # fits the device, not the budget the planner plans with
            fits = f"yes, past budget: {r.past_budget[0] / GIB:.1f} of {r.past_budget[1] / GIB:.1f} GiB"
        rows.append((r.id, r.metric, pub, pred, err, fits, filled))
    text = table(("id", "metric", "published", "predicted", "error %", "fits", "filled (planner's choice)"), rows)
    s = summary
    def shown(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)
    text += (f"\n\nrows {s['n']}   MAPE {shown(s['mape_pct'], '.1f')}%   max |error| "
             f"{shown(s['max_abs_error_pct'], '.1f')}%   Spearman {shown(s['spearman'], '.3f')}   "
             f"status rows {s['num_status_correct']}/{s['num_status_rows']} correct")
    if s.get("memory_rows"):
        text += (f"\nmemory (rows stating memory_gb and every cell that sets it: {s['memory_rows']}): predicted "
                 f"allocator reservation MAPE {s['memory_mape_pct']:.1f}%, max |error| "
                 f"{s['memory_max_abs_error_pct']:.1f}%, mean {s['memory_mean_error_pct']:+.1f}% (- predicted too small)")
    if s.get("past_budget_ids"):
        text += (f"\nfitting the device but past the budget the planner plans with (headroom, allocator "
                 f"fragmentation; speed at the allocator's edge unpriced): {', '.join(s['past_budget_ids'])}")
    if s.get("generic_frameworks"):
        from costmodel.frameworks import FRAMEWORKS
        named = ", ".join(f"{name or '(unstated)'} ({n} row{'s' if n > 1 else ''})"
                          for name, n in s["generic_frameworks"].items())
        text += (f"\npriced with generic traits (a framework the model does not know): {named}; known: "
                 + ", ".join(sorted(FRAMEWORKS)) + " (how far generic traits price the calibration table's runs "
                 "from their own frameworks': docs/results.md, python3 benchmarks/fidelity.py)")
    if s.get("networks_from_notes"):
        text += ("\npriced over the network of the cloud instance their notes name (not a DGX's; "
                 "planner.measure.instances): " + ", ".join(f"{i} ({n})" for i, n in s["networks_from_notes"].items()))
    if s.get("profile_problems"):
        text += ("\nfitted values against their published ranges (profiles' [ranges]; each a mechanism the fit "
                 "hides):\n" + "\n".join(f"  {p}" for p in s["profile_problems"]))
    return text


def search_table(found: Sequence[Any], cluster: ClusterSpec | None = None) -> str:
    """The ranked plans; on a mixed cluster with the pipeline ranks each group runs."""
    mixed = cluster is not None and cluster.is_mixed
    rows = []
    for i, f in enumerate(found, 1):
        e = f.estimate
        rows.append((i, f.plan.short(), *([stages_on(f.plan, cluster)] if mixed else []), f"{e.step_time_s:.3f}",
                     f"{e.tokens_per_s:,.0f}", f"{100 * e.mfu:.1f}",
                     _tightest(e, "/", ".0f"),
                     f"{100 * e.bubble_fraction:.1f}", f"{e.exposed_comm_s:.3f}"))
    return table(("#", "plan", *(["stages on"] if mixed else []), "step s", "tokens/s", "MFU %", "peak GiB",
                  "bubble %", "exposed comm s"), rows)
