"""The interactive report page (reports/html.py): self-contained, its data one inline JSON blob
with the cost model's own figures, and in a real headless Chromium it renders with no error and
passes its own self-test (sort, zoom, hover; #selftest)."""
from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import subprocess
from pathlib import Path

import pytest

from costmodel.plan import PlanFile
from planner.cli import main
from reports.html import data_blob

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = runpy.run_path(str(ROOT / "scripts" / "report_screenshot.py"))
INSTALL_TIMEOUT_S = 600


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium, installed once when missing (CI runs as root on Debian); skipped with
    the reason where it cannot be, and never waiting on a registry longer than the timeout."""
    found = shutil.which("chromium")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("chromium is missing and cannot be installed here (needs root and apt-get)")
    try:
        done = subprocess.run(["sh", "-c", "apt-get update && apt-get install -y chromium"],
                              capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"installing chromium took over {INSTALL_TIMEOUT_S} s (no package registry?)")
    if done.returncode != 0 or shutil.which("chromium") is None:
        pytest.skip(f"apt-get could not install chromium: {done.stderr.strip().splitlines()[-1:]}")
    return shutil.which("chromium")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """`planner report` of a pipelined llama-70b plan on 8x8xA100: its index.html."""
    work = tmp_path_factory.mktemp("page")
    plan = work / "plan.json"
    assert main(["predict", "--model", "llama-70b", "--cluster", "8x8xA100", "--tp", "4", "--pp", "8",
                 "--out", str(plan)]) == 0
    assert main(["report", str(plan), "--out", str(work / "report")]) == 0
    return work / "report" / "index.html"


def _status(dom: str) -> dict[str, str]:
    tag = re.search(r"<div id=\"report-status\"[^>]*>", dom)
    assert tag, "no #report-status in the page"
    return dict(re.findall(r"data-([a-z]+)=\"([^\"]*)\"", tag.group(0)))


def test_the_page_fetches_nothing_and_carries_the_cost_model_s_figures(report, capsys):
    from costmodel.estimate import estimate
    page = report.read_text()
    assert not re.search(r"(src|href)\s*=\s*['\"]?\s*(https?:)?//", page, re.I), "a reference off this machine"
    assert not re.search(r"@import|url\(|<link\b|fetch\(|XMLHttpRequest|@font-face", page, re.I)
    blob = re.search(r"<script type='application/json' id='report-data'>(.*?)</script>", page, re.S).group(1)
    data = json.loads(blob)
    pf = PlanFile.load(report.parent.parent / "plan.json")
    est = estimate(pf.model, pf.train, pf.cluster, pf.plan)
    chosen = data["timelines"][0]
    assert data["summary"]["bubble_fraction"] == est.bubble_fraction == chosen["bubble_fraction"]
    assert data["summary"]["step_time_s"] == est.step_time_s == chosen["step_time_s"]
    assert chosen["num_ranks"] == pf.plan.pp and chosen["events"]
    assert f"drawn: the first {chosen['drawn_micro_batches']} of {pf.plan.num_micro_batches}" in chosen["label"]
    assert [m["peak_bytes"] for m in data["memory"]] == est.peak_memory_bytes


def test_the_data_blob_cannot_close_its_script_element():
    text = data_blob({"plan": "</script><script>alert(1)</script>"})
    assert "</" not in text and json.loads(text)["plan"] == "</script><script>alert(1)</script>"
    with pytest.raises(ValueError):
        data_blob({"step_time_s": float("nan")})


def _passes_its_self_test(chromium: str, page: Path, profile: Path) -> str:
    """Loaded with #selftest: no error caught, no console error, every check of the page's own passed;
    returns the page's DOM as drawn."""
    done = SCREENSHOT["browse"](chromium, page, profile, "--enable-logging=stderr", "--v=0", "--dump-dom",
                                fragment="#selftest")
    assert done.returncode == 0, done.stderr[-2000:]
    status = _status(done.stdout)
    errors = re.search(r"<pre id=\"report-errors\">(.*?)</pre>", done.stdout, re.S).group(1)
    assert status == {"status": "ok", "errors": "0", "selftest": "passed"}, errors
    assert not re.search(r"CONSOLE.*(Uncaught|Error)", done.stderr), done.stderr[-2000:]
    return done.stdout


def test_in_chromium_the_page_renders_without_error_and_passes_its_self_test(report, chromium, tmp_path):
    _passes_its_self_test(chromium, report, tmp_path / "profile")
    shot = tmp_path / "report.png"
    SCREENSHOT["browse"](chromium, report, tmp_path / "profile", f"--screenshot={shot}", SCREENSHOT["WINDOW"])
    assert shot.exists() and shot.stat().st_size > 20_000   # a page, not a blank window


def test_sweep_report_draws_the_curve_of_its_rows(chromium, tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main(["sweep", "--model", "llama3-8b", "--seq-len", "4096", "--global-batch", "64", "--tokens", "1e11",
                 "--device", "H100", "--nodes", "1,2", "--deadline-days", "10", "--report", str(out), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {"index.html", "index.md", "scaling.png", "scaling.svg"} <= {p.name for p in out.iterdir()}
    blob = re.search(r"id='report-data'>(.*?)</script>", (out / "index.html").read_text(), re.S).group(1)
    assert json.loads(blob)["sweep"]["rows"] == rows
    assert "(scaling.png)" in (out / "index.md").read_text()
    dom = _passes_its_self_test(chromium, out / "index.html", tmp_path / "profile")
    points = re.findall(r"<circle [^>]*class=\"pt\"[^>]*>", dom)
    hollow = [c for c in points if 'fill="#fff"' in c]   # 8 GPUs take past the 10-day deadline
    assert len(hollow) == 1 and "past the 10-day deadline" in hollow[0] and "8 GPUs" in hollow[0]
