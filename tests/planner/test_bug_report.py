"""A bug is shown as a bug, never as a user's mistake: one line naming it, where it was raised and
the file holding its traceback, exit 1; a user's mistake stays one line and exit 2."""
from __future__ import annotations

import re
from pathlib import Path

import planner.cli as cli
from planner.cli import main


def test_an_injected_bug_is_one_line_naming_it_and_its_traceback_file(monkeypatch, capsys, tmp_path):
    def broken(args):
        return {}["no such key"]   # a KeyError inside a command: ours, not the user's
    monkeypatch.setattr(cli, "cmd_models", broken)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(cli.tempfile, "tempdir", None)   # tempfile caches the directory it picked
    assert main(["models"]) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert "internal error, a bug in the planner (not in your input): KeyError" in err
    assert "test_bug_report.py:" in err   # where it was raised
    path = Path(re.search(r"traceback in (\S+);", err)[1])
    assert path.parent == tmp_path and "Traceback (most recent call last)" in path.read_text()


def test_a_value_error_inside_the_code_is_a_bug_not_a_usage_error(monkeypatch, capsys, tmp_path):
    def broken(args):
        raise ValueError("an internal invariant broke")
    monkeypatch.setattr(cli, "cmd_devices", broken)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(cli.tempfile, "tempdir", None)
    assert main(["devices"]) == 1
    assert "a bug in the planner" in capsys.readouterr().err


def test_a_user_mistake_stays_one_line_and_exit_2(capsys):
    assert main(["search", "--model", "no-such-model", "--cluster", "8x8xA100"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "unknown model 'no-such-model'" in err and "a bug in the planner" not in err
