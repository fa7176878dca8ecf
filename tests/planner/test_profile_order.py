"""`planner profile` on a CPU: the microbenchmarks, the probes, then the curves' second pass, and
the probes' fit on the curves the second pass left (planner.commands.profile.profile_machine).
The microbenchmarks run for real under a small budget; the probes and the second pass are faked,
so what is checked is the order and what each step hands the next."""
from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from costmodel.hardware import load_profile
from planner.commands import profile as cmd
from planner.measure import probes
from runtime import fork
from runtime import profiler as prof


def test_the_second_pass_comes_after_the_probes_and_the_fit_reads_its_curves(tmp_path, monkeypatch):
    real_run_forked, calls, fitted_on = fork.run_forked, [], []
    faster: dict = {}

    def run_forked(world, fn, *args, device_type="cpu"):
        calls.append(fn.__name__)
        if fn is prof.probe_rank:
            return [[{"step_times_s": [0.05] * 5} for _ in args[0]]] + [None] * (world - 1)
        if fn is prof.second_pass_rank:
            micro = args[0]
            assert "second_pass_limit_s" not in micro and args[3] > 0   # popped, handed as the limit
            # a quarter faster: told apart from the first pass (the real probe layer's timing is
            # priced at these curves; its bounds are lifted below)
            faster.update(micro, gemm={k: replace(c, points=tuple(sorted((x, 1.25 * r) for x, r in c.points)))
                                       for k, c in micro["gemm"].items()})
            return [faster] + [None] * (world - 1)
        out = real_run_forked(world, fn, *args, device_type=device_type)
        # a first pass slowed by tests beside it can use all of the curves' share and leave the
        # second none (measure_rank then hands no limit): the order is what this test is about
        out[0].setdefault("second_pass_limit_s", 5.0)
        return out

    def fit_probes(measured, base, layer_ops=None):
        fitted_on.append(base)
        return real_fit(measured, base, layer_ops)

    real_fit = probes.fit_probes
    monkeypatch.setattr(fork, "run_forked", run_forked)
    # the order is what this test checks, not the refusal of a broken layer timing: the tests
    # beside it can slow the real probe layer until it reads far below the faked curves, refused
    monkeypatch.setattr(probes, "LAYER_FACTOR_BOUNDS", (0.0, float("inf")))
    # a loaded machine's microbenchmarks can run past the shortest budget and leave the second
    # pass no time (it is then skipped, as it should be): here its order is what is checked, so
    # the clock always shows the fit's reserve and a few seconds more (probes and second pass faked)
    real_left_s = cmd._left_s
    monkeypatch.setattr(cmd, "_left_s", lambda end_s: max(real_left_s(end_s), cmd.FIT_RESERVE_S + 5.0))
    monkeypatch.setattr(probes, "fit_probes", fit_probes)
    # the order is checked, not the curves' quality: half the command's least budget for them
    monkeypatch.setattr(cmd, "MIN_BUDGET_S", cmd.MIN_BUDGET_S / 2)
    args = argparse.Namespace(out=tmp_path / "box.toml", nproc=2, name=None, quick=False, thorough=False,
                              overwrite=False, budget_s=cmd.MIN_BUDGET_S)
    cmd.profile_machine(cmd._setup(args))

    assert calls == ["measure_rank", "probe_rank", "probe_rank", "second_pass_rank"]
    quicker = dict(faster["gemm"])["fp32"].points
    # the fit's base and the written profile (six digits) both carry the second pass's curves
    for dev in (fitted_on[0], load_profile(tmp_path / "box.toml")):
        assert [r for _, r in dev.gemm_curve("fp32")] == pytest.approx([r for _, r in _medians(quicker)], rel=1e-5)


def _medians(points):
    """As the loader reads a curve: one rate per FLOP count (costmodel.hardware.profile_io._curve)."""
    from costmodel.hardware.profile_io import _curve
    return _curve(Path("test"), "gemm_fp32", [list(p) for p in points])
