"""The command line's own boundary: argparse errors as one line, value types that refuse zero and
nonsense instead of falling back to a default, and flags that contradict each other or that a
mode would ignore refused by name."""
from __future__ import annotations

import argparse
import math
import sys

from costmodel.inputs import MAX_WORLD_SIZE

EXIT_USAGE = 2
EXIT_STOPPED = 1


class Stopped(Exception):
    """Work that ran and broke for a reason outside the command line and the planner's code (a
    training run whose loss stopped being finite): one line, its notes after it, exit 1."""


class Parser(argparse.ArgumentParser):
    """argparse without the usage text on errors (one line and a pointer to --help) and without
    abbreviated long flags (`--glob` for `--global-batch` breaks the day another flag starts alike)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def add_overwrite_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help="replace what an earlier command wrote there (refused otherwise)")


def _number(text: str, kind: type):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_int(text: str) -> int:
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def non_negative_int(text: str) -> int:
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def seed_int(text: str) -> int:
    """A seed the ranks can derive theirs from without overflowing torch's 64-bit seed."""
    value = _number(text, int)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{text}: give 0 to 2^32 - 1")
    return value


def int_in(low: int, high: int):
    """A whole number from `low` to `high`: what the step it feeds can take without overflowing a
    size or running for ever (`--steps 10**30`); argparse names the flag before the range."""
    def parse(text: str) -> int:
        value = _number(text, int)
        if value < low:
            what = {0: "is negative", 1: "is not a positive integer"}.get(low, f"is below {low:,}")
            raise argparse.ArgumentTypeError(f"{value} {what} (give {low:,} to {high:,})")
        if value > high:
            raise argparse.ArgumentTypeError(f"{text} is too large (give {low:,} to {high:,})")
        return value
    parse.__name__ = f"int_in({low}, {high})"
    return parse


# Runs: ten million steps is several times the longest published pre-training run (Llama 3
# 405B: about 1.2 million), and bounds every count of steps (warm-up, checkpoint interval, kept
# checkpoints); a thousand restarts are past any use.
MAX_STEPS = 10_000_000
MAX_RESTARTS = 1_000
MAX_TOP = 10_000   # plans ranked in a table (--csv holds them all)
DEGREE = int_in(1, MAX_WORLD_SIZE)   # a parallel degree, or a count of nodes, devices or ranks


def positive_float(text: str) -> float:
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not positive")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return value


def float_in(low: float, high: float, unit: str = ""):
    """A number from `low` to `high`: the range the formulas it feeds are defined and finite
    for (beyond it a time, a cost or a solver's coefficient overflows or means nothing)."""
    def parse(text: str) -> float:
        value = _number(text, float)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text}: give {low:g} to {high:g}{unit}")
        return value
    parse.__name__ = f"float_in({low:g}, {high:g})"
    return parse


def number_list(kind):
    """A comma-separated list of numbers, each read by `kind` (e.g. positive_int)."""
    def parse(text: str) -> list:
        items = [t.strip() for t in text.split(",")]
        if not items or any(not t for t in items):
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list, e.g. 4,8,16")
        return [kind(t) for t in items]
    parse.__name__ = f"number_list({kind.__name__})"
    return parse


def at_least_one(text: str) -> float:
    value = _number(text, float)
    if value < 1.0:
        raise argparse.ArgumentTypeError(f"{text} is below 1")
    return value


def fraction(text: str) -> float:
    value = _number(text, float)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not a fraction in [0, 1), e.g. 0.05")
    return value


def given_flags(parser: argparse.ArgumentParser, tokens: list[str]) -> dict[str, list[str]]:
    """The flags the user typed, by destination: {"sp": ["--sp", "--no-sp"], ...}.
    (argparse does not tell a default from a typed value; the option table it keeps does.)"""
    table = parser._option_string_actions   # noqa: SLF001 - stable since Python 3.2
    given: dict[str, list[str]] = {}
    for token in tokens:
        if token == "--":
            break
        action = table.get(token.split("=", 1)[0]) if token.startswith("-") else None
        if action is not None:
            given.setdefault(action.dest, []).append(token.split("=", 1)[0])
    return given


def refuse_repeated(parser: argparse.ArgumentParser, given: dict[str, list[str]]) -> None:
    """A single-valued flag given twice is a contradiction, not "the last one wins"."""
    table = parser._option_string_actions   # noqa: SLF001
    for dest, flags in given.items():
        if len(flags) > 1 and not isinstance(table[flags[0]], argparse._AppendAction):   # noqa: SLF001
            distinct = list(dict.fromkeys(flags))
            said = (f"{' and '.join(distinct)} contradict each other" if len(distinct) > 1
                    else f"{flags[0]} given {len(flags)} times")
            raise argparse.ArgumentError(None, f"{said}; say it once")


def refuse_ignored(given: dict[str, list[str]], dests: set[str], because: str) -> None:
    """Flags a mode would ignore are an error naming them, so nobody believes they took effect."""
    ignored = sorted({flag for dest in dests & set(given) for flag in given[dest]})
    if ignored:
        raise argparse.ArgumentError(None, f"{', '.join(ignored)} would be ignored: {because}")


def add_failure_args(p: argparse.ArgumentParser) -> None:
    """What checkpoints and failures cost (costmodel.resilience): Llama 3's figures unless stated."""
    from costmodel.resilience import LLAMA3
    g = p.add_argument_group("failures and checkpoints (default: Llama 3's published figures)")
    g.add_argument("--device-mtbf-hours", type=positive_float, metavar="H",
                   help=f"mean time between failures of one device, in hours (default about "
                        f"{1 / LLAMA3.failures_per_device_hour:,.0f}: Llama 3's 419 interruptions in 54 days on "
                        "16,384 GPUs); the job's is H / devices")
    g.add_argument("--storage-mb-s-per-device", type=positive_float, metavar="B",
                   help=f"checkpoint write bandwidth per device in MB/s (default "
                        f"{LLAMA3.storage_bytes_per_s_per_device / 1e6:,.0f}: Llama 3's 2 TB/s storage for 16,384 GPUs)")


def failures_from_args(args: argparse.Namespace):
    from costmodel.resilience import stated
    return stated(args.device_mtbf_hours, args.storage_mb_s_per_device)
