#!/usr/bin/env bash
# Set up a fresh machine: a venv in .venv, torch pinned to its CPU wheel first (an unpinned
# torch would pull a multi-GB CUDA build), then this package with its C++ kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[test,demo]"
.venv/bin/python -c "import ktransformers, ktransformers.cpuinfer_ext as e; print('ktransformers ready; CPU kernel tier:', e.isa_tier())"
