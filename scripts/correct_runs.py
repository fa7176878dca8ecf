"""Write a copy of a published-runs table with documented corrections applied.

    python scripts/correct_runs.py ../shared/reference/published_runs.csv > corrected_runs.csv

Each correction names the rows, the field, the new value and the evidence from the row itself.
The shared table is not ours to edit; this keeps every change visible and reviewable.
"""
from __future__ import annotations

import csv
import sys

CORRECTIONS = [
    # (row id prefix, field, value, evidence)
    ("megatron_h100_", "zero_stage", "1",
     "the notes list --overlap-param-gather, which Megatron-LM accepts only with "
     "--use-distributed-optimizer (ZeRO-1); at ZeRO-0 these configs need 68-79 GB of model "
     "states per GPU (18 bytes/param x ~3.8-4.4 B params/GPU) and cannot run as published"),
]


def main() -> None:
    with open(sys.argv[1], newline="") as fh:
        reader = csv.DictReader(fh)
        rows, fields = list(reader), reader.fieldnames
    for prefix, field, value, why in CORRECTIONS:
        hit = [r["id"] for r in rows if r["id"].startswith(prefix)]
        for r in rows:
            if r["id"].startswith(prefix):
                r[field] = value
        print(f"corrected {field}={value} on {len(hit)} rows ({prefix}*): {why}", file=sys.stderr)
    writer = csv.DictWriter(sys.stdout, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)


if __name__ == "__main__":
    main()
