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


def test_fix_takes_the_cli_s_names_and_refuses_others():
    import pytest

    from costmodel.inputs import UserError
    from planner import api
    by_cli = api.search("llama3-8b", "1x8xH100", fix={"zero": 0, "mbs": 4}, seq_len=4096, global_batch=64)
    by_field = api.search("llama3-8b", "1x8xH100", fix={"zero_stage": 0, "micro_batch_size": 4}, seq_len=4096,
                          global_batch=64)
    assert by_cli.best.plan == by_field.best.plan and by_cli.best.plan.zero_stage == 0
    assert by_cli.best.plan.micro_batch_size == 4
    for fix, message in (({"bogus": 2}, "fix: unknown key 'bogus'"), ({"mbs": 0}, "fix: mbs=0: 0 is not a positive")):
        with pytest.raises(UserError, match=message):
            api.search("llama3-8b", "1x8xH100", fix=fix)
    with pytest.raises(UserError, match="top 0: give 1 to"):
        api.search("llama3-8b", "1x8xH100", top=0)


def test_predict_takes_the_cli_s_defaults_and_says_a_bad_name():
    import pytest

    from costmodel.inputs import UserError
    from planner import api
    assert api.predict("llama3-8b", "1x8xH100", framework="torchtitan", tp=2).plan.zero_stage == 3
    assert api.predict("llama3-8b", "1x8xH100", pp=2, schedule="zbv").plan.vpp == 2
    for kw, message in (({"dtype": "bf17"}, "dtype 'bf17' is not one of fp32, bf16, fp16, fp8"),
                        ({"attention": "fast"}, "attention 'fast' is not one of flash, eager"),
                        ({"recompute": "some"}, "recompute 'some' is not one of none, selective, full")):
        with pytest.raises(UserError, match=message):
            api.predict("llama3-8b", "1x8xH100", **kw)
