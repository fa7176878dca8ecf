"""The tree stays clean by itself: ruff (configured in pyproject.toml: unused imports and names,
undefined names, import order) finds nothing."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    if shutil.which("ruff") is None and subprocess.run([sys.executable, "-m", "ruff", "--version"],
                                                        capture_output=True).returncode != 0:
        pytest.fail("ruff is not installed: bash scripts/setup.sh installs the test extra, which has it")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
