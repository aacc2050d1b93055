#!/usr/bin/env bash
# Creates .venv (if missing) and installs deepinfer with its test extras. Idempotent.
# torch is pinned in the same pip command: unpinned, a dependency resolves to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[test]"
.venv/bin/python -c "import deepinfer, torch; print(f'deepinfer {deepinfer.__version__} ready (torch {torch.__version__})')"
