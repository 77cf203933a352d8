"""Quantize float tensors to ggml bytes: the C++ row quantizer where the build has it for the type,
else the type row's reference quantizer (:mod:`.block_quant`), else gguf-py's (which quantizes
Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/MXFP4 bit-exactly like ggml's reference code).

torch is not imported here: the converter's C++ and gguf-py paths run without it.
"""

from __future__ import annotations

import numpy as np

from .ggml_types import TYPES, ggml_type_info

#: types :func:`quantize` can produce (the rows the converter writes)
QUANTIZABLE = tuple(t.name for t in TYPES.values() if t.writable)

#: rows quantized per step (bounds the float32 temporaries of the searches)
CHUNK_ELEMS = 1 << 18


def native_quantizer():
    """The C++ row quantizer (Q4_K/Q5_K/Q6_K on all cores), or None in a build without it."""
    global _NATIVE
    if _NATIVE is False:
        try:
            from .. import cpuinfer_ext as ext

            _NATIVE = ext if hasattr(ext, "quantize_rows") else None
        except ImportError:
            _NATIVE = None
    return _NATIVE


_NATIVE = False


def quantize_threads() -> int:
    """Threads of the C++ quantizer: ``KT_QUANT_THREADS``, else the CPUs this process may use."""
    import os

    env = os.environ.get("KT_QUANT_THREADS")
    if env:
        return max(1, int(env))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def quantize(x, ggml_type, chunk_elems: int = CHUNK_ELEMS, native: bool = True) -> np.ndarray:
    """Quantize a float tensor/array (last dim = rows, a multiple of the block size) to ggml bytes.

    Returns a flat ``uint8`` numpy array of ``rows * row_bytes`` bytes (the GGUF tensor data).
    Q4_K/Q5_K/Q6_K run in C++ on all cores when the extension has the quantizer (``native=False``:
    the row's torch reference, which the C++ code is tested against, ``chunk_elems`` values a step);
    IQ4_NL / IQ4_XS exist in C++ only.
    """
    info = ggml_type_info(ggml_type)
    if isinstance(x, np.ndarray):
        a = np.ascontiguousarray(x, dtype=np.float32)
    else:  # a torch tensor
        a = x.detach().float().contiguous().cpu().numpy()
    if a.ndim == 0:
        a = a.reshape(1)
    n = a.shape[-1]
    if n % info.block_elems:
        raise ValueError(f"rows of {n} values are not a multiple of the {info.name} block ({info.block_elems})")
    flat = a.reshape(-1)
    ext = native_quantizer() if native else None
    if ext is not None and ext.quantize_rows_supported(info.id):
        out = np.empty(flat.size // info.block_elems * info.block_bytes, dtype=np.uint8)
        ext.quantize_rows(info.id, flat.ctypes.data, flat.size // n, n, out.ctypes.data, quantize_threads())
        return out
    if info.quantize_ref is not None:
        return info.quantize_ref(flat, chunk_elems)
    import gguf

    try:
        return np.ascontiguousarray(gguf.quants.quantize(flat.reshape(-1, n), info.qtype)).reshape(-1).view(np.uint8)
    except NotImplementedError as e:
        raise NotImplementedError(f"cannot quantize to {info.name} without the C++ extension's quantizer "
                                  f"(build it: python setup.py build_ext --inplace)") from e
