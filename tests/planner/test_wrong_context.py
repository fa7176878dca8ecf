"""Input a command cannot honestly use is refused in one line (exit 2), before anything is
written: failure-rate and storage figures whose arithmetic leaves the floats, a plan file for a
plan that does not fit, CPU runs offered to calibrate a GPU profile."""
from __future__ import annotations

import pytest

from planner.cli import main
from tests.planner.test_profile_calibrate import _fake_runs

PREDICT = ["predict", "--model", "llama3-8b", "--cluster", "1x8xH100", "--zero", "3", "--recompute", "full"]


@pytest.mark.parametrize("flags,message", [
    (["--storage-mb-s-per-device", "1e-300"], "--storage-mb-s-per-device 1e-300: give 0.001 to 1e+09 MB/s"),
    (["--device-mtbf-hours", "1e308"], "--device-mtbf-hours 1e+308: give 0.001 to 1e+12 hours"),
])
def test_failure_figures_beyond_the_arithmetic_are_one_line(flags, message, capsys):
    assert main([*PREDICT, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err


def test_the_edges_of_the_failure_figures_still_price(capsys):
    assert main([*PREDICT, "--device-mtbf-hours", "1e12", "--storage-mb-s-per-device", "1e-3", "--json"]) == 0
    assert main([*PREDICT, "--device-mtbf-hours", "1e-3", "--storage-mb-s-per-device", "1e9", "--json"]) == 0


def test_a_plan_that_does_not_fit_writes_no_plan_file(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["predict", "--model", "llama-70b", "--cluster", "1x8xA100", "--out", str(out)]) == 2
    assert not out.exists() and f"({out} not written)" in capsys.readouterr().err


def test_cpu_runs_cannot_calibrate_a_gpu_profile(tmp_path, capsys):
    from costmodel.hardware import parse_cluster
    runs = _fake_runs(tmp_path, parse_cluster("1x2xxeon-amx").device)
    out = tmp_path / "h100-calibrated.toml"
    assert main(["calibrate", *map(str, runs[:2]), "--profile", "H100", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "ran on 1x2xxeon-amx (a cpu); it cannot calibrate" in err \
        and "H100-SXM5-80GB.toml (a gpu)" in err
    assert not out.exists()


def test_one_run_directory_given_twice_is_not_two_repeats(tmp_path, capsys):
    """calibrate averages a plan's repeated runs: the same directory twice (run/ and run) was
    counted as two runs of its plan."""
    from costmodel.hardware import parse_cluster
    runs = _fake_runs(tmp_path, parse_cluster("1x2xxeon-amx").device)
    out = tmp_path / "calibrated.toml"
    assert main(["calibrate", str(runs[0]), f"{runs[0]}/", "--profile", "xeon-amx", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is given twice" in err and not out.exists(), err
