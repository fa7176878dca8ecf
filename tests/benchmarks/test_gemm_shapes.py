"""benchmarks/gemm_shapes.py: a linear's three GEMMs measured in their shapes (on this CPU, its
small grid), and the stored H200 files replayed: the GEMM sweep against the H200 profile's shape
model, which explains its fall with K (the medians over K within a few percent) and whose fit
gives the profiles' gemm_tile_setup_k; float8 against bf16; the loss against cross_entropy_s."""
from __future__ import annotations

import json

from benchmark_loader import BENCHMARKS, load_benchmark

RESULTS = BENCHMARKS / "results" / "gemm-shapes-h200-2026-12-04"
STORED = RESULTS / "gemm_shapes.json"


def test_each_shape_is_timed_in_its_three_layouts():
    mod = load_benchmark("gemm_shapes")
    results = mod.measure(budget_s=60.0, repeat=1)
    grid = mod.CPU_GRID
    assert len(results["points"]) == 3 * len(grid["m"]) * len(grid["k"]) * len(grid["n"])
    forward, input_grad, weight_grad = results["points"][:3]
    assert (forward["layout"], input_grad["layout"], weight_grad["layout"]) == ("forward", "input_grad", "weight_grad")
    m, k, n = forward["m"], forward["k"], forward["n"]
    assert (input_grad["m"], input_grad["k"], input_grad["n"]) == (m, n, k)
    assert (weight_grad["m"], weight_grad["k"], weight_grad["n"]) == (n, m, k)
    assert all(p["seconds"] > 0 and p["flop_per_s"] > 0 for p in results["points"])


def test_the_h200_sweep_is_flat_against_the_shape_model(capsys):
    mod = load_benchmark("gemm_shapes")
    mod.replay(json.loads(STORED.read_text()), "H200")
    out = capsys.readouterr().out
    spread = float(out.split("spread of the medians over k: ")[1].split("%")[0])
    assert abs(spread) < 5.0, out   # 14.9 % with gemm_tile_setup_k = 0
    assert "fit over the 273 GEMMs with two or more waves: peak x 0.709 x waves x K / (K + 153)" in out


def test_the_float8_and_loss_files_replay_against_what_the_profile_assumes(capsys):
    mod = load_benchmark("gemm_shapes")
    mod.replay(json.loads((RESULTS / "fp8_sweep.json").read_text()), "H200")
    assert "float8 1.76x bf16 (median of 25" in capsys.readouterr().out
    mod.replay(json.loads((RESULTS / "cross_entropy.json").read_text()), "H200")
    priced = [line for line in capsys.readouterr().out.splitlines() if "; priced" in line]
    assert len(priced) == 3 and all(abs(int(line.split("(")[-1].split(" %")[0])) <= 15 for line in priced)
