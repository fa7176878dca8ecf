"""The error a search and a prediction quote: the published runs' leave-one-source-out MAPE,
or, on a profile fitted to its own probe steps, their error after the fit where it is larger
(costmodel.fidelity.error_band): a machine the published runs never measured is not bounded by
them."""
from pathlib import Path

import pytest

from costmodel.fidelity import MODEL_ERROR_BAND, PUBLISHED, error_band
from costmodel.hardware import parse_cluster
from costmodel.inputs import UserError
from planner.cli import main

PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "xeon-amx.toml"


def _with_probes(tmp_path: Path, steps: str) -> Path:
    path = tmp_path / "box.toml"
    path.write_text(PROFILE.read_text() + f"\n[probes]\nfit_version = 1\nsteps = [{steps}]\n")
    return path


def test_a_profile_s_probe_error_widens_the_band_it_quotes(tmp_path, capsys):
    box = _with_probes(tmp_path, '{plan = "a", measured_s = 1.0, predicted_s = 1.3}, '
                                 '{plan = "b", measured_s = 2.0, predicted_s = 1.8}')
    cluster = parse_cluster(f"1x2x{box}")
    assert cluster.device.probe_error == pytest.approx(0.2)   # (30 % + 10 %) / 2
    band, source = error_band(cluster)
    assert band == pytest.approx(0.2) and "probe steps" in source
    assert error_band(parse_cluster("8x8xH100")) == (MODEL_ERROR_BAND, PUBLISHED)
    assert main(["search", "--model", "debug-tiny", "--cluster", f"1x2x{box}", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "expected error +-20.0% (this machine's profile: its probe steps after the fit)" in out
    assert "within the model's measured error of +-20.0%" in out


def test_a_probe_step_without_its_times_is_named(tmp_path):
    box = _with_probes(tmp_path, '{plan = "a", measured_s = 1.0}')
    with pytest.raises(UserError, match="probes.steps: each needs predicted_s and measured_s"):
        parse_cluster(f"1x2x{box}")
