"""The user documents: the page writers of scripts/results.py (scripts/results_pages.py) on a tiny
fake input (no check is run), and the README's shape (short, few dates, the two set-up commands CI and users rely on)."""
from __future__ import annotations

import re
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = runpy.run_path(str(ROOT / "scripts" / "results.py"))
META = {"cpu": "Fake CPU", "cores": 2, "python": "3.11", "torch": "2.13", "date": "2000-01-01 00:00 UTC",
        "load": 0.5}


def _accuracy() -> dict:
    row = {"id": "run_a", "source": "nvidia/megatron-lm", "framework": "megatron-core", "model": "gpt 1.7B, seq 4096",
           "gpus": 48, "device": "H100-SXM5-80GB", "metric": "iteration_time_s", "published": 0.45,
           "predicted": 0.44, "error_pct": -2.2, "fits": True, "filled": {"micro_batch": 4, "sp": False},
           "step_error_pct": -2.2, "left_out_pct": -3.0}
    oom = {**row, "id": "run|b", "metric": "status", "published": "OOM", "predicted": "OOM", "error_pct": None,
           "fits": False, "filled": {}, "step_error_pct": None, "left_out_pct": None}
    tokens = {**row, "id": "run_c", "source": "pytorch/torchtitan", "metric": "tokens_per_sec_per_gpu",
              "published": 3000.0, "predicted": 3100.0, "error_pct": 3.3, "step_error_pct": -3.2, "left_out_pct": 4.0}
    edge = {**tokens, "id": "run_d", "past_budget": True, "step_error_pct": -8.0, "left_out_pct": -9.0}
    return {"rows": [row, oom, tokens, edge], "num_sources": 2, "coverage": (2, 0, 2, "H100"),
            "summary": {"n": 2, "mape_pct": 2.75, "max_abs_error_pct": 3.3, "spearman": 1.0,
                        "num_status_rows": 1, "num_status_correct": 1},
            "left_out": {"n": 2, "mape_pct": 3.5, "max_abs_error_pct": 4.0}}


def test_validation_page_has_a_row_per_run_and_escapes_cells():
    text = RESULTS["validation_md"](_accuracy(), META)
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| id | source | model | GPUs | device | framework | published | predicted | error %")
    assert len(table) == 1 + len(_accuracy()["rows"])
    assert "| run_a | nvidia/megatron-lm | gpt 1.7B, seq 4096 | 48 | H100-SXM5-80GB | megatron-core | 0.450 s | " \
           "0.440 s | -2.2 | -3.0 | fits | micro_batch=4, sp=False |" in text
    assert "| +3.3 | -9.0 | past budget | micro_batch=4, sp=False |" in text
    assert "run\\|b" in text and "| OOM | OOM | - | - | does not fit | - |" in text
    assert "3,000 tok/s/GPU" in text and "Fake CPU, 2 cores" in text and "2000-01-01" in text


def test_results_page_keeps_unmeasured_optional_sections_and_replaces_the_rest():
    gpu = {"n": 2, "step_mape_pct": 10.0, "step_max_pct": 20.0, "memory_mape_pct": 1.0, "memory_max_pct": 2.0,
           "too_fast": 2}
    accuracy = RESULTS["wrap"]("accuracy", RESULTS["accuracy_section"](_accuracy(), {"H100": gpu, "H200": gpu},
                                                                         0.035, META))
    search = [{"model": "m", "cluster": "1x8xH100", "target_s": 1.0, "finished": True, "wall_s": 0.5,
               "command_s": 1.2, "num_candidates": 1234, "num_solved": 3, "optimal": True},
              {"model": "m", "cluster": "2x8xH100", "target_s": 1.0, "finished": False, "command_s": 9.0}]
    sim = {"case": "llama3-405b dp16 tp8 pp16x4v: 64 virtual stages", "stage costs": 1.0, "simulate (totals)": 17.0,
           "simulate (timeline)": 28.0, "whole estimate": 19.0}
    speed = RESULTS["wrap"]("speed", RESULTS["speed_section"](search, sim, META))
    loop = RESULTS["wrap"]("closed-loop", "## Closed loop\n\nkept 1.0 %")
    old = RESULTS["results_md"]({"accuracy": "stale", "speed": "stale", "closed-loop": loop}, META, "x")
    kept = RESULTS["kept_sections"](old)
    text = RESULTS["results_md"]({**kept, "accuracy": accuracy, "speed": speed}, META, "python3 scripts/results.py")
    assert "stale" not in text and "kept 1.0 %" in text
    assert "| one H200, stored runs priced by this code: step time | 2 | 10.0 | 20.0 |" in text
    assert "2 of the 2 H100 runs are predicted too fast. 2 of the 2 H200 runs" in text
    assert "Not measured yet: `python3 scripts/results.py --with-plan-quality`" in text
    assert "| 1x8xH100 | 1.0 | 0.50 | 1.20 | 1,234 | 3 | True |" in text and "did not finish" in text
    assert "| simulate (totals) | 17.0 |" in text
    assert "the leave-one-source-out MAPE measured here is 3.5 % (the same)" in text
    assert "(2 timed rows, 0 of them on 256 or more GPUs and 2 on H100-class devices" in text
    assert "| nvidia/megatron-lm | 1 | 2.2 / -2.2 | 3.0 / -3.0 |" in text
    assert "1 run fits the device but not the budget the search plans with" in text
    assert "step time MAPE 8.0 %, mean -8.0 % (- predicted too fast), against 4.5 % over every run" in text
    assert RESULTS["kept_sections"](text).keys() == {"accuracy", "speed", "closed-loop"}   # not the placeholder


def test_the_accuracy_section_splits_families_per_micro_batch_and_per_step():
    split = {"label": "mlperf 96x12288 H100 | tp4", "micro_batches": (8, 128), "per_micro_batch_s": 0.0844,
             "per_micro_batch_error_pct": 3.6, "per_step_s": 0.285, "per_step_error_s": -0.09}
    text = RESULTS["accuracy_section"]({**_accuracy(), "splits": [split]}, {}, 0.035, META)
    assert "the 1 families of rows that differ only in their micro-batch count m" in text
    assert "| mlperf 96x12288 H100 \\| tp4 | 8, 128 | 0.0844 | +3.6 | 0.285 | -0.090 |" in text
    assert "Per micro-batch and per step" not in RESULTS["accuracy_section"](_accuracy(), {}, 0.035, META)


def test_the_accuracy_section_shows_the_runs_at_scale_predicted_by_the_smaller_ones():
    scaled = {"n": 66, "mape_pct": 4.31, "max_abs_error_pct": 13.1, "mean_error_pct": -0.84, "min_gpus": 1024,
              "in_sample": {"n": 66, "mape_pct": 4.08, "max_abs_error_pct": 12.9, "mean_error_pct": -0.5}}
    text = RESULTS["accuracy_section"]({**_accuracy(), "scale_out": scaled}, {}, 0.035, META)
    assert ("| published runs on 1,024 or more GPUs, predicted by a fit on the runs below alone (step time; "
            "mean -0.8 %, + too slow; the same runs in sample: 4.1 / 12.9 %) | 66 | 4.3 | 13.1 | |") in text
    assert "1,024 or more" not in RESULTS["accuracy_section"](_accuracy(), {}, 0.035, META)


def test_the_accuracy_section_shows_the_runs_priced_as_an_unknown_framework_s():
    unknown = {"n": 232, "refused": 36, "mape_pct": 23.4, "max_abs_error_pct": 200.4,
               "mean_error_by_framework_pct": {"megatron-core": 35.2, "torchtitan": -4.7}}
    text = RESULTS["accuracy_section"]({**_accuracy(), "unknown_framework": unknown}, {}, 0.035, META)
    assert "does not know" in text and "| 232 | 23.4 | 200.4 |" in text and "megatron-core +35.2 %" in text
    assert "does not know" not in RESULTS["accuracy_section"](_accuracy(), {}, 0.035, META)


def test_the_claims_section_lists_the_rows_the_search_claims_most_over():
    claims = RESULTS["parse_claims"](
        "tt_405b                     54,527      100,474 +84.3%  +84.3%     3   True  dp128 tp4+sp pp1 z3\n"
        "                             fixed {}: fastest dp128 tp4+sp pp1 z3, 20.87 s against 40.96 s measured "
        "(+96.2%); MFU 0.600 / HFU 0.798 against the measured run's MFU 0.306 / HFU 0.407\n"
        "mpt_30b                      skipped: composer-fsdp has no export target\n"
        "megatron_177B              994,292    1,013,214  +1.9%   +0.8%     4   True  dp72 tp8+sp pp4x8v z1\n"
        "                             fixed {}: fastest dp48 tp4+sp pp6x8v cp2 z1, 4.66 s against 5.26 s measured "
        "(+12.9%); MFU 0.494 / HFU 0.494 against the measured run's MFU 0.437 / HFU 0.437\n"
        "\nthe search claims more than 15% over the measured run: 1 rows\n"
        "  tt_405b (+96%: dp128 tp4+sp pp1 z3 against dp8 tp8+sp pp8 z3)\ncommand: python ...\n")
    assert claims["skipped"] == 1 and [r["claim_pct"] for r in claims["rows"]] == [96.2, 12.9]
    text = RESULTS["claims_section"](claims, META)
    assert "Rows searched 2 (skipped, a framework with no export target: 1)" in text
    assert "measured: median +54.6 %; more than 15 % faster: 1 rows." in text
    assert "| tt_405b | +96% | `dp128 tp4+sp pp1 z3` | `dp8 tp8+sp pp8 z3` |" in text


def test_benchmark_output_parsers_read_the_printed_lines():
    quality = RESULTS["parse_plan_quality"](
        "id  published tok/s ...\n"
        "megatron_h100_1.7B                     9,999*       10,500   +5.0%   +4.0%     1   True  dp48 tp1 pp1 z1\n"
        "mlperf31_gpt3_h100_eosdfw_4096     1,848,660†   1,521,603  -17.7%  -17.7%     1   True  dp128 tp4+sp pp8\n"
        "megatron_h100_177B                   745,685            -  search found nothing\n"
        "\nfastest plan predicted slower than the published one: 0 rows of those our runtime runs and fits (* : ...)\n")
    assert quality["worse"] == 0 and quality["rows"][0]["published_fits"] is False
    assert quality["rows"][0]["published_runs"] and not quality["rows"][1]["published_runs"]
    assert quality["rows"][1]["published_fits"] and quality["rows"][1]["gain_pct"] == -17.7
    assert len(quality["rows"]) == 2 and quality["nothing"] == ["megatron_h100_177B"]
    section = RESULTS["plan_quality_section"](quality, META)
    assert "no plan found within the 10 s limit 1 rows (megatron_h100_177B)." in section
    assert "not run by our runtime as published 1;" in section and "| 1,848,660† |" in section
    assert quality["rows"][0]["plan"] == "dp48 tp1 pp1 z1" and quality["rows"][0]["gain_pct"] == 5.0
    loop = RESULTS["parse_closed_loop"](
        "\nfresh profile out/p.toml, no calibration\nplan   predicted ms   measured ms   error %\n"
        "single_fp32  10.0  11.0  -9.1\nMAPE 9.1%   max |error| 9.1%   Spearman nan   (1 plans)\n"
        "\nthe passes of a plan lie 2.5 % apart (median; single_fp32 2.5 % at most): noise\n\n300 s; command: x\n")
    assert loop["tables"] == [{"label": "fresh profile out/p.toml, no calibration", "mape_pct": 9.1, "max_pct": 9.1,
                               "spearman": "nan", "plans": 1}]
    assert loop["pass_spread_pct"] == 2.5 and loop["wall_s"] == 300


def test_readme_is_short_has_few_dates_and_the_two_set_up_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    assert len(re.findall(r"\b20\d\d-\d\d-\d\d\b", text)) <= 5
    assert "bash scripts/setup.sh && planner search --model llama-70b --cluster 8x8xA100" in text
    assert "bash scripts/setup.sh && python3 -m pytest -q" in text
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("bash scripts/setup.sh && python3 -m pytest -q")


def test_every_framework_trait_is_documented_once():
    """docs/frameworks.md is the reference of FrameworkTraits: one entry per field, none for a
    field that is gone."""
    import dataclasses

    from costmodel.frameworks import FrameworkTraits

    text = (ROOT / "docs" / "frameworks.md").read_text()
    entries = re.findall(r"^- `(\w+)`:", text, re.M)
    fields = [f.name for f in dataclasses.fields(FrameworkTraits)]
    assert sorted(entries) == sorted(fields)
