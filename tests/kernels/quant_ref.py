"""Test-only helpers: ggml-exact weight bytes for every supported type plus their dequantised
float32 values, produced by gguf-py (``gguf.quants``).

gguf 0.19 can *quantize* F32/F16/BF16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/MXFP4 only; for the K-quants and IQ4_*
we write random but valid block bytes (random nibbles/scales, finite positive f16 super-block
scales at the right offsets) and let ``gguf.quants.dequantize`` define the reference values.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGML_QUANT_SIZES
from gguf import quants

GGUF_QUANTIZABLE = {QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.MXFP4}
# byte offsets of the float16 super-block scales (d, dmin) inside one block
F16_FIELDS = {
    QT.Q2_K: (80, 82),
    QT.Q3_K: (108,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
    QT.IQ4_NL: (0,),
    QT.IQ4_XS: (0,),
}
ALL_TYPES = [QT.F32, QT.F16, QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K,
             QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS, QT.MXFP4]


def block_elems(t: QT) -> int:
    return GGML_QUANT_SIZES[t][0]


def make_weights(t: QT, shape: tuple[int, ...], rng: np.random.Generator, scale: float = 0.05):
    """Return (raw uint8 array of shape[:-1] + (row_bytes,), dequantised float32 array of `shape`)."""
    t = QT(t)
    *lead, cols = shape
    be, bb = GGML_QUANT_SIZES[t]
    assert cols % be == 0, (t.name, cols)
    if t in GGUF_QUANTIZABLE:
        w = (rng.standard_normal(shape) * scale).astype(np.float32)
        raw = quants.quantize(w, t)
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(*lead, -1)
    else:
        nblocks = int(np.prod(shape)) // be
        raw = rng.integers(0, 256, size=(nblocks, bb), dtype=np.uint8)
        for off in F16_FIELDS[t]:
            d = (rng.uniform(0.5, 1.5, size=nblocks) * scale / 40).astype(np.float16)
            raw[:, off:off + 2] = d.view(np.uint8).reshape(nblocks, 2)
        if t == QT.Q6_K:  # int8 sub-block scales: keep them moderate
            raw[:, 192:208] = rng.integers(-40, 40, size=(nblocks, 16)).astype(np.int8).view(np.uint8)
        # Unsigned K-quants: make each sub-block's min equal its scale and dmin = centre * d, so
        # values are roughly zero-mean like real weights (random mins give a large common bias).
        if t in (QT.Q4_K, QT.Q5_K):
            # scales[12] live at bytes 4..15 (after the f16 d, dmin)
            raw[:, 12:16] = (raw[:, 12:16] & 0x0F) * 17  # low nibble (scale) == high nibble (min)
            raw[:, 8:12] = raw[:, 4:8]
            d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)
            centre = 7.5 if t == QT.Q4_K else 15.5
            raw[:, 2:4] = (d * centre).astype(np.float16).view(np.uint8).reshape(nblocks, 2)
        if t == QT.Q2_K:
            raw[:, 0:16] = (raw[:, 0:16] & 0x0F) * 17
            d = raw[:, 80:82].copy().view(np.float16).astype(np.float32)
            raw[:, 82:84] = (d * 1.5).astype(np.float16).view(np.uint8).reshape(nblocks, 2)
        raw = raw.reshape(*lead, -1)
    deq = quants.dequantize(raw, t).astype(np.float32).reshape(shape)
    return np.ascontiguousarray(raw), deq
