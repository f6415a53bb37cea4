#!/usr/bin/env bash
# The one-command GPU check (docs/gpu.md): every stage a first GPU run needs, each with its own time
# limit, the report in OUT_DIR/report.md and OUT_DIR/report.json (logs in OUT_DIR/logs/).
#   bash scripts/gpu_check.sh OUT_DIR          on a machine with a CUDA GPU (about 7 minutes)
#   bash scripts/gpu_check.sh OUT_DIR --cpu    the same stages on the CPU at tiny sizes (CI: tests/test_gpu_check.py)
# Runs from a checkout without installing it (this checkout goes first on PYTHONPATH). Exit status 0
# when no stage failed; the report says PASS / FAIL / SKIP per stage with the reason either way.
set -u
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    echo "usage: bash scripts/gpu_check.sh OUT_DIR [--cpu] [--budget SECONDS]" >&2
    exit 2
fi
PYTHON="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" scripts/gpu_check.py "$@"
