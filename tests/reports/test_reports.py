"""Reports: the files a user opens, a golden snapshot of their tables (not pixels), the
predicted-vs-measured section, and the Pareto front."""
from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from costmodel.estimate import estimate
from costmodel.hardware import parse_cluster
from costmodel.plan import PlanFile
from costmodel.registry import resolve_model
from costmodel.schedules import Schedule
from costmodel.specs import TrainSpec
from planner.cli import main
from planner.outputs import REPORT_FIGURES
from planner.space import Choice, build_plan
from reports.build import ReportInput, write_report
from reports.ranking import pareto_front
from runtime.measure import measured_record

GOLDEN = Path(__file__).parent / "golden" / "llama70b_zbh1_tables.md"
FIGURES = ("bubble_schedules", "bubble_warmup", "ledger", "memory_stages", "memory_over_time")


def _llama70b_plan():
    model, cluster = resolve_model("llama-70b"), parse_cluster("8x8xA100")
    train = TrainSpec(seq_len=4096, global_batch_size=1024)
    plan = build_plan(model, train, cluster, Choice(tp=2, pp=8, zero_stage=2, schedule=Schedule.ZB_H1))
    return PlanFile(plan=plan, model=model, train=train, cluster=cluster)


def _tables(markdown: str) -> str:
    return "\n".join(line for line in markdown.splitlines() if line.startswith("|")) + "\n"


def test_plan_report_files_and_golden_tables(tmp_path, monkeypatch):
    pf = _llama70b_plan()
    est = estimate(pf.model, pf.train, pf.cluster, pf.plan)
    from planner.report_plans import schedule_variants
    titles = _record_timeline_titles(monkeypatch)
    files = write_report(ReportInput(model=pf.model, train=pf.train, cluster=pf.cluster, plan=pf.plan, estimate=est,
                                     variants=schedule_variants(pf.model, pf.train, pf.cluster, pf.plan)), tmp_path)
    for stem in FIGURES:
        assert f"{stem}.png" in files and f"{stem}.svg" in files
        assert (tmp_path / f"{stem}.png").stat().st_size > 10_000
    md, page = (tmp_path / "index.md").read_text(), (tmp_path / "index.html").read_text()
    for stem in FIGURES:
        assert f"({stem}.png)" in md and f"src='{stem}.png'" in page
    for heading in ("Where the time goes", "Bubble report", "Memory report", "What limits it"):
        assert heading in md and heading in page
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(_tables(md))
    assert _tables(md) == GOLDEN.read_text(), "tables changed: rerun with UPDATE_GOLDEN=1 if intended"
    _assert_one_bubble_figure(pf, est, md, titles)


def _record_timeline_titles(monkeypatch) -> list[str]:
    import reports.bubble as bubble
    titles, real = [], bubble._draw
    monkeypatch.setattr(bubble, "_draw", lambda ax, sim, title, *a, **k: titles.append(title) or real(ax, sim, title, *a, **k))
    return titles


def _assert_one_bubble_figure(pf, est, md: str, titles: list[str]) -> None:
    """The headline, the ledger, the schedule table, the ranking and the timelines' titles show
    one bubble: the critical rank's idle time in the pipeline phase as a share of the step, with
    the timeline drawn from fewer micro-batches than the step has saying so."""
    from reports.tables import summary_lines
    bubble = f"{100 * est.bubble_fraction:.1f}"
    assert est.bubble_fraction_per_rank[est.critical_rank] == est.bubble_fraction
    assert est.bubble_fraction == est.time_breakdown_s["pipeline/bubble"] / est.step_time_s
    assert f"bubble {bubble}%" in summary_lines(pf.model, pf.train, pf.cluster, pf.plan, est)
    assert f"| pipeline/bubble | {est.time_breakdown_s['pipeline/bubble']:.4f} | {bubble} |" in md
    chosen = next(line for line in md.splitlines() if line.startswith("| chosen:")).split(" | ")
    assert chosen[3] == bubble and chosen[4].split()[est.critical_rank] == bubble
    assert f"the bubble {bubble}%" in md and f"the one the ledger adds up): {bubble}%" in md
    assert titles and all(f"bubble {bubble}% of the step" in t for t in titles if t.startswith("chosen"))
    assert all(f"the first 64 of {pf.plan.num_micro_batches} micro-batches" in t for t in titles)


def test_search_report_adds_the_ranking(tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["search", "--model", "llama3-8b", "--cluster", "1x8xH100", "--report", str(out)]) == 0
    md = (out / "index.md").read_text()
    assert "## Ranking" in md and "(ranking_scatter.png)" in md and (out / "ranking_scatter.svg").exists()
    assert "runner-up" in md


def test_report_command_puts_measured_beside_predicted(tmp_path, capsys):
    pf = _llama70b_plan()
    plan_path = tmp_path / "plan.json"
    pf.save(plan_path)
    raw = {"losses": [10.0, 9.5], "step_times_s": [150.0], "peak_memory_bytes": [70 * 2**30] * 8,
           "memory_source": "torch.cuda.max_memory_allocated", "device": "A100"}
    measured = measured_record(pf, raw, steps=1, warmup=1, wall_s=300.0)
    measured.save(tmp_path / "measured.json")
    out = tmp_path / "rep"
    assert main(["report", str(plan_path), "--measured", str(tmp_path / "measured.json"), "--out", str(out)]) == 0
    md = (out / "index.md").read_text()
    assert "incomplete run" not in md
    # an interrupted run's steps are said to be that
    measured_record(pf, raw, steps=1, warmup=1, wall_s=300.0, complete=False).save(tmp_path / "cut.json")
    assert main(["report", str(plan_path), "--measured", str(tmp_path / "cut.json"), "--out", str(tmp_path / "cut")]) == 0
    assert "An incomplete run: it was interrupted; these are the 1 timed steps" in (tmp_path / "cut" / "index.md").read_text()
    assert "## Predicted and measured" in md and "| step time (s) |" in md and "150.0000" in md
    assert (out / "measured.png").exists() and "(measured.png)" in md
    other = dict(measured.to_dict(), plan={**measured.plan, "zero_stage": 1})
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["report", str(plan_path), "--measured", str(tmp_path / "other.json"), "--out", str(out), "--overwrite"]) == 2
    assert "zero_stage 1 there, 2 here" in capsys.readouterr().err   # the field, not the whole plan
    scaled = dict(measured.to_dict(), step_time_s=1e6)   # not the median of its step times
    (tmp_path / "edited.json").write_text(json.dumps(scaled))
    assert main(["report", str(plan_path), "--measured", str(tmp_path / "edited.json"), "--out", str(out),
                 "--overwrite"]) == 2
    assert "step_time_s 1e+06 is not the median of step_times_s (150)" in capsys.readouterr().err
    # the same plan for another sequence length: the run's plan.json beside its measured.json says so
    longer = tmp_path / "longer" / "plan.json"
    longer.parent.mkdir()
    replace(pf, train=replace(pf.train, seq_len=2 * pf.train.seq_len)).save(longer)
    assert main(["report", str(longer), "--measured", str(tmp_path / "measured.json"), "--out", str(out),
                 "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "was measured for another training than" in err and f"seq_len {pf.train.seq_len} there" in err, err
    # a report over it without the measured run leaves none of the earlier one's figures behind
    figures = {f.name for f in out.iterdir() if f.suffix in (".png", ".svg")}
    assert figures <= set(REPORT_FIGURES) and "measured.png" in figures
    (out / "notes.txt").write_text("the user's")
    assert main(["report", str(plan_path), "--out", str(out), "--overwrite"]) == 0
    assert not (out / "measured.png").exists() and not (out / "measured.svg").exists()
    assert (out / "notes.txt").exists() and "(measured.png)" not in (out / "index.md").read_text()


def test_a_compiled_runs_report_prices_the_plan_as_it_ran(tmp_path):
    """`report --measured` of a `planner run --compile` record: the report's estimate is the
    compiled layers' (the record's own prediction), not the eager layer's."""
    from costmodel.estimate import estimate
    from planner.measure.run_dirs import priced_as_run
    pf = _llama70b_plan()
    pf.save(tmp_path / "plan.json")
    raw = {"losses": [10.0, 9.5], "step_times_s": [150.0], "peak_memory_bytes": [70 * 2**30] * 8,
           "memory_source": "torch.cuda.max_memory_allocated", "device": "A100"}
    compiled = priced_as_run(pf, True)
    measured_record(compiled, raw, steps=1, warmup=1, wall_s=300.0, compiled=True).save(tmp_path / "measured.json")
    assert main(["report", str(tmp_path / "plan.json"), "--measured", str(tmp_path / "measured.json"),
                 "--out", str(tmp_path / "rep")]) == 0
    fused, eager = (estimate(p.model, p.train, p.cluster, p.plan).step_time_s for p in (compiled, pf))
    md = (tmp_path / "rep" / "index.md").read_text()
    assert f"{fused:.3f} s per step" in md and f"{eager:.3f} s per step" not in md


def test_pareto_front():
    points = [(1.0, 5.0), (2.0, 3.0), (2.5, 4.0), (3.0, 1.0), (1.5, 6.0)]
    assert pareto_front(points) == [0, 1, 3]


def test_measured_json_is_strict_and_versioned(tmp_path, capsys):
    """An old measured.json (no version) is migrated, a newer or truncated one is one line, exit 2."""
    from costmodel.measured import MEASURED_FORMAT_VERSION, MeasuredRun
    pf = _llama70b_plan()
    plan_path = tmp_path / "plan.json"
    pf.save(plan_path)
    raw = {"losses": [10.0], "step_times_s": [150.0], "peak_memory_bytes": [70 * 2**30] * 8,
           "memory_source": "torch.cuda.max_memory_allocated", "device": "A100"}
    record = measured_record(pf, raw, steps=1, warmup=1, wall_s=300.0).to_dict()
    old = {k: v for k, v in record.items() if k != "peak_reserved_bytes"}   # a version-1 field left out
    (tmp_path / "old.json").write_text(json.dumps({**old, "version": 1}))
    assert MeasuredRun.load(tmp_path / "old.json").peak_reserved_bytes is None
    unversioned = {k: v for k, v in record.items() if k != "version"}
    for name, text, why in (("bare.json", json.dumps(unversioned), "has no version"),
                            ("new.json", json.dumps({**record, "version": MEASURED_FORMAT_VERSION + 1}), "version"),
                            ("cut.json", json.dumps(record)[:500], "truncated"),
                            ("odd.json", json.dumps({**record, "stepz": 1}), "unknown keys ['stepz']"),
                            ("probe.json", json.dumps({**record, "probe_layer_now_s": 0.01}), "both be positive numbers, or both null")):
        (tmp_path / name).write_text(text)
        assert main(["report", str(plan_path), "--measured", str(tmp_path / name), "--out", str(tmp_path / "r")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and why in err and name in err


def test_memory_over_time_draws_every_plan_s_activations(tmp_path, monkeypatch):
    """The chosen plan's curve too: with more micro-batches than a timeline draws, its schedule
    variant carries a lean simulation without memory curves (drawn from that, its figure would be flat)."""
    import reports.build as build
    seen = []
    real = build.memory_figures
    monkeypatch.setattr(build, "memory_figures", lambda plans, out: seen.extend(plans) or real(plans, out))
    pf = _llama70b_plan()
    assert pf.plan.num_micro_batches > 64
    est = estimate(pf.model, pf.train, pf.cluster, pf.plan)
    from planner.report_plans import schedule_variants
    write_report(ReportInput(model=pf.model, train=pf.train, cluster=pf.cluster, plan=pf.plan, estimate=est,
                             variants=schedule_variants(pf.model, pf.train, pf.cluster, pf.plan)), tmp_path)
    assert seen and all(max(level for _, level in pm.sim.memory_curves[0]) > 0 for pm in seen)


def test_experts_and_context_parallelism_show_in_the_ledger_and_memory_parts(tmp_path, capsys):
    """A mixture under EP x TP and EP x CP: the all-to-alls, the TP gradient sync and the K/V
    exchange are ledger items; the experts' states and the gathered K/V are named in the memory
    report with the figures costmodel.memory gives."""
    from costmodel.memory import cp_gathered_kv_bytes, expert_state_bytes
    for name, flags, items in (("tp", ["--tp", "2"], ("comm/ep_exposed", "comm/tp_replica_sync")),
                               ("cp", ["--cp", "2", "--seq-len", "4096", "--global-batch", "128"],
                                ("comm/ep_exposed", "comm/cp_exposed"))):
        plan_path, out = tmp_path / f"{name}.json", tmp_path / name
        assert main(["predict", "--model", "mixtral-8x7b", "--cluster", "8x8xH100", *flags, "--pp", "4", "--ep", "4",
                     "--zero", "1", "--recompute", "selective", "--out", str(plan_path)]) == 0
        assert main(["report", str(plan_path), "--out", str(out)]) == 0
        capsys.readouterr()
        md = (out / "index.md").read_text()
        assert all(f"| {item} |" in md for item in items)
        pf = PlanFile.load(plan_path)
        est = estimate(pf.model, pf.train, pf.cluster, pf.plan)
        tight = max(range(pf.plan.pp), key=lambda r: est.peak_memory_bytes[r])
        experts = expert_state_bytes(pf.model, pf.train, pf.plan, tight, pf.cluster.framework)
        assert 0 < experts < sum(est.memory_breakdown_bytes[tight][k] for k in ("params", "grads", "optimizer"))
        assert f"Routed experts: {experts / 2**30:.1f} GiB" in md
        kv = cp_gathered_kv_bytes(pf.model, pf.train, pf.plan, pf.cluster.framework)
        assert (f"{kv / 2**20:.1f} MiB per micro-batch" in md) == (name == "cp") and (kv > 0) == (name == "cp")


def test_the_advice_on_exposed_communication_knows_where_the_group_lies():
    """A TP group already inside a node is not told to move inside one; one spread over nodes is."""
    from types import SimpleNamespace

    from reports.build import _comm_remedy
    model, cluster = resolve_model("llama-70b"), parse_cluster("8x8xA100")
    train = TrainSpec(seq_len=4096, global_batch_size=1024)
    for tp, inside in ((8, True), (16, False)):
        plan = build_plan(model, train, cluster, Choice(tp=tp, pp=4, zero_stage=1))
        said = _comm_remedy(SimpleNamespace(plan=plan, cluster=cluster), "comm/tp_exposed")
        assert ("already lies inside a node: a smaller TP degree" in said) == inside
        assert ("a placement that keeps it inside a node" in said) != inside


def test_no_plan_names_only_the_levers_that_shrink_what_overflows(capsys):
    """At a million tokens the activations overflow, not the weights: ZeRO-3 is no lever."""
    assert main(["search", "--model", "llama3-8b", "--cluster", "1x8xH100", "--seq-len", "1000000",
                 "--global-batch", "8"]) == 2
    err = capsys.readouterr().err
    assert "nothing fits" in err and "ZeRO-3" not in err and "more devices" in err


def test_a_measured_mfu_above_the_peak_says_the_profile_is_short():
    from costmodel.measured import shown_mfu
    assert shown_mfu(0.684) == "68.4%"
    assert shown_mfu(1.075, 2) == "107.50% (above the profile's peak: profile again, longer)"
