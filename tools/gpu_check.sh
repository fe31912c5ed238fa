#!/usr/bin/env bash
# The GPU check: one command on a bare GPU machine (no internet, its own python3 and torch).
#
#   tools/gpu_check.sh [--device cuda|cpu] [--quick] [--out DIR] [--skip STAGES]
#
# Installs the wheels carried in .whl/ (tools/gpu_wheels.sh fetches them: the packages the
# machine's image lacks) into a private folder, runs luced from this tree on PYTHONPATH, and
# hands over to tools/gpu_check.py (stages, budgets, the JSON report in --out, default $OUT).
# `--device cpu` runs the same stages on the CPU with tiny shapes (CI, and before any GPU run).
# PYTHON picks the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${LUCED_CHECK_SITE:-/tmp/luced-check-site}
# Only what is missing: a wheel for another Python must not shadow an installed package.
if ! "$PY" -c "import gguf, posix_ipc, llguidance, pytest_asyncio" 2>/dev/null \
    && compgen -G ".whl/*.whl" >/dev/null; then
    echo "[gpu_check] installing $(ls .whl/*.whl | wc -l) carried wheels into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl
    export PYTHONPATH="$PWD:$PWD/tools:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD:$PWD/tools${PYTHONPATH:+:$PYTHONPATH}"
fi
exec "$PY" tools/gpu_check.py "$@"
