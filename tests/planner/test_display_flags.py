"""The answer never depends on a display flag: --top 1, 3 and 10 and --json give the same first
plan (planner.ranking.DECISION_K: the first is chosen among plans every search finds)."""
from __future__ import annotations

import json

from planner.cli import main


def test_the_first_plan_is_the_same_for_every_top_and_for_json(capsys):
    args = ["search", "--model", "llama3-8b", "--cluster", "2x8xH100"]
    firsts = []
    for top in ("1", "3", "10"):
        assert main([*args, "--top", top, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert len(doc["plans"]) <= int(top)
        firsts.append(doc["plans"][0]["plan"])
    assert firsts[0] == firsts[1] == firsts[2]
    assert main([*args, "--top", "1"]) == 0
    table = capsys.readouterr().out
    short = next(line for line in table.splitlines() if line.startswith("plan "))
    assert f"dp{firsts[0]['dp']}" in short and f"z{firsts[0]['zero_stage']}" in short
