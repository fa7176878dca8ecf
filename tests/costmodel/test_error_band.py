"""The error a search and a prediction quote: the published runs' leave-one-source-out MAPE,
or, on a profile fitted to its own probe steps, their error after the fit where it is larger
(costmodel.fidelity.error_band): a machine the published runs never measured is not bounded by
them."""
from pathlib import Path

import pytest

from costmodel.fidelity import BORROWED_ERROR_BANDS, MODEL_ERROR_BAND, PUBLISHED, error_band
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


def test_a_device_priced_with_borrowed_values_quotes_its_own_runs_error(capsys):
    """The GB200 is priced with the H100 chip's fitted values; its published runs, which no fit
    reads, set the error a search on it quotes (and a mixed cluster with it)."""
    band, source = error_band(parse_cluster("4x64xGB200"))
    assert (band, source) == BORROWED_ERROR_BANDS["GB200"] and band > MODEL_ERROR_BAND
    assert "gb200_runs.csv" in source
    assert error_band(parse_cluster("4x64xGB200+4x64xH100"))[0] == band
    assert main(["predict", "--model", "llama3-8b", "--cluster", "1x8xGB200", "--tp", "1", "--mbs", "1",
                 "--json"]) == 0
    assert f'"error_band": {band}' in capsys.readouterr().out


@pytest.mark.parametrize("device", sorted(BORROWED_ERROR_BANDS))
def test_the_borrowed_band_is_the_step_time_error_of_the_device_s_runs(device):
    """BORROWED_ERROR_BANDS quotes what `planner validate` gives on the device's runs table, the one
    its source names, every row of it on that device."""
    import re

    from planner.measure.runs_table import read_runs
    from planner.measure.validate import step_time_error_pct, validate_row
    band, source = BORROWED_ERROR_BANDS[device]
    table = re.search(r"profiles/runs/\S+\.csv", source)[0]
    rows = read_runs(Path(__file__).resolve().parents[2] / table)
    errors = [abs(step_time_error_pct(row, validate_row(row).error_pct)) for row in rows]
    assert {row["gpu"] for row in rows} == {device}
    assert f"its {len(rows)} published runs" in source
    assert sum(errors) / len(errors) / 100 == pytest.approx(band, abs=0.0015)


def test_a_prediction_past_the_calibrated_sequence_lengths_says_so(capsys):
    """The quoted band comes from the published runs, the longest 32k tokens; a prediction at a
    longer sequence says the band does not cover it (long-context runs kept apart ran slower than
    priced), and one within it says nothing more."""
    from costmodel.fidelity import LONGEST_CALIBRATED_SEQ
    from planner.measure.runs_table import read_runs
    runs = Path(__file__).resolve().parents[2] / "profiles" / "runs"
    assert LONGEST_CALIBRATED_SEQ == max(int(r["seq_len"]) for r in read_runs(runs / "published_runs.csv"))
    assert min(int(r["seq_len"]) for r in read_runs(runs / "unmodelled_runs.csv")
               if r["id"].startswith(("nemo2403_longseq", "tt25a_l31_405b_512_4d_cp"))) <= 2 * LONGEST_CALIBRATED_SEQ
    flags = ["predict", "--model", "llama3-8b", "--cluster", "1x8xH100", "--tp", "2", "--cp", "4", "--mbs", "1",
             "--global-batch", "8", "--recompute", "full"]
    assert main([*flags, "--seq-len", "65536"]) == 0
    assert "65,536 tokens is past the 32,768 of the runs it comes from" in capsys.readouterr().out
    assert main([*flags, "--seq-len", "8192"]) == 0
    assert "past the" not in capsys.readouterr().out
    # the JSON says it as error_band_note (null within the calibrated lengths)
    import json
    assert main([*flags, "--seq-len", "65536", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["error_band_note"].startswith("65,536 tokens is past the 32,768")
    assert main([*flags, "--seq-len", "8192", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["error_band_note"] is None


def test_vendor_attention_is_calibrated_to_its_own_longest_runs(capsys):
    """Transformer Engine's cuDNN attention (Megatron-Core on Hopper and Blackwell) is priced at the
    vendor's rate, which the published runs bound only as far as the longest run that used it: a
    prediction under it past that length says so; FlashAttention's (our runtime's) does not yet."""
    from costmodel.fidelity import LONGEST_CALIBRATED_VENDOR_SEQ, runs_vendor_attention
    from planner.measure.runs_table import read_runs, row_specs
    runs = Path(__file__).resolve().parents[2] / "profiles" / "runs" / "published_runs.csv"
    vendor = [int(row["seq_len"]) for row in read_runs(runs) if runs_vendor_attention(row_specs(row)[2])]
    assert vendor and LONGEST_CALIBRATED_VENDOR_SEQ == max(vendor)
    flags = ["predict", "--model", "llama3-8b", "--cluster", "1x8xH100", "--tp", "2", "--cp", "2", "--mbs", "1",
             "--global-batch", "8", "--seq-len", "16384", "--recompute", "full"]
    assert main([*flags, "--framework", "megatron"]) == 0
    assert "16,384 tokens is past the 8,192 of the runs with the vendor's fused attention" in capsys.readouterr().out
    assert main(flags) == 0
    assert "past the" not in capsys.readouterr().out
