"""docs/api.md's examples run as written (in one namespace, in order, from the repository root)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_examples_run(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), flags=re.S)
    assert len(blocks) >= 6
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/api.md", "exec"), namespace)
    printed = capsys.readouterr().out
    assert "days" in printed and "fits" in printed


def test_results_are_json_serialisable():
    import json

    from planner import api
    answer = api.search("llama3-8b", "1x8xH100", seq_len=2048, global_batch=32, top=3)
    json.dumps(answer.to_dict())
    json.dumps(api.predict("llama3-8b", "1x8xH100", plan=answer.best.plan.to_dict(), seq_len=2048,
                           global_batch=32).to_dict())


def test_a_pin_no_plan_takes_is_named_as_the_cli_names_it():
    import pytest

    from costmodel.inputs import UserError
    from planner import api
    with pytest.raises(UserError, match="contradictory constraints: fp8_linears=True is not possible"):
        api.search("llama3-8b", "1x8xH100", fix={"fp8_linears": True})
