#!/usr/bin/env bash
# One-step set-up for a fresh machine (Python >= 3.11 with pip, nothing else).
# Installs the pinned CPU build of torch only when no torch is present: an unpinned torch
# would pull several GB of CUDA packages, and a GPU user's own torch must not be replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "setup: no torch found, installing the CPU build torch==2.13.0" >&2
    "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[test]"
