"""Write docs/results.md and docs/validation.md from the product checks, measured now, here.

    python3 scripts/results.py [--time-limit S] [--with-plan-quality] [--with-claims] [--with-closed-loop]

Each check calls what its benchmark calls, or runs the benchmark and reads its printed lines:
- accuracy in sample: `planner.measure.validate.validate` (what `python3 -m planner validate --json` prints);
- accuracy on sources left out of the fit: `planner.measure.fit.fill_rows` and `leave_one_source_out`,
  and at scale, `leave_scale_out` (what `python3 benchmarks/fidelity.py` prints), and its families split per micro-batch and per step
  (`planner.measure.step_split`), and its rows priced as a framework the model does not know
  (`planner.measure.unknown_framework`);
- one GPU: `benchmarks/gpu_check.py`'s `replay` of the stored H100 and H200 runs (no GPU needed);
- search speed: `benchmarks/search_speed.py`'s `run`, case by case;
- simulator speed: `python3 benchmarks/simulate_speed.py`, its printed lines;
- `--with-plan-quality`: `python3 benchmarks/plan_quality.py --time-limit-s 10` (about 5 minutes);
- `--with-claims`: `python3 benchmarks/plan_quality.py --as-published --time-limit-s 10` (about 10 minutes);
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
sys.path.insert(0, str(Path(__file__).resolve().parent))   # the pages beside this script
from results_pages import (  # noqa: E402
    CMD_CLAIMS,
    CMD_FIDELITY,
    CMD_LOOP,
    CMD_QUALITY,
    CMD_SEARCH,
    CMD_SIMULATE,
    CMD_VALIDATE,
    GPU_RUNS,
    accuracy_section,
    claims_section,
    closed_loop_section,
    kept_sections,
    plan_quality_section,
    results_md,
    speed_section,
    validation_md,
    wrap,
)

RESULTS, VALIDATION = ROOT / "docs" / "results.md", ROOT / "docs" / "validation.md"


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
    from planner.measure.step_split import step_splits
    from planner.measure.unknown_framework import price_as_unknown
    from planner.measure.validate import step_time_error_pct, validate
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
    clock.tick(f"accuracy at scale: the runs on {fit.SCALE_OUT_GPUS:,} or more GPUs by a fit on the smaller ones ({CMD_FIDELITY})")
    scaled = fit.scale_out_summary(filled, progress=clock.tick)
    rows = [_row(res, row, loso.get(res.id), step_time_error_pct, fit.source_group(row["source"]))
            for res, row in zip(results, csv_rows)]
    clock.tick(f"accuracy, frameworks unknown: every measured row priced with generic traits ({CMD_FIDELITY})")
    unknown = price_as_unknown(csv_rows).to_dict()
    splits = [{"label": f.label, "micro_batches": f.micro_batches, "per_micro_batch_s": f.measured_per_micro_batch_s,
               "per_micro_batch_error_pct": f.per_micro_batch_error_pct, "per_step_s": f.measured_per_step_s,
               "per_step_error_s": f.per_step_error_s} for f in step_splits(csv_rows, results)]
    return {"rows": rows, "summary": summary, "left_out": fit.summary(list(loso.values())),
            "scale_out": scaled, "unknown_framework": unknown,
            "num_sources": len({r.source for r in filled}), "coverage": fit.coverage(filled),
            "splits": splits, "unmodelled": measure_unmodelled(clock)}


UNMODELLED = ("profiles/runs/unmodelled_runs.csv", "profiles/runs/gb200_runs.csv", "profiles/runs/b300_runs.csv",
              "profiles/runs/gb300_runs.csv")


def measure_unmodelled(clock: Clock) -> list[dict]:
    """The published runs kept out of the calibration (profiles/runs/unmodelled_runs.csv: software
    the model has no traits for, or a plan it refuses; gb200_runs.csv, b300_runs.csv, gb300_runs.csv:
    a device priced with another chip's fitted values, its runs the check of that): `planner
    validate` row by row, a refused row counted apart. Errors of step time."""
    from costmodel.inputs import UserError
    from planner.measure.runs_table import read_runs
    from planner.measure.validate import step_time_error_pct, summarize, validate_row
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
        steps = [abs(step_time_error_pct(row, r.error_pct)) for r, row in zip(results, kept) if r.error_pct is not None]
        out.append({"table": table, "n": s["n"], "mape_pct": sum(steps) / len(steps), "max_abs_error_pct": max(steps),
                    "spearman": s["spearman"], "fits": sum(r.fits for r in results if r.error_pct is not None),
                    "refused": refused})
    return out


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
            "error_pct": res.error_pct, "fits": res.fits, "past_budget": res.past_budget is not None,
            "filled": res.filled,
            "step_error_pct": None if res.error_pct is None else step_error(row, res.error_pct),
            "left_out_pct": None if left_out_log is None else 100 * (math.exp(left_out_log) - 1)}


def measure_gpu_replay(clock: Clock) -> dict[str, dict]:
    """Each lent GPU's stored runs priced again: {GPU name: step and memory errors}."""
    gpu_check = load_benchmark("gpu_check")
    out = {}
    for name, (folder, profile, command) in GPU_RUNS.items():
        clock.tick(f"one GPU: the stored {name} runs priced again ({command})")
        rows = gpu_check.replay(ROOT / folder, ROOT / profile)
        step = [100 * (r["predicted_step_s"] / r["measured_step_s"] - 1) for r in rows]
        mem = [100 * (r["predicted_peak_bytes"] / r["measured_allocated_bytes"] - 1) for r in rows]
        out[name] = {"n": len(rows), "step_mape_pct": statistics.mean(map(abs, step)),
                     "step_max_pct": max(map(abs, step)), "memory_mape_pct": statistics.mean(map(abs, mem)),
                     "memory_max_pct": max(map(abs, mem)), "too_fast": sum(e < 0 for e in step)}
    return out


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


CLAIM_LINE = re.compile(r"^\s+fixed \{\}: fastest (.+?), ([\d.]+) s against ([\d.]+) s measured \(([+-][\d.]+)%\)")
FLAGGED_HEAD = re.compile(r"^the search claims more than (\d+)% over the measured run: \d+ rows$")
FLAGGED_ROW = re.compile(r"^  (\S+) \(([+-]\d+%): (.+) against (.+)\)$")


def parse_claims(text: str) -> dict:
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines) if FLAGGED_HEAD.match(line)), None)
    if head is None:
        raise Failed(f"{CMD_CLAIMS} printed no list of claims")
    flagged = [{"id": m[1], "claim": m[2], "fastest": m[3], "published": m[4]}
               for m in map(FLAGGED_ROW.match, lines[head + 1:]) if m]
    return {"rows": [{"claim_pct": float(m[4])} for m in map(CLAIM_LINE.match, lines) if m],
            "skipped": sum(" skipped: " in line for line in lines), "flagged": flagged,
            "threshold_pct": int(FLAGGED_HEAD.match(lines[head])[1])}


def measure_claims(clock: Clock) -> dict:
    clock.tick(f"claims over measured runs, about ten minutes ({CMD_CLAIMS})")
    return parse_claims(run_benchmark(CMD_CLAIMS.split()[1:], clock))


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
    parser.add_argument("--with-claims", action="store_true", help=f"also {CMD_CLAIMS} (minutes)")
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
            ("claims", args.with_claims, measure_claims, claims_section),
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
