"""Write docs/cli.md from the command line's own parsers: `planner --help` and every
subcommand's, as a user sees them at 100 columns. tests/planner/test_cli_docs.py fails when
the file is stale.

    python3 scripts/cli_docs.py [--check]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cli.md"
WIDTH = "100"


def render() -> str:
    """The whole page: the top-level help, then each subcommand's in the parser's order, with the
    cache directory shown as its default (~/.cache/planner) whatever this machine's home is."""
    os.environ["COLUMNS"] = WIDTH   # argparse wraps at the terminal's width
    cache = os.environ.get("PLANNER_CACHE_DIR")
    os.environ["PLANNER_CACHE_DIR"] = "~/.cache/planner"
    try:
        return _render()
    finally:
        if cache is None:
            del os.environ["PLANNER_CACHE_DIR"]
        else:
            os.environ["PLANNER_CACHE_DIR"] = cache


def _render() -> str:
    sys.path.insert(0, str(ROOT))
    from planner.cli import build_parser
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    parts = ["# The `planner` command line\n",
             "Generated from the parsers by `python3 scripts/cli_docs.py`; "
             "`tests/planner/test_cli_docs.py` fails when it is stale.\n",
             "```text\n" + parser.format_help() + "```\n"]
    for name, p in sub.choices.items():
        parts.append(f"## planner {name}\n\n```text\n{p.format_help()}```\n")
    return "\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/cli.md differs, write nothing")
    args = ap.parse_args()
    text = render()
    if args.check:
        same = DOC.is_file() and DOC.read_text() == text
        print(f"{DOC} is {'current' if same else 'stale: run python3 scripts/cli_docs.py'}")
        return 0 if same else 1
    DOC.write_text(text)
    print(f"wrote {DOC} ({len(text.splitlines())} lines)\ncommand: python3 scripts/cli_docs.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
