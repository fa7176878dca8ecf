"""`planner validate`: predicted against published step times, row by row."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from planner.commands.common import emit_json


def cmd_validate(args: argparse.Namespace) -> int:
    from planner.measure.runs_table import default_runs_path
    from planner.measure.validate import validate
    results, summary = validate(Path(args.runs) if args.runs else default_runs_path(), args.time_limit,
                                progress=lambda text: print(f"validate {text}", file=sys.stderr, flush=True))
    if args.json:
        emit_json({"rows": [r.to_dict() for r in results], "summary": summary})
    else:
        from reports.tables import validate_table
        print(validate_table(results, summary))
    return 0
