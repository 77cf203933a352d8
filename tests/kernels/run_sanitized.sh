#!/usr/bin/env bash
# Build the CPU kernels with AddressSanitizer + UndefinedBehaviorSanitizer (KT_SANITIZE=ON in
# csrc/CMakeLists.txt) into build/sanitize/ -- the regular in-tree extension is not touched --
# and run tests/kernels against that build.
#
#   tests/kernels/run_sanitized.sh            # quick grid (KT_TEST_QUICK=1)
#   tests/kernels/run_sanitized.sh -k Q4_K    # extra pytest arguments are passed through
#   KT_TEST_QUICK=0 tests/kernels/run_sanitized.sh   # full grid (slow)
#   KT_ISA=avxvnni tests/kernels/run_sanitized.sh    # on one forced tier (test_isa.py runs the others)
#
# How it works: CMake writes the sanitized cpuinfer_ext*.so into build/sanitize/pkg/ktransformers/,
# next to symlinks to every other file of the ktransformers package; PYTHONPATH puts that shadow
# package first.  Python itself is not instrumented, so libasan (and libubsan) must be loaded
# first via LD_PRELOAD.  Leak detection is off (CPython/torch keep memory until exit); any
# ASan/UBSan report aborts the test run with a stack trace.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
export PATH="$(dirname "$PY"):$PATH"   # cmake and ninja from the venv (the [test] extra) when the system has none
B="$ROOT/build/sanitize"
mkdir -p "$B/pkg/ktransformers"
PYBIND11_DIR="$("$PY" -c 'import pybind11; print(pybind11.get_cmake_dir())')"
cmake -S "$ROOT/csrc" -B "$B/cmake" -G Ninja -DKT_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug \
  -DKT_EXT_NAME=cpuinfer_ext -DPython_EXECUTABLE="$PY" -Dpybind11_DIR="$PYBIND11_DIR" \
  -DCMAKE_LIBRARY_OUTPUT_DIRECTORY="$B/pkg/ktransformers" >/dev/null
cmake --build "$B/cmake" --parallel "${CMAKE_BUILD_PARALLEL_LEVEL:-2}"
for f in "$ROOT"/ktransformers/*; do
  case "$f" in *.so) ;; *) ln -sfn "$f" "$B/pkg/ktransformers/" ;; esac
done

export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libubsan.so)"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export PYTHONPATH="$B/pkg${PYTHONPATH:+:$PYTHONPATH}"
export KT_TEST_QUICK="${KT_TEST_QUICK:-1}"
cd "$B"  # not $ROOT: the current directory would shadow the sanitized package
"$PY" -c 'import ktransformers.cpuinfer_ext as e, sys; assert "build/sanitize" in e.__file__, e.__file__; print("sanitized build:", e.__file__, "tier", e.isa_tier())'
exec "$PY" -m pytest -q -p no:cacheprovider --rootdir "$ROOT" "$ROOT/tests/kernels" "$@"
