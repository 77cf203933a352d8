"""ISA dispatch: the kernels give the same answers on every tier this CPU supports
(KT_ISA=avx2 / avx512 / scalar re-run a quick subset of the MoE and Linear tests in a
subprocess), and a bad KT_ISA is a clean Python error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ktransformers.cpuinfer_ext as ext
import ktransformers.kernels as K

HERE = Path(__file__).resolve().parent
ORDER = ["scalar", "avx2", "avx512", "avx512bf16", "amx"]


def test_tier_reported():
    t = K.isa_tier()
    assert t in ORDER
    if os.environ.get("KT_ISA"):
        assert t == os.environ["KT_ISA"]
    assert ext.kernel_table() == t


def _env(tier: str) -> dict:
    env = dict(os.environ, KT_ISA=tier, KT_TEST_QUICK="1")
    return env


@pytest.mark.parametrize("tier", ["avx2", "avx512", "scalar"])
def test_lower_tier_subset(tier):
    if ORDER.index(tier) > ORDER.index(ext.best_isa_tier()):
        pytest.skip(f"CPU does not support {tier}")
    files = [str(HERE / "test_linear.py"), str(HERE / "test_kernel_table.py"), str(HERE / "test_int4_backends.py"),
             str(HERE / "test_isa.py::test_tier_reported")]
    if tier != "scalar":  # scalar runs every type through the generic path: Linear only (speed)
        files.insert(0, str(HERE / "test_moe.py"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
                       env=_env(tier), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.parametrize("value,match", [("avx9000", "not one of"), ("amx", "more than this CPU")])
def test_bad_kt_isa(value, match):
    if value == "amx" and ext.best_isa_tier() == "amx":
        pytest.skip("CPU supports AMX")
    code = ("import ktransformers.kernels as K\n"
            "try:\n    K.cpu_infer(1)\nexcept ValueError as e:\n    print('ValueError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, KT_ISA=value),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ValueError:" in r.stdout and match in r.stdout, r.stdout
