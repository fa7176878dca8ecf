"""A plan priced with a measured profile stores the profile's fingerprint beside its path: a
profile measured again (`planner profile` replaces the cached one in place) or edited is said by
every command that reads the plan, which prices it with the profile as it is now."""
from __future__ import annotations

import json
import shutil

from costmodel.hardware.profile_io import profile_dir
from planner.cli import main


def test_a_changed_profile_is_said_by_the_commands_that_read_the_plan(tmp_path, capsys):
    mine = tmp_path / "mybox.toml"
    shutil.copy(profile_dir() / "A100-SXM4-80GB.toml", mine)
    plan = tmp_path / "plan.json"
    assert main(["predict", "--model", "llama3-8b", "--cluster", f"1x8x{mine}", "--recompute", "full", "--zero", "3",
                 "--out", str(plan), "--json"]) == 0
    cluster = json.loads(plan.read_text())["cluster"]
    assert cluster["device"] == str(mine) and len(cluster["device_sha256"]) == 64
    capsys.readouterr()
    assert main(["predict", "--plan", str(plan), "--json"]) == 0
    assert "has changed" not in capsys.readouterr().err
    mine.write_text(mine.read_text() + "# measured again\n")
    for argv in (["predict", "--plan", str(plan), "--json"], ["export", str(plan), "--to", "megatron"]):
        assert main(argv) == 0
        err = capsys.readouterr().err
        assert f"planner {argv[0]}: warning: the profile {mine} has changed since {plan} was made" in err, err
    # a shipped profile goes by its name, without a fingerprint
    shipped = tmp_path / "shipped.json"
    assert main(["predict", "--model", "llama3-8b", "--cluster", "1x8xA100", "--recompute", "full", "--zero", "3",
                 "--out", str(shipped), "--json"]) == 0
    assert "device_sha256" not in json.loads(shipped.read_text())["cluster"]
