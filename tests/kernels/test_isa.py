"""ISA dispatch: the kernels give the same answers on every tier this CPU supports
(KT_ISA=avx2 / avxvnni / avx512 / avx512vnni / scalar re-run a quick subset of the MoE, Linear
and batch-invariance tests in a subprocess), the avxvnni tier's vpdpbusd kernels give the avx2 tier's bits,
and a bad KT_ISA is a clean Python error."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import TIERS, int_kernel_suffix

import ktransformers.cpuinfer_ext as ext
import ktransformers.kernels as K

HERE = Path(__file__).resolve().parent


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_tier_reported():
    t = K.isa_tier()
    assert t in TIERS
    if os.environ.get("KT_ISA"):
        assert t == os.environ["KT_ISA"]
    assert ext.kernel_table() == t
    supported = ext.supported_isa_tiers()
    assert supported == [x for x in TIERS if x in supported] and t in supported, supported
    assert supported[-1] == ext.best_isa_tier(), supported  # AVX-512 outranks AVX-VNNI by default


def test_avxvnni_detection_matches_the_kernel():
    """CPUID's AVX-VNNI bit (with AVX2) is what Linux reports as avx_vnni."""
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags")
    assert ext.cpu_features()["avx_vnni"] == ("avx_vnni" in flags)
    assert ("avxvnni" in ext.supported_isa_tiers()) == ({"avx_vnni", "avx2", "fma", "f16c"} <= flags)


def test_avx512_tiers_follow_cpuinfo():
    """avx512 needs F/BW/VL, avx512vnni adds VNNI (Cascade Lake, Ice Lake), avx512bf16 adds BF16:
    each is offered exactly when Linux reports those flags (and AVX2/FMA/F16C)."""
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags")
    base = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}
    tiers = ext.supported_isa_tiers()
    assert ("avx512" in tiers) == (base <= flags)
    assert ("avx512vnni" in tiers) == (base | {"avx512_vnni"} <= flags)
    assert ("avx512bf16" in tiers) == (base | {"avx512_vnni", "avx512_bf16"} <= flags)


def _env(tier: str) -> dict:
    env = dict(os.environ, KT_ISA=tier, KT_TEST_QUICK="1")
    return env


@pytest.mark.parametrize("tier", ["avx2", "avxvnni", "avx512", "avx512vnni", "scalar"])
def test_lower_tier_subset(tier):
    if tier not in ext.supported_isa_tiers():
        pytest.skip(f"CPU does not support {tier}")
    files = [str(HERE / "test_linear.py"), str(HERE / "test_kernel_table.py"), str(HERE / "test_int4_backends.py"),
             str(HERE / "test_batch_invariance.py"), str(HERE / "test_attention.py"),
             str(HERE / "test_decode_attend.py"), str(HERE / "test_isa.py::test_tier_reported")]
    if tier != "scalar":  # scalar runs every type through the generic path: Linear only (speed)
        files.insert(0, str(HERE / "test_moe.py"))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *files],
                       env=_env(tier), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.parametrize("value,match", [("avx9000", "not one of"), ("amx", "more than this CPU"),
                                         ("avxvnni", "more than this CPU")])
def test_bad_kt_isa(value, match):
    if value in ext.supported_isa_tiers():
        pytest.skip(f"CPU supports {value}")
    code = ("import ktransformers.kernels as K\n"
            "try:\n    K.cpu_infer(1)\nexcept ValueError as e:\n    print('ValueError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, KT_ISA=value),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ValueError:" in r.stdout and match in r.stdout, r.stdout


# Integer weight types of the 256-bit kernels (the float types keep their fp32 FMA kernels).
INT_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS",
             "MXFP4", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]
# formats whose 256-bit prefill unpacks weight panels (the IQ grid types run row tiles, "_t8")
PANEL_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "IQ4_XS", "MXFP4",
               "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


def _cases():
    """(label, backend, type, raw, dequantized, x): every integer type at T = 1 (decode),
    T = 5 (row tiles, panels for the 32-element formats) and T = 17 (panels), the packed int8
    backend, and Q8_0 rows of int8 -128 against +-1 inputs (activations +-127: the largest pair
    products, 2 * 128 * 127) through the row tiles and the panels."""
    from gguf import GGMLQuantizationType as QT
    from quant_ref import make_weights
    from test_iq_kernels import IQ_TYPES, iq_weights
    rng = np.random.default_rng(7)
    out = []
    for name in INT_TYPES:
        raw, deq = iq_weights(name, (13, 512), rng) if name in IQ_TYPES else make_weights(QT[name], (13, 512), rng)
        for T in (1, 5, 17):
            out.append((f"{name}-T{T}", "llamafile", name, raw, deq, rng.standard_normal((T, 512)).astype(np.float32)))
    raw, deq = make_weights(QT.BF16, (40, 512), rng)
    out.append(("AMXInt8-T3", "AMXInt8", "BF16", raw, deq, rng.standard_normal((3, 512)).astype(np.float32)))
    raw = np.zeros((8, 16, 34), np.uint8)
    raw[..., 0:2] = np.float16(0.01).reshape(1).view(np.uint8)
    raw[..., 2:] = np.uint8(0x80)
    raw = raw.reshape(8, -1)
    deq = np.full((8, 512), -128 * np.float32(np.float16(0.01)), np.float32)
    for T in (5, 17):
        x = np.where(rng.random((T, 512)) < 0.5, -1.0, 1.0).astype(np.float32)
        out.append((f"Q8_0-min-T{T}", "llamafile", "Q8_0", raw, deq, x))
    return out


def dump_tier_outputs(path: str) -> None:
    """Run every case on the tier in force and save the outputs and the kernel table (subprocess)."""
    pool = K.cpu_infer(2)
    res = {"rows": np.array(repr(ext.kernel_rows()))}
    for label, backend, name, raw, _, x in _cases():
        res[label] = K.LinearKernel(pool, backend, x.shape[1], raw.shape[0], raw, name).forward(x)
    np.savez(path, **res)


def test_avxvnni_gives_the_avx2_bits(tmp_path):
    """KT_ISA=avxvnni names its integer kernels *_vnni256 and gives bit for bit the outputs of
    KT_ISA=avx2 (vpdpbusd / vpdpwssd compute the exact integer dot as vpmaddubsw + vpmaddwd do
    here: no pair saturates), both within the int8-activation tolerances of float64 (test_linear.py:
    2e-2, AMXInt8 3e-2; the all -128 Q8_0 rows against +-1 inputs: 1e-6, their activations are exact)."""
    if "avxvnni" not in ext.supported_isa_tiers():
        pytest.skip("CPU has no AVX-VNNI")
    got = {}
    for tier in ("avx2", "avxvnni"):
        code = ("import sys; sys.path.insert(0, sys.argv[1]); from test_isa import dump_tier_outputs; "
                "dump_tier_outputs(sys.argv[2])")
        r = subprocess.run([sys.executable, "-c", code, str(HERE), str(tmp_path / f"{tier}.npz")], env=_env(tier),
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        got[tier] = dict(np.load(tmp_path / f"{tier}.npz"))
    for tier, res in got.items():
        rows = eval(str(res.pop("rows")))
        for name in INT_TYPES:
            k = name.lower().replace("_k", "k") + int_kernel_suffix(tier)
            assert rows[name][:2] == (k, k + ("_panel" if name in PANEL_TYPES else "_t8")), (tier, name, rows[name])
        assert rows["F32"][0] == "f32_avx2" and rows["BF16"][0] == "bf16_avx2", rows
    from ref import rel_err
    for label, _, _, _, deq, x in _cases():
        a, v = got["avx2"][label], got["avxvnni"][label]
        assert a.view(np.uint32).tolist() == v.view(np.uint32).tolist(), f"{label}: avx2 and avxvnni differ"
        err = rel_err(v, x.astype(np.float64) @ deq.T.astype(np.float64))
        assert err < (1e-6 if "min" in label else 3e-2 if "AMXInt8" in label else 2e-2), f"{label}: rel err {err:.3g}"
