"""docs/cli.md is the parsers' own help, so it cannot drift from `planner <cmd> --help`."""
from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cli_md_is_every_subcommand_s_help(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    render = runpy.run_path(str(ROOT / "scripts" / "cli_docs.py"))["render"]
    text = render()
    assert (ROOT / "docs" / "cli.md").read_text() == text, "docs/cli.md is stale: run python3 scripts/cli_docs.py"
    for name in ("search", "predict", "validate", "report", "run", "profile", "calibrate", "export", "models",
                 "devices"):
        assert f"## planner {name}\n" in text


def test_the_page_matches_what_a_user_sees_from_help():
    env = {"COLUMNS": "100", "PATH": "/usr/bin:/bin"}
    shown = subprocess.run([sys.executable, "-m", "planner", "search", "--help"], capture_output=True, text=True,
                           cwd=ROOT, env=env, check=True).stdout
    assert f"```text\n{shown}```" in (ROOT / "docs" / "cli.md").read_text()
