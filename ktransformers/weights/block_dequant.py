"""The torch block dequantizers, one a ggml type; :mod:`.ggml_types` puts each in its type's row.

Every ``dequant_*`` function takes ``blocks``, a ``uint8`` tensor ``[n_blocks, block_bytes]`` on any
device, and returns ``float32`` ``[n_blocks, block_elems]``.  Each one mirrors gguf-py's numpy
reference (``gguf.quants``) operation for operation -- same products, same order -- so the results
are bit-identical to ``gguf.quants.dequantize`` (checked by ``tests/weights/test_dequant.py``).
torch is imported on first use: the type table that names these functions is read without it.
"""

from __future__ import annotations

import numpy as np

from .lazy_torch import lazy_torch

torch = lazy_torch(globals())

QK_K = 256

#: IQ4_NL / IQ4_XS non-linear code book (llama.cpp ``kvalues_iq4nl``)
IQ4NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

#: MXFP4 e2m1 code book, doubled (llama.cpp ``kvalues_mxfp4``; the block scale is halved to match)
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)

_CONST_CACHE: dict[tuple, torch.Tensor] = {}


def _const(values, dtype: torch.dtype, device: torch.device, shape) -> torch.Tensor:
    key = (tuple(values), dtype, str(device), tuple(shape))
    t = _CONST_CACHE.get(key)
    if t is None:
        t = torch.tensor(values, dtype=dtype, device=device).reshape(shape)
        _CONST_CACHE[key] = t
    return t


def _f16(blocks: torch.Tensor, off: int) -> torch.Tensor:
    """fp16 scalar at byte ``off`` of every block, as float32 ``[n, 1]``."""
    return blocks[:, off : off + 2].contiguous().view(torch.float16).to(torch.float32)


def _shr(x: torch.Tensor, shifts, shape) -> torch.Tensor:
    return x >> _const(shifts, x.dtype, x.device, shape)


# ---------------------------------------------------------------------------------------- plain


def dequant_plain(torch_dtype: str):
    """The block function of a plain element type stored as ``torch_dtype`` (``"int32"``, ...)."""

    def fn(blocks: torch.Tensor) -> torch.Tensor:
        return blocks.contiguous().view(getattr(torch, torch_dtype)).to(torch.float32)

    return fn


def dequant_bf16(blocks: torch.Tensor) -> torch.Tensor:
    """bfloat16 is the top half of a float32."""
    return (blocks.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


# ------------------------------------------------------------------------------ 32-element types


def _nibbles32(qs: torch.Tensor) -> torch.Tensor:
    """16 packed bytes -> 32 values: low nibbles are elements 0..15, high nibbles 16..31."""
    n = qs.shape[0]
    return (_shr(qs.reshape(n, 1, 16), (0, 4), (1, 2, 1)) & 0x0F).reshape(n, 32)


def _bits32(qh4: torch.Tensor) -> torch.Tensor:
    """4 bytes read as a little-endian uint32 -> its 32 bits (bit j = element j)."""
    n = qh4.shape[0]
    return (_shr(qh4.reshape(n, 4, 1), tuple(range(8)), (1, 1, 8)) & 1).reshape(n, 32)


def dequant_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles32(blocks[:, 2:]).to(torch.int8) - 8
    return d * q.to(torch.float32)


def dequant_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    m = _f16(blocks, 2)
    q = _nibbles32(blocks[:, 4:]).to(torch.float32)
    return d * q + m


def dequant_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    qh = _bits32(blocks[:, 2:6])
    ql = _nibbles32(blocks[:, 6:])
    q = (ql | (qh << 4)).to(torch.int8) - 16
    return d * q.to(torch.float32)


def dequant_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    m = _f16(blocks, 2)
    qh = _bits32(blocks[:, 4:8])
    ql = _nibbles32(blocks[:, 8:])
    q = (ql | (qh << 4)).to(torch.float32)
    return d * q + m


def dequant_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    x = blocks[:, 2:].contiguous().view(torch.int8).to(torch.float32)
    return x * d


def dequant_iq4_nl(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    idx = _nibbles32(blocks[:, 2:]).to(torch.int64)
    kv = _const(IQ4NL_VALUES, torch.float32, blocks.device, (16,))
    return d * kv[idx]


def dequant_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """E8M0 exponent byte + 16 nibble bytes; ``d = 2^(e - 128)`` as ggml_e8m0_to_fp32_half (subnormal below 2)."""
    e = blocks[:, :1].to(torch.int32)
    bits = torch.where(e < 2, torch.tensor(0x00200000, dtype=torch.int32, device=e.device) << e, (e - 1) << 23)
    d = bits.view(torch.float32)
    idx = _nibbles32(blocks[:, 1:17]).to(torch.int64)
    kv = _const(MXFP4_VALUES, torch.float32, blocks.device, (16,))
    return d * kv[idx]


# ------------------------------------------------------------------------------------- K-quants


def dequant_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales = blocks[:, 0:16]
    qs = blocks[:, 16:80]
    d = _f16(blocks, 80)
    dmin = _f16(blocks, 82)
    dl = (d * (scales & 0xF).to(torch.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = _shr(qs.reshape(n, 2, 1, 32), (0, 2, 4, 6), (1, 1, 4, 1)) & 3
    q = q.reshape(n, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(n, QK_K)


def dequant_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    hmask = blocks[:, 0:32]
    qs = blocks[:, 32:96]
    scales = blocks[:, 96:108]
    d = _f16(blocks, 108)
    ls = _shr(scales[:, :8].reshape(n, 1, 8), (0, 4), (1, 2, 1)).reshape(n, 16)
    hs = _shr(scales[:, 8:].reshape(n, 1, 4), (0, 2, 4, 6), (1, 4, 1)).reshape(n, 16)
    sc = ((ls & 0x0F) | ((hs & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * sc.to(torch.float32)).reshape(n, 16, 1)
    ql = _shr(qs.reshape(n, 2, 1, 32), (0, 2, 4, 6), (1, 1, 4, 1)).reshape(n, 16, 16) & 3
    qh = _shr(hmask.reshape(n, 1, 1, 32), tuple(range(8)), (1, 1, 8, 1)).reshape(n, 16, 16) & 1
    qh = qh ^ 1
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).to(torch.float32)
    return (dl * q).reshape(n, QK_K)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte 6-bit scale/min block of Q4_K / Q5_K -> (sc [n, 8], min [n, 8])."""
    d_ = scales[:, 0:4]
    m_ = scales[:, 4:8]
    md = scales[:, 8:12]
    sc = torch.cat([d_ & 0x3F, (md & 0x0F) | ((d_ >> 2) & 0x30)], dim=1)
    mn = torch.cat([m_ & 0x3F, (md >> 4) | ((m_ >> 2) & 0x30)], dim=1)
    return sc, mn


def dequant_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    dd = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    dm = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    q = _shr(blocks[:, 16:].reshape(n, 4, 1, 32), (0, 4), (1, 1, 2, 1)) & 0x0F
    q = q.reshape(n, 8, 32).to(torch.float32)
    return (dd * q - dm).reshape(n, QK_K)


def dequant_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    dmin = _f16(blocks, 2)
    sc, mn = _scale_min_k4(blocks[:, 4:16])
    qh = blocks[:, 16:48]
    qs = blocks[:, 48:176]
    dd = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    dm = (dmin * mn.to(torch.float32)).reshape(n, 8, 1)
    ql = (_shr(qs.reshape(n, 4, 1, 32), (0, 4), (1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
    qhb = (_shr(qh.reshape(n, 1, 1, 32), tuple(range(8)), (1, 1, 8, 1)) & 1).reshape(n, 8, 32)
    q = (ql | (qhb << 4)).to(torch.float32)
    return (dd * q - dm).reshape(n, QK_K)


def dequant_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = blocks[:, 0:128]
    qh = blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).to(torch.float32)
    d = _f16(blocks, 208)
    dd = (d * scales).reshape(n, 16, 1)
    lo = (_shr(ql.reshape(n, 2, 1, 64), (0, 4), (1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32)
    hi = (_shr(qh.reshape(n, 2, 1, 32), (0, 2, 4, 6), (1, 1, 4, 1)) & 0x03).reshape(n, 8, 32)
    q = ((lo | (hi << 4)).to(torch.int8) - 32).reshape(n, 16, 16).to(torch.float32)
    return (dd * q).reshape(n, QK_K)


def dequant_iq4_xs(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    sh = blocks[:, 2:4].to(torch.int32)
    sh = sh[:, 0:1] | (sh[:, 1:2] << 8)  # little-endian uint16
    sl = blocks[:, 4:8]
    qs = blocks[:, 8:136]
    lo = (_shr(sl.reshape(n, 4, 1), (0, 4), (1, 1, 2)) & 0x0F).reshape(n, 8)
    hi = (_shr(sh.reshape(n, 1), tuple(range(0, 16, 2)), (1, 8)) & 0x03).to(torch.uint8)
    sc = (lo | (hi << 4)).to(torch.int8) - 32
    dl = (d * sc.to(torch.float32)).reshape(n, 8, 1)
    idx = (_shr(qs.reshape(n, 8, 1, 16), (0, 4), (1, 1, 2, 1)) & 0x0F).reshape(n, 8, 32).to(torch.int64)
    kv = _const(IQ4NL_VALUES, torch.float32, blocks.device, (16,))
    return (dl * kv[idx]).reshape(n, QK_K)


# ------------------------------------------------------------------------ low-bit IQ (grid) types
# Weights are indices into llama.cpp's E8-lattice code books (8 or 4 values per index) with
# separate sign bits.  The code books are gguf-py's (decoded from its tables at first use), so
# the values cannot drift from the reference.

_IQ_TABLES: dict[tuple, torch.Tensor] = {}


def iq_grid(name: str) -> np.ndarray:
    """gguf-py's code book of IQ type ``name`` as float32 ``[entries, values per entry]``."""
    import gguf.quants

    cls = getattr(gguf.quants, name)
    cls.init_grid()
    return np.asarray(cls.grid, dtype=np.float32).reshape(cls.grid_shape)


def iq_ksigns() -> np.ndarray:
    """gguf-py's ``ksigns`` table: 7 stored sign bits -> 8 sign bits (even parity)."""
    import gguf.quants

    return np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8).copy()


def _iq_table(name: str, device: torch.device) -> torch.Tensor:
    key = (name, str(device))
    t = _IQ_TABLES.get(key)
    if t is None:
        arr = iq_ksigns().astype(np.int64) if name == "ksigns" else iq_grid(name)
        t = torch.from_numpy(arr).to(device)
        _IQ_TABLES[key] = t
    return t


def _uint_le(x: torch.Tensor, width: int) -> torch.Tensor:
    """Little-endian ``width``-byte unsigned fields of ``x`` (uint8 ``[n, width*k]``) as int64 ``[n, k]``
    (assembled from the bytes: a slice of a chunk need not be aligned for a dtype view)."""
    b = x.to(torch.int64).reshape(x.shape[0], -1, width)
    v = b[..., 0]
    for j in range(1, width):
        v = v | (b[..., j] << (8 * j))
    return v


def _u16(x: torch.Tensor) -> torch.Tensor:
    return _uint_le(x, 2)


def _u32(x: torch.Tensor) -> torch.Tensor:
    return _uint_le(x, 4)


def _sign_bits(s: torch.Tensor) -> torch.Tensor:
    """Sign bytes -> float32 +-1 per bit (bit j set: element j negative), a new last dim of 8."""
    bits = _shr(s.to(torch.int64).unsqueeze(-1), tuple(range(8)), (1,) * s.dim() + (8,)) & 1
    return torch.where(bits == 0, 1.0, -1.0).to(torch.float32)


def _ksigns(idx: torch.Tensor) -> torch.Tensor:
    """7-bit sign indices -> float32 +-1 ``[..., 8]`` through ``ksigns``."""
    return _sign_bits(_iq_table("ksigns", idx.device)[idx])


def _nibble_pairs(x: torch.Tensor) -> torch.Tensor:
    """Bytes ``[n, k]`` -> their low and high nibbles ``[n, 2k]`` (low first)."""
    n = x.shape[0]
    return (_shr(x.to(torch.int64).reshape(n, -1, 1), (0, 4), (1, 1, 2)) & 0x0F).reshape(n, -1)


def dequant_iq2_xxs(blocks: torch.Tensor) -> torch.Tensor:
    """d | 8 x (4 grid bytes, uint32 of 4 x 7 sign bits + 4-bit scale)."""
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    qs = _u32(blocks[:, 2:66]).reshape(n, 8, 2)
    db = (d * (0.5 + (qs[..., 1] >> 28).to(torch.float32)) * 0.25).reshape(n, 8, 1, 1)
    signs = _ksigns(_shr(qs[..., 1:2], (0, 7, 14, 21), (1, 1, 4)) & 0x7F)
    grid = _iq_table("IQ2_XXS", blocks.device)[blocks[:, 2:66].reshape(n, 8, 8)[..., :4].to(torch.int64)]
    return (db * grid * signs).reshape(n, QK_K)


def _iq2_scales(sc: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """IQ2_XS / IQ2_S: 8 bytes of two 4-bit scales -> d * (0.5 + s) * 0.25 per 16 elements ``[n, 16, 1, 1]``."""
    n = sc.shape[0]
    return (d * (0.5 + _nibble_pairs(sc).to(torch.float32)) * 0.25).reshape(n, 16, 1, 1)


def dequant_iq2_xs(blocks: torch.Tensor) -> torch.Tensor:
    """d | 32 x uint16 (9-bit grid index, 7 sign bits) | 8 scale bytes."""
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    qs = _u16(blocks[:, 2:66])
    db = _iq2_scales(blocks[:, 66:74], d)
    signs = _ksigns(qs >> 9).reshape(n, 16, 2, 8)
    grid = _iq_table("IQ2_XS", blocks.device)[qs & 511].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def dequant_iq2_s(blocks: torch.Tensor) -> torch.Tensor:
    """d | 32 grid low bytes | 32 sign bytes | 8 qh (2 high index bits each) | 8 scale bytes."""
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    db = _iq2_scales(blocks[:, 74:82], d)
    signs = _sign_bits(blocks[:, 34:66]).reshape(n, 16, 2, 8)
    qh = (_shr(blocks[:, 66:74].to(torch.int64).reshape(n, 8, 1), (0, 2, 4, 6), (1, 1, 4)) & 3).reshape(n, 32)
    idx = blocks[:, 2:34].to(torch.int64) | (qh << 8)
    grid = _iq_table("IQ2_S", blocks.device)[idx].reshape(n, 16, 2, 8)
    return (db * grid * signs).reshape(n, QK_K)


def dequant_iq3_xxs(blocks: torch.Tensor) -> torch.Tensor:
    """d | 64 grid bytes (4 values each) | 8 x uint32 (4 x 7 sign bits + 4-bit scale)."""
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    sc = _u32(blocks[:, 66:98])
    db = (d * (0.5 + (sc >> 28).to(torch.float32)) * 0.5).reshape(n, 8, 1, 1)
    signs = _ksigns(_shr(sc.unsqueeze(-1), (0, 7, 14, 21), (1, 1, 4)) & 0x7F)
    grid = _iq_table("IQ3_XXS", blocks.device)[blocks[:, 2:66].to(torch.int64)].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


def dequant_iq3_s(blocks: torch.Tensor) -> torch.Tensor:
    """d | 64 grid low bytes | 8 qh (1 high index bit each) | 32 sign bytes | 4 scale bytes."""
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    db = (d * (1 + 2 * _nibble_pairs(blocks[:, 106:110])).to(torch.float32)).reshape(n, 8, 1, 1)
    signs = _sign_bits(blocks[:, 74:106]).reshape(n, 8, 4, 8)
    qh = (_shr(blocks[:, 66:74].to(torch.int64).reshape(n, 8, 1), tuple(range(8)), (1, 1, 8)) & 1).reshape(n, 64)
    idx = blocks[:, 2:66].to(torch.int64) | (qh << 8)
    grid = _iq_table("IQ3_S", blocks.device)[idx].reshape(n, 8, 4, 8)
    return (db * grid * signs).reshape(n, QK_K)


#: IQ1_S / IQ1_M: the shift of every code book value (llama.cpp ``IQ1S_DELTA``), sign from a bit
IQ1_DELTA = 0.125


def dequant_iq1_s(blocks: torch.Tensor) -> torch.Tensor:
    """d | 32 grid low bytes | 8 x uint16 (4 x 3 high index bits, 3-bit scale, delta sign)."""
    n = blocks.shape[0]
    d = _f16(blocks, 0)
    qh = _u16(blocks[:, 34:50])
    dl = (d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)).reshape(n, 8, 1, 1)
    delta = torch.where((qh & 0x8000) == 0, IQ1_DELTA, -IQ1_DELTA).to(torch.float32).reshape(n, 8, 1, 1)
    hi = _shr(qh.unsqueeze(-1), (0, 3, 6, 9), (1, 1, 4)) & 7
    idx = blocks[:, 2:34].to(torch.int64).reshape(n, 8, 4) | (hi << 8)
    grid = _iq_table("IQ1_S", blocks.device)[idx]
    return (dl * (grid + delta)).reshape(n, QK_K)


def dequant_iq1_m(blocks: torch.Tensor) -> torch.Tensor:
    """32 grid low bytes | 16 qh (per 8: 3 high index bits + delta sign) | 4 x uint16 (3-bit
    scales per 16 elements; the fp16 block scale in their top nibbles)."""
    n = blocks.shape[0]
    sc = _u16(blocks[:, 48:56])
    dbits = _shr(sc & 0xF000, (12, 8, 4, 0), (1, 4))
    dbits = dbits[:, 0] | dbits[:, 1] | dbits[:, 2] | dbits[:, 3]
    d = torch.where(dbits >= 0x8000, dbits - 0x10000, dbits).to(torch.int16).view(torch.float16).to(torch.float32)
    s = (_shr(sc.reshape(n, 4, 1), (0, 3, 6, 9), (1, 1, 4)) & 7).reshape(n, 16)
    dl = (d.reshape(n, 1) * (2 * s + 1).to(torch.float32)).reshape(n, 8, 2, 1, 1)
    qh = _nibble_pairs(blocks[:, 32:48])
    idx = blocks[:, 0:32].to(torch.int64) | ((qh & 7) << 8)
    delta = torch.where((qh & 8) == 0, IQ1_DELTA, -IQ1_DELTA).to(torch.float32).reshape(n, 8, 2, 2, 1)
    grid = _iq_table("IQ1_S", blocks.device)[idx].reshape(n, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(n, QK_K)
