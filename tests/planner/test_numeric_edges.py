"""Numbers at their edges: every numeric flag of search, predict, sweep and run, collected from
the parsers (so a new flag is covered), given 0, a tiny, a huge, an infinite and a NaN value:
one line and exit 2, or exit 0 with finite numbers; never a traceback, a bug or an inf printed.
Every integer flag (profile's too) given 0, -1 and 10**30: refused by its parser, naming its range."""
from __future__ import annotations

import argparse
import json
import re

import pytest

from costmodel.hardware import profile_dir
from planner.cli import build_parser, main

CPU = "1x2xxeon-amx"
VALUES = ("0", "1e-300", "1e308", "inf", "-inf", "nan", "1" + "0" * 40)
# flags that take effect only beside others: given those, so that the value itself is used
NEEDS = {"--gpu-hour-usd": ["--tokens", "1e12"], "--deadline-days": ["--tokens", "1e12"],
         "--budget-usd": ["--tokens", "1e12", "--gpu-hour-usd", "2"], "--tokens": ["--gpu-hour-usd", "1e6"],
         "--group-link": ["--cluster", f"{CPU}+{CPU}"], "--recompute-layers": ["--recompute", "full"]}
RUN_NEEDS = ("--max-restarts", "--device-mtbf-hours", "--storage-mb-s-per-device", "--keep", "--checkpoint-every")


def numeric_flags(command: str) -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))   # noqa: SLF001
    return [a.option_strings[0] for a in sub.choices[command]._actions   # noqa: SLF001
            if a.option_strings and a.type is not None and a.type is not str]


def _without(argv: list[str], flag: str) -> list[str]:
    if flag not in argv:
        return argv
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, list[str]]:
    tmp = tmp_path_factory.mktemp("edges")
    plan = tmp / "plan.json"
    assert main(["predict", "--model", "debug-tiny", "--cluster", CPU, "--pp", "2", "--out", str(plan)]) == 0
    return {"search": ["search", "--json", "--model", "debug-tiny", "--cluster", CPU, "--time-limit", "20"],
            "predict": ["predict", "--json", "--model", "debug-tiny", "--cluster", CPU],
            "sweep": ["sweep", "--json", "--model", "debug-tiny", "--device", "xeon-amx", "--gpus-per-node", "2",
                      "--nodes", "1", "--tokens", "1e9"],
            "run": ["run", str(plan), "--print-launch", "--checkpoint-dir", str(tmp / "ck")]}


def _argv(base: list[str], command: str, flag: str, value: str) -> list[str]:
    extra = NEEDS.get(flag, [])
    if command == "run":
        extra = [] if flag in RUN_NEEDS else extra
        base = base if flag in RUN_NEEDS or flag == "--checkpoint-dir" else base[:3]
    for name in [*extra[::2], flag]:
        base = _without(base, name)
    return [*base, *extra, flag, value]


@pytest.mark.parametrize("command", ["search", "predict", "sweep", "run"])
def test_every_numeric_flag_at_its_edges_is_one_line_or_finite(command, bases, capsys):
    flags = numeric_flags(command)
    assert len(flags) >= 8, flags   # the collection found the flags
    for flag in flags:
        for value in VALUES:
            argv = _argv(bases[command], command, flag, value)
            code = main(argv)
            out, err = capsys.readouterr()
            said = [line for line in err.splitlines() if not line.startswith(("search [", "sweep ", "wrote "))]
            where = f"{' '.join(argv[:1] + argv[-2:])}: exit {code}, {err[-400:]!r}"
            assert code in (0, 2) and "Traceback" not in err and "internal error" not in err, where
            if code == 2:
                assert len(said) == 1, where
            elif "--json" in argv:
                json.loads(out, parse_constant=lambda c: pytest.fail(f"{where}: {c} in the JSON"))
            else:
                assert " inf" not in out and " nan" not in out.lower(), where


@pytest.mark.parametrize("value", ["1e308", "1e-300", "0.5"])
def test_a_hang_timeout_the_watchdog_cannot_wait_is_refused(bases, capsys, value):
    """The start-up watchdog waits on a thread's timer (1e308 s was an OverflowError in that
    thread, which left the run unwatched), and the progress check looks once a second."""
    assert main([*bases["run"][:3], "--hang-timeout", value]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "argument --hang-timeout: " in err and "give 1 to 1e+06 s" in err, err


INTEGERS = ("0", "-1", str(10**30))
# how each kind of integer flag names its range when refusing a value
RANGE_WORDS = ("give ", "invalid choice")


def integer_flags(command: str) -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))   # noqa: SLF001
    return [a.option_strings[0] for a in sub.choices[command]._actions   # noqa: SLF001
            if a.option_strings and (a.type is int or "int" in getattr(a.type, "__name__", ""))]


@pytest.mark.parametrize("command", ["search", "predict", "sweep", "run", "profile"])
def test_every_integer_flag_is_bounded_where_it_is_read(command, bases, capsys):
    """A huge or negative count is refused by the parser in one line naming the flag and its
    range (exit 2), before it can overflow a size or make a run that never ends (`--steps
    10**30`); 0 is one line or taken."""
    flags = integer_flags(command)
    assert len(flags) >= (1 if command == "profile" else 3), flags   # the collection found the flags
    for flag in flags:
        for value in INTEGERS:
            argv = _argv(bases.get(command, [command]), command, flag, value)
            code = main(argv)
            err = capsys.readouterr().err.strip().splitlines()
            where = f"{' '.join(argv[:1] + argv[-2:])}: exit {code}, {err}"
            if value == "0":   # refused by the parser, or by what checks the plan, or taken
                assert code == 0 or (code == 2 and len(err) == 1), where
                continue
            assert code == 2 and len(err) == 1 and f"argument {flag}: " in err[0], where
            assert any(word in err[0] for word in RANGE_WORDS), where


def _with_shipped(old: str, profile_text: str) -> str:
    """`old` ("\nKEY = <shipped>") with `<shipped>` read as the profile's fitted value of KEY (a
    refit changes it)."""
    if "<shipped>" not in old:
        return old
    key = old.strip().split(" = ")[0]
    return old.replace("<shipped>", re.search(rf"^{key} = ([0-9.]+)", profile_text, re.M).group(1))


@pytest.mark.parametrize("old, new, name", [
    ("\nbandwidth_bytes_per_s = ", "\nbandwidth_bytes_per_s = 1e-300 #", "bandwidth_bytes_per_s"),
    ("\nbandwidth_bytes_per_s = ", "\nbandwidth_bytes_per_s = 1e308 #", "bandwidth_bytes_per_s"),
    ("memory_bandwidth_bytes_per_s = ", "memory_bandwidth_bytes_per_s = 1e-300 #", "memory_bandwidth_bytes_per_s"),
    ("bf16 = 989.4e12", "bf16 = 1e308", "peak_flops_per_s.bf16"),
    ("\nlatency_s = 3.4e-6", "\nlatency_s = 1e308 #", "latency_s"),
    ("\nbase_latency_s = 8.4e-6", "\nbase_latency_s = 1e308 #", "base_latency_s"),
    ("kernel_overhead_s = 30e-06", "kernel_overhead_s = 1e308", "kernel_overhead_s"),
    ("\ncomm_contention = ", "\ncomm_contention = 1e308 #", "comm_contention"),
    ("\ngemm = ", "\ngemm = 1e308 #", "efficiency.gemm"),         # the [efficiency] value, before [ranges]
    ("\nmemory = ", "\nmemory = 1e-300 #", "efficiency.memory"),
    ("\nintra_node_comm = ", "\nintra_node_comm = 1e-300 #", "nvlink4 efficiency"),
    ("num_sms = 132", "num_sms = 1e308", "num_sms"),
    ("memory_bytes = 85_899_345_920", "memory_bytes = 1e308", "memory_bytes"),
    ("allocator_fragmentation = 0.08", "allocator_fragmentation = 1e308", "allocator_fragmentation")])
def test_a_profile_rate_beyond_its_range_is_refused(tmp_path, capsys, old, new, name):
    """A step's times divide by these rates: the solver's coefficients and the tables hold them
    only within the checked ranges (costmodel.hardware.profile_check)."""
    text = (profile_dir() / "H100-SXM5-80GB.toml").read_text()
    old = _with_shipped(old, text)
    assert old in text
    (tmp_path / "odd.toml").write_text(text.replace(old, new, 1))
    assert main(["predict", "--model", "llama-7b", "--cluster", f"2x8x{tmp_path / 'odd.toml'}"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and name in err and "out of range" in err, err


@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "2.5"])
@pytest.mark.parametrize("key", ["memory_bytes = 85_899_345_920", "num_sms = 132",
                                 "reserved_memory_bytes = 2_147_483_648", "memory_bytes = 2_199_023_255_552"])
def test_a_profile_count_that_is_not_whole_is_refused(tmp_path, capsys, key, value):
    """Sizes and counts are whole numbers: int() of an infinity raised OverflowError (a bug's
    line) and of a NaN a message naming no key."""
    text = (profile_dir() / "H100-SXM5-80GB.toml").read_text()
    name = key.split(" = ")[0]
    (tmp_path / "odd.toml").write_text(text.replace(key, f"{name} = {value}", 1))
    assert main(["predict", "--model", "llama-7b", "--cluster", f"2x8x{tmp_path / 'odd.toml'}"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and f"{name} is a whole number" in err, err


def test_a_measured_attention_point_at_a_tiny_sequence_is_refused(tmp_path, capsys):
    """A CPU profile's SDPA time per query-key pair divides by the point's sequence squared, which
    for 1e-300 is zero (a ZeroDivisionError wherever the pricing reads that point)."""
    fake = _cpu_profile_with_sdpa(tmp_path, "[[1e-300, 16, 2e-06], [128, 16, 2e-05]]")
    assert main(["predict", "--model", "debug-tiny", "--cluster", f"1x2x{fake}", "--pp", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "measured.sdpa_fp32_forward" in err, err


def _cpu_profile_with_sdpa(tmp_path, forward: str):
    text = (profile_dir() / "xeon-amx.toml").read_text()
    measured = "\n[measured]\n" if "[measured]" not in text else None
    pair = f"sdpa_fp32_forward = {forward}\nsdpa_fp32_backward = [[32, 16, 5e-06], [128, 16, 4e-05]]\n"
    text = text + measured + pair if measured else text.replace("[measured]\n", "[measured]\n" + pair, 1)
    (tmp_path / "cpu.toml").write_text(text)
    return tmp_path / "cpu.toml"


def test_a_run_that_never_ends_is_said_so_and_its_json_stays_strict(capsys):
    """Failures faster than checkpoints keep no work: days without a finite value are null in
    --json (JSON has no Infinity) and the text says the run never ends."""
    argv = ["predict", "--model", "llama-70b", "--cluster", "64x8xA100", "--tp", "8", "--pp", "4", "--tokens", "1e12",
            "--device-mtbf-hours", "0.001"]
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))
    assert doc["training"]["days"] is None and doc["training"]["gpu_hours"] is None
    assert main(argv) == 0
    assert "never ends" in capsys.readouterr().out


@pytest.mark.parametrize("field, value", [("step_time_s", 1e308), ("tokens_per_s", 1e308), ("step_times_s", [1e7])])
@pytest.mark.parametrize("command", ["calibrate", "report"])
def test_a_measured_run_beyond_any_measurement_is_refused(tmp_path, capsys, field, value, command):
    """measured.json read back (calibrate, report --measured): a step of 1e308 s pushed the fitted
    profile out of its ranges and overflowed the report's figures; one line naming the file."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fuzzing
    ws = fuzzing.make_workspace(tmp_path / "ws")
    doc = json.loads((ws.run_dir / "measured.json").read_text())
    (ws.run_dir / "measured.json").write_text(json.dumps({**doc, field: value}))
    argv = (["calibrate", str(ws.run_dir), "--profile", str(ws.profile), "--out", str(tmp_path / "c.toml")]
            if command == "calibrate" else
            ["report", str(ws.plan), "--measured", str(ws.run_dir / "measured.json"), "--out", str(tmp_path / "r")])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "measured.json: step times must be at most 1e+06 s" in err, err


@pytest.mark.parametrize("old, new, named", [
    ("\nintra_node_comm = <shipped>", '\nintra_node_comm = "0.8"', "[efficiency] intra_node_comm is a number"),
    ("\ngemm = <shipped>", '\ngemm = "fast"', "[efficiency] gemm is a number"),
    ("\ngemm = <shipped>", "\ngemm = true", "[efficiency] gemm is a number"),
    ("memory_efficiency = 0.8", 'memory_efficiency = "0.8"', "[host] memory_efficiency is a number"),
    ("bf16 = 989.4e12", 'bf16 = "989.4e12"', "[device.peak_flops_per_s] bf16 is a number"),
    ("bf16 = 989.4e12", "bf61 = 989.4e12", "peak_flops_per_s: unknown dtype(s) bf61"),
    ('aliases = ["H100", "H100-80GB"]', 'aliases = "H100"', "[device] aliases is a list of names"),
    ('name = "nvlink4"', "", "[network node] name is missing"),
    ("\ngemm = <shipped>", "\ngemm = 7.48", "efficiency.gemm = 7.48 is out of range"),   # of a datasheet peak
    ("reserved_memory_bytes = 2_147_483_648", "reserved_memory_bytes = 200_000_000_000",
     "efficiency.reserved_memory_bytes = 200000000000 is out of range")])
def test_a_profile_value_of_the_wrong_kind_is_named_by_its_table_and_key(tmp_path, capsys, old, new, named):
    """A string where a number belongs, a list where a table belongs, an unknown dtype or a value
    no device has is one line naming the file, the table and the key."""
    text = (profile_dir() / "H100-SXM5-80GB.toml").read_text()
    old = _with_shipped(old, text)
    assert old in text
    (tmp_path / "odd.toml").write_text(text.replace(old, new, 1))
    assert main(["predict", "--model", "llama-7b", "--cluster", f"2x8x{tmp_path / 'odd.toml'}"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and str(tmp_path / "odd.toml") in err and named in err, err
