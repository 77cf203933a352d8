"""One row per ggml type: the dequantizer, the quantizer and the converter read a type's block
functions, whether it can be written and its fallback from its row in ``weights/ggml_types.py``,
and keep no per-type tables of their own."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ktransformers.convert import TypePolicy, fit_type
from ktransformers.errors import ConfigError
from ktransformers.weights import ggml_types as gt
from ktransformers.weights.dequant import block_dequantizer, dequantize
from ktransformers.weights.quantize import QUANTIZABLE, quantize

ROOT = Path(__file__).resolve().parents[2]


def _replace_row(monkeypatch, name: str, **changes) -> gt.GGMLType:
    """Swap a type's row (looked up by name and by id) for one with ``changes``."""
    row = dataclasses.replace(gt.BY_NAME[name], **changes)
    monkeypatch.setitem(gt.BY_NAME, name, row)
    monkeypatch.setitem(gt.TYPES, row.id, row)
    return row


def test_a_row_holds_its_type_codecs():
    q4k = gt.ggml_type_info("Q4_K")
    assert (q4k.block_elems, q4k.block_bytes, q4k.fallback, q4k.writable) == (256, 144, "Q5_0", True)
    assert callable(q4k.dequant) and callable(q4k.quantize_ref)
    assert gt.ggml_type_info("I32").torch_dtype == "int32"
    assert gt.ggml_type_info("IQ2_XS").writable is False


def test_the_dequantizer_takes_the_block_function_from_the_row(monkeypatch):
    calls = []

    def spy(blocks):
        calls.append(blocks.shape)
        return torch.full((blocks.shape[0], 32), 7.0)

    _replace_row(monkeypatch, "Q8_0", dequant=spy)
    assert block_dequantizer("Q8_0") is spy
    out = dequantize(np.zeros(3 * 34, dtype=np.uint8), "Q8_0")
    assert calls == [(3, 34)] and out.shape == (96,) and bool((out == 7).all())


def test_the_quantizer_takes_the_reference_from_the_row(monkeypatch):
    def spy(flat, chunk_elems):
        return np.full(flat.size // 256 * 110, 5, dtype=np.uint8)

    _replace_row(monkeypatch, "Q3_K", quantize_ref=spy)
    out = quantize(np.ones((2, 256), dtype=np.float32), "Q3_K", native=False)
    assert out.size == 2 * 110 and bool((out == 5).all())


def test_the_converter_takes_the_fallback_from_the_row(monkeypatch):
    assert fit_type("Q2_K", 64) == "Q4_0"
    _replace_row(monkeypatch, "Q2_K", fallback="Q8_0")
    assert fit_type("Q2_K", 64) == "Q8_0"
    assert fit_type("Q2_K", 48) == "F16"  # the fallback's block does not fit either


def test_writable_types_are_the_rows_that_say_so():
    assert set(QUANTIZABLE) == {t.name for t in gt.TYPES.values() if t.writable}
    with pytest.raises(ConfigError, match=r"--experts: cannot write ggml type 'IQ2_XS' \(choose from .*Q4_K"):
        TypePolicy(experts="IQ2_XS")


def test_every_writable_type_round_trips_through_its_row():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    for t in gt.TYPES.values():
        if not t.writable or t.quantize_ref is None:
            continue
        q = quantize(x, t.name, native=False)
        assert q.size == t.nbytes(x.shape), t.name
        y = dequantize(q, t.name, shape=x.shape)
        rel = float((y - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt())
        assert rel < max(2.0 ** (2 - t.bits_per_weight), 0.005), (t.name, rel)  # error halves a bit


def test_a_plain_element_type_asked_for_as_itself_is_exact():
    v = np.array([2**24 + 1, -(2**31), 2**31 - 1, 3], dtype=np.int32)
    out = dequantize(v.view(np.uint8), "I32", dtype=torch.int32)
    assert out.dtype == torch.int32 and out.tolist() == v.tolist()


def test_a_fallback_the_converter_cannot_write_is_refused_at_import(monkeypatch):
    monkeypatch.setitem(gt._CODECS, "Q4_K", {**gt._CODECS["Q4_K"], "fallback": "IQ2_XS"})
    with pytest.raises(ImportError, match=r"Q4_K's fallback 'IQ2_XS' is not a type the converter writes"):
        gt._build()


def test_a_row_for_a_type_gguf_py_does_not_know_is_refused_at_import(monkeypatch):
    monkeypatch.setitem(gt._CODECS, "Q9_Z", {"writable": True})
    with pytest.raises(ImportError, match=r"rows \['Q9_Z'\] name no type gguf-py knows"):
        gt._build()


def test_the_type_table_imports_without_torch():
    code = ("import sys; import ktransformers.weights.ggml_types as g, ktransformers.weights.quantize; "
            "g.ggml_type_info('Q4_K').dequant; sys.exit('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_converter_is_a_package_of_steps():
    import ktransformers.convert as kc
    from ktransformers.convert import checkpoint, cli, light, metadata, pipeline, policy, tensor_plan, writer

    assert kc.convert is pipeline.convert and kc.main is cli.main and kc.write_gguf is writer.write_gguf
    assert kc.plan is tensor_plan.plan and kc.metadata_for is metadata.metadata_for
    assert kc.TypePolicy is policy.TypePolicy and kc.Checkpoint is checkpoint.Checkpoint
    assert kc.LIGHT_MODEL_TYPES is light.LIGHT_MODEL_TYPES
    assert all(hasattr(kc, n) for n in kc.__all__)
    r = subprocess.run([sys.executable, "-W", "error", "-m", "ktransformers.convert", "--help"],
                       capture_output=True, text=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert "Hugging Face safetensors model -> GGUF file" in r.stdout and "--preset" in r.stdout
