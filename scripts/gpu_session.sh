#!/usr/bin/env bash
# The command for a session on a GPU machine: `bash scripts/gpu_session.sh` (allow it 360 s: the
# script's own hard deadline is 330 s, so a rerun still fits in a short session). Everything
# lives in scripts/gpu_session.py (step 0, the plan, the deadline, outputs under $OUT); this
# wrapper only moves to the checkout root and picks the Python (PYTHON, default python3: on the
# device, the one with torch and CuPy). Nothing is installed: the package imports from here.
#
#   here, first:  OUT=/tmp/gpu-smoke bash scripts/gpu_session.sh --cpu-smoke
#   options:      --deadline S, --only STEP,STEP, --out DIR (default $OUT)
set -u
cd "$(dirname "$0")/.." || exit 2
exec "${PYTHON:-python3}" scripts/gpu_session.py "$@"
