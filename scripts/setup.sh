#!/usr/bin/env bash
# Set up a fresh machine: a venv in .venv, torch pinned to its CPU wheel first (an unpinned
# torch would pull a multi-GB CUDA build), then this package with its C++ kernels.
# Re-running is cheap: nothing is reinstalled while pyproject.toml, setup.py and csrc/ are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.ktransformers-installed
# KT_EXTRAS: more of pyproject's extras, comma-separated (e.g. scale-out: PostgreSQL for the server)
extras="test,demo${KT_EXTRAS:+,$KT_EXTRAS}"
want=$( (cat pyproject.toml setup.py $(find csrc -type f | sort); echo "$extras") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c "import ktransformers.cpuinfer_ext" 2>/dev/null; then
  PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
  "${PIP[@]}" "torch==2.13.0"
  "${PIP[@]}" -e ".[$extras]"
  echo "$want" > "$stamp"
fi
.venv/bin/python -c "import ktransformers.kernels as k; print('ktransformers ready; CPU kernel tier:', k.isa_tier())"
