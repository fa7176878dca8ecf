"""A user's `pip install .` (not editable) gives a working planner: package data (the device
profiles, the published runs) travels with it, `python -m planner` and `--version` work."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _not_sources(folder: str, names: list[str]) -> set[str]:
    """Build outputs anywhere; the checkout's own run and output folders at its top only
    (profiles/runs is package data)."""
    skip = {n for n in names if n in ("__pycache__", ".pytest_cache") or n.endswith(".egg-info")}
    if Path(folder) == ROOT:
        skip |= {n for n in names if n in (".git", "build", "runs", "out")}
    return skip


def test_a_plain_install_plans_from_anywhere(tmp_path):
    source = tmp_path / "src"   # a copy: building writes build/ and egg-info beside the sources
    shutil.copytree(ROOT, source, ignore=_not_sources)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(source)], check=True, capture_output=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target)}

    def planner(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "planner", *args], capture_output=True, text=True,
                              env=env, cwd=tmp_path, timeout=120)
    where = subprocess.run([sys.executable, "-c", "import planner, profiles; print(planner.__file__, profiles.__file__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, check=True).stdout
    assert where.count(str(target)) == 2   # the installed copy, not this source tree
    version = planner("--version")
    assert version.returncode == 0 and version.stdout.startswith("planner 0.")
    predicted = planner("predict", "--model", "llama-70b", "--cluster", "8x8xA100", "--tp", "8", "--pp", "4",
                        "--recompute", "full")
    assert predicted.returncode == 0, predicted.stderr
    assert "A100-SXM4-80GB" in predicted.stdout
    # the published runs travel as package data: a few of the installed table's rows validate
    table = target / "profiles" / "runs" / "published_runs.csv"
    some = tmp_path / "some_runs.csv"
    some.write_text("".join(table.read_text().splitlines(keepends=True)[:4]))
    validated = planner("validate", "--json", str(some))
    assert validated.returncode == 0, validated.stderr
