#!/usr/bin/env bash
# The checks that need a CUDA device, in one run (for a machine with a GPU; CI has none).
# Builds nothing that needs CUDA: the CPU extension plus torch's CUDA build are enough.
set -euo pipefail
cd "$(dirname "$0")/.."
nvidia-smi -L || true
exec "${PYTHON:-python3}" -m pytest -q -ra tests/test_cuda.py tests/generation/test_parity.py tests/test_gpu_quant_linear.py -k "cuda or gpu" "$@"
