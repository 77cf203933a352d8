"""ggml type helpers backed by the C++ kernels (reference dequantization for tests)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import cpuinfer_ext as _ext
from .args import _desc, _nbytes, ggml_type


def type_info(t: Any) -> tuple[str, int, int, bool]:
    return _ext.type_info(ggml_type(t).id)


def row_bytes(t: Any, cols: int) -> int:
    return _ext.row_bytes(ggml_type(t).id, int(cols))


def dequantize(raw: Any, t: Any, n: int | None = None) -> np.ndarray:
    """float32 values of the first n elements stored in raw (ggml type t), via the C++ kernels."""
    t = ggml_type(t)
    ptr, _, _ = _desc(raw, "raw")
    be, bb = t.block_elems, t.block_bytes
    n = _nbytes(raw) // bb * be if n is None else int(n)
    if n % be or n // be * bb > _nbytes(raw):
        raise ValueError(f"n: {n} elements do not fit whole {t.name} blocks in {_nbytes(raw)} bytes")
    out = np.empty(n, np.float32)
    _ext.dequantize(t.id, ptr, n, out.ctypes.data)
    return out


def activation_format(t: Any) -> str:
    """The activation row format the tier in force feeds the llamafile kernel of weight type ``t``
    (``"f32"``, ``"bf16"``, ``"q8_32"``, ``"q8_256"``): what rounds the inputs, so what bounds the
    error against an fp32 reference (bf16: 2^-9 relative per element; q8: per-block int8)."""
    return _ext.kernel_rows()[ggml_type(t).name][2]
