#!/usr/bin/env bash
# Fetch the wheels the GPU machine's image lacks into .whl/ (git-ignored through
# .git/info/exclude), for Python 3.12 on x86-64 Linux: carry `.whl` with the device run and
# tools/gpu_check.sh installs them. ~3.2 MB. Versions are the ones this tree is tested with.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXCLUDE="$(git rev-parse --git-common-dir)/info/exclude"
grep -qxF '/.whl/' "$EXCLUDE" 2>/dev/null || echo '/.whl/' >> "$EXCLUDE"
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux1_x86_64 -d .whl \
    gguf==0.19.0 posix_ipc==1.3.2 llguidance==1.9.1 pytest-asyncio==1.5.0
ls -l .whl
