"""Write docs/results.md and docs/validation.md from the product checks, measured now, here.

    python3 scripts/results.py [--time-limit S] [--with-plan-quality] [--with-closed-loop]

Each check calls what its benchmark calls, or runs the benchmark and reads its printed lines:
- accuracy in sample: `planner.measure.validate.validate` (what `python3 -m planner validate --json` prints);
- accuracy on sources left out of the fit: `planner.measure.fit.fill_rows` and `leave_one_source_out`
  (what `python3 benchmarks/fidelity.py` prints);
- one GPU: `benchmarks/gpu_check.py`'s `replay` of the stored H100 runs (no GPU needed);
- search speed: `benchmarks/search_speed.py`'s `run`, case by case;
- simulator speed: `python3 benchmarks/simulate_speed.py`, its printed lines;
- `--with-plan-quality`: `python3 benchmarks/plan_quality.py --time-limit-s 10` (about 5 minutes);
- `--with-closed-loop`: `python3 benchmarks/closed_loop.py --out out/closed-loop` (about 10 minutes).

Both files are written whole, and only once every check asked for has ended: a time limit
(`--time-limit`, default 3600 s), Ctrl-C or a failing main check leaves them as they were. The
optional sections not measured in a run (or whose check failed: exit 1) keep their earlier text
from docs/results.md, which carries its own date and machine. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS, VALIDATION = ROOT / "docs" / "results.md", ROOT / "docs" / "validation.md"
# the stored runs of the one lent GPU (benchmarks/results/gpu-check-h100-<date>)
GPU_RUNS = str(min((ROOT / "benchmarks" / "results").glob("gpu-check-h100-*")).relative_to(ROOT))
CMD_VALIDATE = "python3 -m planner validate --json"
CMD_FIDELITY = "python3 benchmarks/fidelity.py"
CMD_GPU = f"python3 benchmarks/gpu_check.py --replay {GPU_RUNS} --profile {GPU_RUNS}/run2/gpu.toml"
CMD_SEARCH = "python3 benchmarks/search_speed.py"
CMD_SIMULATE = "python3 benchmarks/simulate_speed.py"
CMD_QUALITY = "python3 benchmarks/plan_quality.py --time-limit-s 10"
CMD_LOOP = "python3 benchmarks/closed_loop.py --out out/closed-loop"
OPTIONAL = ("plan-quality", "closed-loop")


class Stopped(Exception):
    """The time limit passed or the user interrupted: nothing is written."""


class Failed(Exception):
    """A benchmark exited with an error (its stderr's end attached)."""


class Clock:
    def __init__(self, limit_s: float) -> None:
        self.start = time.perf_counter()
        self.deadline = self.start + limit_s

    def tick(self, message: str) -> None:
        print(f"results [{time.perf_counter() - self.start:6.0f} s] {message}", file=sys.stderr, flush=True)
        self.left()

    def left(self) -> float:
        left = self.deadline - time.perf_counter()
        if left <= 0:
            raise Stopped("the time limit passed")
        return left


def machine() -> dict:
    """The processor as lscpu names it, the cores, the software and the date."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        cpu = re.search(r"^Model name:\s*(.+)$", out, re.M)[1].strip()
    except (OSError, subprocess.SubprocessError, TypeError):
        cpu = platform.processor() or "unknown processor"
    try:
        from importlib.metadata import version
        torch = version("torch")
    except Exception:   # noqa: BLE001 - no torch: the pure checks still run
        torch = "not installed"
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load": os.getloadavg()[0]}


def machine_line(m: dict) -> str:
    """Where and when; the load average says whether other work shared the cores (speed figures)."""
    return (f"{m['date']} on {m['cpu']}, {m['cores']} cores (lscpu), Python {m['python']}, torch {m['torch']}, "
            f"load average {m['load']:.1f} at the start")


def load_benchmark(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_benchmark(args: list[str], clock: Clock) -> str:
    """A benchmark as its own process group (it starts torchrun and ranks of its own), ended
    whole on a time limit or Ctrl-C; its stdout."""
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=clock.left())
    except BaseException as exc:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise Stopped(f"the time limit passed during {' '.join(args)}") from None
        raise
    if proc.returncode != 0:
        raise Failed(f"{' '.join(args)} failed (exit {proc.returncode}):\n{err[-2000:]}")
    return out


# ---- the checks --------------------------------------------------------------------------------

def measure_accuracy(clock: Clock) -> dict:
    """`planner validate` over the published runs, then each source predicted by a fit on the others."""
    from costmodel.inputs import UserError
    from planner.measure import fit
    from planner.measure.runs_table import default_runs_path, read_runs, row_specs
    from planner.measure.validate import validate
    fidelity = load_benchmark("fidelity")
    path = default_runs_path()
    csv_rows = read_runs(path)
    clock.tick(f"accuracy in sample: {len(csv_rows)} published runs ({CMD_VALIDATE})")
    try:
        results, summary = validate(path, time_limit_s=clock.left())
    except UserError as exc:   # validate's own time limit: ours
        raise Stopped(str(exc)) from None
    clock.tick(f"accuracy left out: refitting without each source in turn ({CMD_FIDELITY})")
    # the plans validate chose are the ones fit.fill_rows would choose (the same best_plan_for_row)
    filled = [fit.FilledRow(row=row, model=m, train=t, cluster=c, plan=res.plan)
              for res, row in zip(results, csv_rows) if res.error_pct is not None
              for m, t, c in [row_specs(row)]]
    loso = {r.row["id"]: e for r, e in fit.leave_one_source_out(filled, progress=clock.tick)}
    rows = [_row(res, row, loso.get(res.id), fidelity.step_time_error_pct, fit.source_group(row["source"]))
            for res, row in zip(results, csv_rows)]
    return {"rows": rows, "summary": summary, "left_out": fit.summary(list(loso.values())),
            "num_sources": len({r.source for r in filled}), "unmodelled": measure_unmodelled(clock)}


UNMODELLED = ("profiles/runs/unmodelled_runs.csv",)


def measure_unmodelled(clock: Clock) -> list[dict]:
    """The published runs kept out of the calibration (profiles/runs/unmodelled_runs.csv: software
    the model has no traits for, or a plan it refuses): `planner validate` row by row, a refused
    row counted apart."""
    from costmodel.inputs import UserError
    from planner.measure.runs_table import read_runs
    from planner.measure.validate import summarize, validate_row
    out = []
    for table in UNMODELLED:
        rows = read_runs(ROOT / table)
        clock.tick(f"runs kept out of the calibration: {len(rows)} rows of {table} (python3 -m planner validate {table})")
        results, kept, refused = [], [], []
        for row in rows:
            try:
                results.append(validate_row(row))
                kept.append(row)
            except UserError as exc:
                refused.append(f"{row['id']}: {str(exc).split(': ', 1)[-1]}")
        s = summarize(results, kept)
        out.append({"table": table, "n": s["n"], "mape_pct": s["mape_pct"], "max_abs_error_pct": s["max_abs_error_pct"],
                    "spearman": s["spearman"], "fits": sum(r.fits for r in results if r.error_pct is not None),
                    "refused": refused})
    return out


def _reasons(refused: list[str]) -> str:
    """Refused rows ('id: reason') as each reason with its count, the first row named."""
    by: dict[str, list[str]] = {}
    for entry in refused:
        rid, _, reason = entry.partition(": ")
        by.setdefault(reason, []).append(rid)
    return "; ".join(f"{reason} ({len(ids)}, e.g. {ids[0]})" for reason, ids in by.items())


def _row(res, row: dict, left_out_log: float | None, step_error, source: str) -> dict:
    """One published run as the pages show it: validate's result, its model, the left-out error."""
    from costmodel.params import active_params, total_params
    from planner.measure.runs_table import row_specs
    model = row_specs(row)[0]
    total, active = total_params(model), active_params(model)
    size = f"{total / 1e9:.1f}B" + (f" ({active / 1e9:.1f}B active)" if active < total else "")
    return {"id": res.id, "source": source, "framework": row.get("framework") or "",
            "model": f"{row['arch']} {size}, seq {row['seq_len']}", "gpus": int(row["num_gpus"]),
            "device": row["gpu"], "metric": res.metric, "published": res.published, "predicted": res.predicted,
            "error_pct": res.error_pct, "fits": res.fits, "filled": res.filled,
            "step_error_pct": None if res.error_pct is None else step_error(row, res.error_pct),
            "left_out_pct": None if left_out_log is None else 100 * (math.exp(left_out_log) - 1)}


def measure_gpu_replay(clock: Clock) -> dict:
    clock.tick(f"one GPU: the stored H100 runs priced again ({CMD_GPU})")
    gpu_check = load_benchmark("gpu_check")
    runs = ROOT / GPU_RUNS
    rows = gpu_check.replay(runs, runs / "run2" / "gpu.toml")
    step = [100 * (r["predicted_step_s"] / r["measured_step_s"] - 1) for r in rows]
    mem = [100 * (r["predicted_peak_bytes"] / r["measured_allocated_bytes"] - 1) for r in rows]
    return {"n": len(rows), "step_mape_pct": statistics.mean(map(abs, step)), "step_max_pct": max(map(abs, step)),
            "memory_mape_pct": statistics.mean(map(abs, mem)), "memory_max_pct": max(map(abs, mem)),
            "too_fast": sum(e < 0 for e in step)}


def measure_search_speed(clock: Clock) -> list[dict]:
    search_speed = load_benchmark("search_speed")
    out = []
    for model, cluster, extra, target in search_speed.CASES:
        clock.tick(f"search speed: {model} on {cluster} {' '.join(extra)} ({CMD_SEARCH})")
        r = search_speed.run(model, cluster, min(600.0, clock.left()), extra)
        clock.left()
        out.append({"model": model, "cluster": " ".join((cluster, *extra)), "target_s": target, **r})
    return out


SIM_LINE = re.compile(r"^(stage costs|simulate \(totals\)|simulate \(timeline\)|whole estimate)\s+([\d.]+) ms$", re.M)


def measure_simulate_speed(clock: Clock) -> dict:
    clock.tick(f"simulator speed ({CMD_SIMULATE})")
    text = run_benchmark(["benchmarks/simulate_speed.py"], clock)
    return {"case": text.splitlines()[0], **{name: float(ms) for name, ms in SIM_LINE.findall(text)}}


QUALITY_ROW = re.compile(r"^(\S+)\s+([\d,]+)(\*?)(†?)\s+([\d,]+)\s+([+-][\d.]+)%\s+([+-][\d.]+)%\s+(>?\d+)\s+"
                         r"(True|False)\s+(.*)$")


NOTHING_ROW = re.compile(r"^(\S+)\s+[\d,]+\*?†?\s+-\s+search found nothing$")


def parse_plan_quality(text: str) -> dict:
    rows, nothing = [], []
    for line in text.splitlines():
        m, empty = QUALITY_ROW.match(line), NOTHING_ROW.match(line)
        if empty:
            nothing.append(empty[1])
        elif m:
            rows.append({"id": m[1], "published_tok_s": int(m[2].replace(",", "")), "published_fits": not m[3],
                         "published_runs": not m[4], "fastest_tok_s": int(m[5].replace(",", "")), "gain_pct": float(m[6]),
                         "chosen_pct": float(m[7]), "rank": m[8], "proven": m[9] == "True", "plan": m[10].strip()})
    worse = re.search(r"fastest plan predicted slower than the published one: (\d+) rows", text)
    return {"rows": rows, "nothing": nothing, "worse": int(worse[1]) if worse else None}


def measure_plan_quality(clock: Clock) -> dict:
    clock.tick(f"plan quality, a few minutes ({CMD_QUALITY})")
    return parse_plan_quality(run_benchmark(CMD_QUALITY.split()[1:], clock))


LOOP_SUMMARY = re.compile(r"^MAPE ([\d.]+)%\s+max \|error\| ([\d.]+)%\s+Spearman ([-\d.na]+)\s+\((\d+) plans\)$")


def parse_closed_loop(text: str) -> dict:
    """Each table's label (the line before its header) and its summary line."""
    lines, tables = text.splitlines(), []
    for i, line in enumerate(lines):
        m = LOOP_SUMMARY.match(line.strip())
        if m:
            start = max(j for j in range(i) if lines[j].startswith("plan ")) - 1
            tables.append({"label": lines[start].strip(), "mape_pct": float(m[1]), "max_pct": float(m[2]),
                           "spearman": m[3], "plans": int(m[4])})
    spread = re.search(r"the passes of a plan lie ([\d.]+) % apart", text)
    took = re.search(r"^(\d+) s; command:", text, re.M)
    return {"tables": tables, "pass_spread_pct": float(spread[1]) if spread else None,
            "wall_s": int(took[1]) if took else None}


def measure_closed_loop(clock: Clock) -> dict:
    clock.tick(f"closed loop on this machine, about 10 minutes ({CMD_LOOP})")
    return parse_closed_loop(run_benchmark(CMD_LOOP.split()[1:], clock))


# ---- the pages -----------------------------------------------------------------------------------

def cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def pct(value: float | None, sign: bool = True) -> str:
    return "-" if value is None else (f"{value:+.1f}" if sign else f"{value:.1f}")


def metric_value(metric: str, value) -> str:
    if isinstance(value, str):
        return value
    return f"{value:.3f} s" if metric == "iteration_time_s" else f"{value:,.0f} tok/s/GPU"


def validation_md(acc: dict, meta: dict) -> str:
    s, lo = acc["summary"], acc["left_out"]
    head = ["# Validation: predicted against published runs", "",
            "Generated by `python3 scripts/results.py`; do not edit. Each row of `profiles/runs/published_runs.csv` "
            f"priced by `{CMD_VALIDATE}`, measured {machine_line(meta)}.", "",
            "`published` and `predicted` are the row's metric (an iteration time, or tokens/s per GPU); `error %` is "
            "of that metric, (predicted - published) / published, as `planner validate` prints it (for tokens/s, + "
            "is predicted too fast). `left out %` is the step time's error when the row's whole source is left out "
            f"of the efficiency fit (`{CMD_FIDELITY}`; + is predicted too slow). `filled` lists the plan fields the "
            "row left empty and the planner chose.", "",
            f"In sample: {s['n']} rows, MAPE {pct(s['mape_pct'], False)} %, max |error| "
            f"{pct(s['max_abs_error_pct'], False)} %, Spearman {s['spearman']:.3f}. Left out ({acc['num_sources']} "
            f"sources): MAPE {lo['mape_pct']:.1f} %, max |error| {lo['max_abs_error_pct']:.1f} % of step time.", "",
            "| id | source | model | GPUs | device | framework | published | predicted | error % | left out % "
            "| filled |",
            "|---|---|---|---:|---|---|---:|---:|---:|---:|---|"]
    body = []
    for r in acc["rows"]:
        filled = ", ".join(f"{k}={v}" for k, v in r["filled"].items()) or "-"
        body.append("| " + " | ".join(cell(x) for x in (
            r["id"], r["source"], r["model"], r["gpus"], r["device"], r["framework"] or "-",
            metric_value(r["metric"], r["published"]), metric_value(r["metric"], r["predicted"]),
            pct(r["error_pct"]), pct(r["left_out_pct"]), filled)) + " |")
    return "\n".join(head + body) + "\n"


def per_source(rows: list[dict]) -> list[str]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["step_error_pct"] is not None:
            groups.setdefault(r["source"], []).append(r)
    out = ["| source | rows | in sample: MAPE / worst % | left out: MAPE / worst % |", "|---|---:|---:|---:|"]
    for source, rs in sorted(groups.items()):
        ins, lo = [r["step_error_pct"] for r in rs], [r["left_out_pct"] for r in rs if r["left_out_pct"] is not None]
        out.append(f"| {cell(source)} | {len(rs)} | {statistics.mean(map(abs, ins)):.1f} / {pct(max(ins, key=abs))} | "
                   + (f"{statistics.mean(map(abs, lo)):.1f} / {pct(max(lo, key=abs))} |" if lo else "- |"))
    return out


def accuracy_section(acc: dict, gpu: dict, band: float, meta: dict) -> str:
    s, lo = acc["summary"], acc["left_out"]
    steps = [abs(r["step_error_pct"]) for r in acc["rows"] if r["step_error_pct"] is not None]
    return "\n".join([
        "## Accuracy", "", f"Measured {machine_line(meta)}.", "",
        "| check | rows | MAPE % | max \\|error\\| % | Spearman | command |", "|---|---:|---:|---:|---:|---|",
        f"| published runs, in sample (error of the published metric) | {s['n']} | {s['mape_pct']:.1f} | "
        f"{s['max_abs_error_pct']:.1f} | {s['spearman']:.3f} | `{CMD_VALIDATE}` |",
        f"| published runs, in sample (error of step time) | {len(steps)} | {statistics.mean(steps):.1f} | "
        f"{max(steps):.1f} | | `{CMD_FIDELITY}` |",
        f"| published runs, each source left out of the fit ({acc['num_sources']} sources; step time) | {lo['n']} | "
        f"{lo['mape_pct']:.1f} | {lo['max_abs_error_pct']:.1f} | | `{CMD_FIDELITY}` |",
        f"| one H100, stored runs priced by this code: step time | {gpu['n']} | {gpu['step_mape_pct']:.1f} | "
        f"{gpu['step_max_pct']:.1f} | | `{CMD_GPU}` |",
        f"| one H100, stored runs priced by this code: peak memory | {gpu['n']} | {gpu['memory_mape_pct']:.1f} | "
        f"{gpu['memory_max_pct']:.1f} | | (the same) |",
        *(f"| runs kept out of the calibration: `{f['table']}` ({f['fits']} of {f['n']} predicted to fit"
          + (f"; {len(f['refused'])} refused: {cell(_reasons(f['refused']))}" if f["refused"] else "")
          + f") | {f['n']} | {f['mape_pct']:.1f} | {f['max_abs_error_pct']:.1f} | {f['spearman']:.3f} | "
          f"`python3 -m planner validate {f['table']}` |" for f in acc.get("unmodelled", [])), "",
        *([f"Fitted values at a bound of their published range (profiles' `[ranges]`; each a mechanism the fit "
           f"hides): {cell('; '.join(s['profile_problems']))}.", ""] if s.get("profile_problems") else []),
        f"Published runs: `profiles/runs/published_runs.csv` ({s['n']} timed rows; every row in "
        "[validation.md](validation.md)); the profiles were fitted on this table, so the in-sample rows flatter "
        "and the left-out ones are the error to expect on a kind of run the table does not hold. "
        f"{gpu['too_fast']} of the {gpu['n']} H100 runs are predicted too fast. The H100 runs were measured "
        f"once on a lent GPU ({GPU_RUNS}/README.md); the replay prices them with the current cost model and runs "
        "nothing on a GPU.", "",
        f"The search's error band (`costmodel/fidelity.py` `MODEL_ERROR_BAND`) is {100 * band:.1f} %; the "
        f"leave-one-source-out MAPE measured here is {lo['mape_pct']:.1f} %"
        + (" (the same)." if abs(100 * band - lo["mape_pct"]) < 0.05 else " (they differ: the band is set by hand)."),
        "", "Per source (step time; + predicted too slow):", "", *per_source(acc["rows"])])


def speed_section(search: list[dict], sim: dict, meta: dict) -> str:
    lines = ["## Speed", "", f"Measured {machine_line(meta)}.", "",
             f"Search (`{CMD_SEARCH}`: each case one `planner search --json` process; `search s` is the search's own "
             "wall time, `command s` the whole command with interpreter start and imports):", "",
             "| model | cluster | target s | search s | command s | candidates | solved | proven optimal |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in search:
        if not r["finished"]:
            lines.append(f"| {r['model']} | {r['cluster']} | {r['target_s']:.1f} | did not finish | | | | |")
            continue
        lines.append(f"| {r['model']} | {r['cluster']} | {r['target_s']:.1f} | {r['wall_s']:.2f} | "
                     f"{r['command_s']:.2f} | {r['num_candidates']:,} | {r['num_solved']} | {r['optimal']} |")
    lines += ["", f"Pipeline simulator (`{CMD_SIMULATE}`, median of 20): {cell(sim['case'])}.", "",
              "| what | ms |", "|---|---:|"]
    lines += [f"| {name} | {sim[name]:.1f} |" for name in
              ("stage costs", "simulate (totals)", "simulate (timeline)", "whole estimate") if name in sim]
    return "\n".join(lines)


def plan_quality_section(q: dict, meta: dict) -> str:
    rows = q["rows"]
    lines = ["## Plan quality", "", f"Measured {machine_line(meta)}: `{CMD_QUALITY}`.", "",
             "For every published run, the search's plan against the published configuration, both priced as our "
             "runtime would run them. `gain`: the fastest plan's predicted tokens/s over the published one's; "
             "`chosen`: the plan shown first (the most robust within the error band).", "",
             f"Rows with a plan {len(rows)}; proven optimal within the 10 s limit {sum(r['proven'] for r in rows)}; "
             f"median gain {statistics.median(r['gain_pct'] for r in rows):+.1f} %, median chosen "
             f"{statistics.median(r['chosen_pct'] for r in rows):+.1f} %; "
             f"published configuration not fitting our memory margins {sum(not r['published_fits'] for r in rows)}, "
             f"not run by our runtime as published {sum(not r['published_runs'] for r in rows)}; "
             f"fastest plan predicted slower than a published one our runtime runs and fits {q['worse']} rows; "
             "no plan found within the "
             f"10 s limit {len(q['nothing'])} rows" + (f" ({', '.join(q['nothing'])})." if q["nothing"] else "."), "",
             "<details><summary>every row</summary>", "",
             "| id | published tok/s | fastest tok/s | gain % | chosen % | rank | proven | chosen plan |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    lines += [f"| {r['id']} | {r['published_tok_s']:,}{'' if r['published_fits'] else '*'}"
              f"{'' if r['published_runs'] else '†'} | {r['fastest_tok_s']:,} "
              f"| {r['gain_pct']:+.1f} | {r['chosen_pct']:+.1f} | {cell(r['rank'])} | {r['proven']} | `{r['plan']}` |"
              for r in rows]
    return "\n".join(lines + ["", "`*`: the published configuration does not fit under our memory margins; `†`: our "
                              "runtime cannot run it as published (costmodel.check.check_plan: e.g. float8 linears "
                              "with tensor parallelism), so the search does not offer it.", "", "</details>"])


def closed_loop_section(loop: dict, meta: dict) -> str:
    lines = ["## Closed loop on this machine", "", f"Measured {machine_line(meta)}: `{CMD_LOOP}` "
             f"({loop['wall_s']} s): a fresh profile, then a model no registry or probe holds, run by `planner run` in "
             "twelve plans (single rank, full recompute, DP, PP, TP+SP, CP; fp32 and bf16), predicted against measured "
             "step time.", "", "| table | plans | MAPE % | max \\|error\\| % | Spearman |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {cell(t['label'])} | {t['plans']} | {t['mape_pct']:.1f} | {t['max_pct']:.1f} | {t['spearman']} |"
              for t in loop["tables"]]
    if loop["pass_spread_pct"] is not None:
        lines += ["", f"A plan's passes lie {loop['pass_spread_pct']:.1f} % apart (median): the measurement's own "
                  "noise."]
    return "\n".join(lines)


SECTION = re.compile(r"<!-- section: ([\w-]+) -->\n(.*?)<!-- end: \1 -->\n", re.S)


def wrap(name: str, text: str) -> str:
    return f"<!-- section: {name} -->\n{text.rstrip()}\n<!-- end: {name} -->\n"


NOT_MEASURED = "Not measured yet"


def kept_sections(old: str) -> dict[str, str]:
    """The measured sections of an earlier docs/results.md, by name, each as written (with its own date)."""
    return {m[1]: wrap(m[1], m[2]) for m in SECTION.finditer(old) if NOT_MEASURED not in m[2]}


def results_md(sections: dict[str, str], meta: dict, command: str) -> str:
    head = ["# Results", "",
            f"Every figure the README and `docs/` quote, written by `{command}` ({machine_line(meta)}); do not edit. "
            "Each section names the machine, the date and the command that regenerates it. Optional sections "
            "(`--with-plan-quality`, `--with-closed-loop`) keep their last measurement until measured again.", ""]
    order = ("accuracy", "speed", *OPTIONAL)
    missing = {"plan-quality": f"## Plan quality\n\n{NOT_MEASURED}: "
                               "`python3 scripts/results.py --with-plan-quality`.",
               "closed-loop": f"## Closed loop on this machine\n\n{NOT_MEASURED}: "
                              "`python3 scripts/results.py --with-closed-loop` (about 10 minutes on two cores with "
                              "fast bf16, AMX or AVX-512 bf16; its bf16 plans take far longer on a CPU without)."}
    return "\n".join(head) + "\n" + "\n".join(sections.get(n) or wrap(n, missing[n]) for n in order)


def write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt   # SIGTERM as Ctrl-C: the benchmark process is killed, nothing written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--time-limit", type=float, default=3600.0, metavar="S",
                        help="stop after S seconds in all, writing nothing (default 3600)")
    parser.add_argument("--with-plan-quality", action="store_true", help=f"also {CMD_QUALITY} (minutes)")
    parser.add_argument("--with-closed-loop", action="store_true", help=f"also {CMD_LOOP} (about 10 minutes)")
    args = parser.parse_args()
    if not args.time_limit > 0:
        parser.error("--time-limit must be positive")
    sys.path.insert(0, str(ROOT))
    signal.signal(signal.SIGTERM, _terminated)
    clock, meta = Clock(args.time_limit), machine()
    command = " ".join(["python3 scripts/results.py", *sys.argv[1:]])
    sections = kept_sections(RESULTS.read_text()) if RESULTS.exists() else {}
    try:
        from costmodel.fidelity import MODEL_ERROR_BAND
        acc = measure_accuracy(clock)   # each section says when it was measured, and the load then
        sections["accuracy"] = wrap("accuracy", accuracy_section(acc, measure_gpu_replay(clock), MODEL_ERROR_BAND,
                                                                 meta))
        at = machine()
        search, sim = measure_search_speed(clock), measure_simulate_speed(clock)
        sections["speed"] = wrap("speed", speed_section(search, sim, at))
        failed = [name for name, asked, measure, render in optional_checks(args)
                  if asked and not _optional(sections, name, measure, render, clock)]
    except Stopped as exc:
        print(f"results: stopped, {exc} (--time-limit {args.time_limit:g}); nothing written", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("results: interrupted; nothing written", file=sys.stderr)
        return 130
    except Failed as exc:
        print(f"results: {exc}\nnothing written", file=sys.stderr)
        return 1
    write(VALIDATION, validation_md(acc, meta))
    write(RESULTS, results_md(sections, meta, command))
    clock.tick(f"wrote {RESULTS.relative_to(ROOT)} and {VALIDATION.relative_to(ROOT)}"
               + (f"; {', '.join(failed)} failed and kept its earlier text" if failed else ""))
    return 1 if failed else 0


def optional_checks(args: argparse.Namespace) -> list[tuple]:
    """(section, asked for, measure, render) of each slow check."""
    return [("plan-quality", args.with_plan_quality, measure_plan_quality, plan_quality_section),
            ("closed-loop", args.with_closed_loop, measure_closed_loop, closed_loop_section)]


def _optional(sections: dict[str, str], name: str, measure, render, clock: Clock) -> bool:
    """A slow check: where it fails (a busy machine's profile may refuse to be written), its
    earlier section stays and the other figures are still written."""
    at = machine()
    try:
        sections[name] = wrap(name, render(measure(clock), at))
    except Failed as exc:
        print(f"results: {exc}\n(keeping the earlier {name} section)", file=sys.stderr)
        return False
    return True


if __name__ == "__main__":
    sys.exit(main())
