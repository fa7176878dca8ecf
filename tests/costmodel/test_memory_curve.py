"""The memory-bound curve: one point per size, the mix of its kernels, read as written; a
profile of another format version is refused."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from costmodel.hardware import PROFILE_FORMAT_VERSION, parse_profile
from costmodel.inputs import UserError
from runtime import profiler as prof
from runtime.profiler import curves

PROFILES = Path(__file__).resolve().parents[2] / "profiles"


def test_a_size_is_one_point_its_kernels_bytes_over_their_seconds(monkeypatch):
    seconds = iter([1.0, 2.0, 4.0])   # add, RMS norm, softmax
    monkeypatch.setattr(curves, "best_s", lambda fn, **kw: next(seconds))
    ((per_kernel, rate),) = prof.memory_points(1024, torch.device("cpu"))
    b = 1024 * 4
    assert per_kernel == pytest.approx(7 * b / 3)
    # bytes-weighted: the slow kernels weigh by their time, not one third each
    assert rate == pytest.approx(7 * b / 7.0)


def _with_memory_curve(version: int | None, points: str) -> str:
    text = (PROFILES / "A100-SXM4-80GB.toml").read_text()
    head = "" if version is None else f"format_version = {version}\n"
    return f"{head}{text}\n[measured]\nmemory_bound = {points}\n"


def test_the_current_version_is_read_as_written():
    now = "[[9557.3, 5e9], [38229.3, 11e9]]"
    dev = parse_profile(_with_memory_curve(PROFILE_FORMAT_VERSION, now), Path("new.toml"))
    assert dev.memory_curve == ((9557.3, 5e9), (38229.3, 11e9))


def test_another_format_version_is_refused_by_name():
    with pytest.raises(UserError, match=r"old\.toml: profile format version 1; this planner reads version 3"):
        parse_profile(_with_memory_curve(1, "[[9557.3, 5e9]]"), Path("old.toml"))
