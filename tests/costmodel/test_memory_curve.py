"""The memory-bound curve: one point per size, the mix of its kernels, and version-1 profiles
(two points per size, the add's and the faster other kernel's) read as that mix."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from costmodel.cluster import PROFILE_FORMAT_VERSION, parse_profile
from costmodel.inputs import InputError
from runtime import profiler as prof

PROFILES = Path(__file__).resolve().parents[2] / "profiles"


def test_a_size_is_one_point_its_kernels_bytes_over_their_seconds(monkeypatch):
    seconds = iter([1.0, 2.0, 4.0])   # add, RMS norm, softmax
    monkeypatch.setattr(prof, "best_s", lambda fn, **kw: next(seconds))
    ((per_kernel, rate),) = prof.memory_points(1024, torch.device("cpu"))
    b = 1024 * 4
    assert per_kernel == pytest.approx(7 * b / 3)
    # bytes-weighted: the slow kernels weigh by their time, not one third each
    assert rate == pytest.approx(7 * b / 7.0)


def _with_memory_curve(version: int | None, points: str) -> str:
    text = (PROFILES / "A100-SXM4-80GB.toml").read_text()
    head = "" if version is None else f"format_version = {version}\n"
    return f"{head}{text}\n[measured]\nmemory_bound = {points}\n"


def test_a_version_1_curve_is_read_as_the_mix_it_measured():
    # 1024 elements: the other kernels at 8 B/elem, 4 GB/s; the add at 12 B/elem, 12 GB/s
    v1 = "[[8192.0, 4e9], [12288.0, 12e9], [32768.0, 8e9], [49152.0, 24e9]]"
    dev = parse_profile(_with_memory_curve(1, v1), Path("old.toml"))
    first_s = 2 * 8192 / 4e9 + 12288 / 12e9
    second_s = 2 * 32768 / 8e9 + 49152 / 24e9
    want = [28 * 1024 / 3, 28 * 1024 / first_s, 28 * 4096 / 3, 28 * 4096 / second_s]
    assert [v for point in dev.memory_curve for v in point] == pytest.approx(want)
    # a rate never between the kinds' points: the zigzag is gone
    assert [r for _, r in dev.memory_curve] == sorted(r for _, r in dev.memory_curve)
    # profiles measured before the format had a version (2026-11-22..24) are version 1
    unversioned = parse_profile(_with_memory_curve(None, v1), Path("older.toml"))
    assert unversioned.memory_curve == dev.memory_curve


def test_the_current_version_is_read_as_written():
    now = "[[9557.3, 5e9], [38229.3, 11e9]]"
    dev = parse_profile(_with_memory_curve(PROFILE_FORMAT_VERSION, now), Path("new.toml"))
    assert dev.memory_curve == ((9557.3, 5e9), (38229.3, 11e9))


@pytest.mark.parametrize("points", ["[[8192.0, 4e9], [20000.0, 12e9]]",   # not 8 and 12 bytes
                                    "[[8192.0, 4e9]]",                     # a size without its add
                                    "[[0.0, 4e9], [0.0, 12e9]]",           # sizes of nothing
                                    "[[8192.0, 0.0], [12288.0, 12e9]]"])   # a rate of nothing
def test_a_version_1_curve_of_another_shape_is_refused_by_name(points):
    with pytest.raises(InputError, match=r"odd\.toml.*memory_bound.*planner profile"):
        parse_profile(_with_memory_curve(1, points), Path("odd.toml"))
