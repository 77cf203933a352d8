"""Our reference quantizers (vectorized torch, float32), one a ggml type; :mod:`.ggml_types` puts
each in its type's row.

gguf-py 0.19 quantizes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/MXFP4 bit-exactly like ggml's reference code, so
those rows have none here and :func:`..quantize.quantize` delegates to gguf-py.  For the K-quants
it raises NotImplementedError; this module implements llama.cpp's *non-imatrix* reference
algorithms (``quantize_row_q{2,3,4,5,6}_K_ref`` with ``make_qkx2_quants`` / ``make_qx_quants`` /
``make_q3_quants``), vectorized over blocks:

* Q4_K / Q5_K: per 32-value sub-block a weighted (``sqrt(mean x^2) + |x|``) least-squares search of
  scale and min over 21 / 16 candidate grids, then 6-bit scales/mins relative to the block maxima.
* Q6_K: per 16-value sub-block an ``x^2``-weighted search of the scale over 19 grids, 8-bit scales.
* Q3_K: per 16-value sub-block ``make_q3_quants`` (x^2-weighted, 5 rounds of coordinate descent).
* Q2_K: per 16-value sub-block ``make_qkx2_quants`` with absolute-error weights ``|x|``.

Rounding is round-half-to-even like ggml's ``nearest_int``, fp16 conversion round-to-nearest-even,
so results are usually byte-identical to llama-quantize's (sums are accumulated in a different
order, which can flip a near-tie); the tests check the RMS error against llama.cpp's own bytes.

Every ``quantize_*`` function takes float32 values (a flat contiguous numpy array of whole rows)
and the values to quantize per step, and returns the ggml bytes (flat ``uint8`` numpy).  torch is
imported on first use: the converter's C++ and gguf-py paths run without it, so a conversion does
not pay torch's import time.
"""

from __future__ import annotations

import numpy as np

from .lazy_torch import lazy_torch

torch = lazy_torch(globals())

QK_K = 256
GROUP_MAX_EPS = 1e-15

def _fp16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 bytes [N, 2] uint8, the fp16 value back as float32)."""
    h = x.to(torch.float16)
    return h.reshape(-1, 1).view(torch.uint8), h.to(torch.float32)


def _round(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)  # half to even, like ggml's nearest_int


def _make_qkx2(x, w, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool):
    """Vectorized ``make_qkx2_quants``: rows of x [N, n] -> (scale [N], min [N]) with min >= 0
    meaning dequant = scale * q - min."""
    mn = x.amin(1, keepdim=True).clamp(max=0)
    mx = x.amax(1, keepdim=True)
    sum_w = w.sum(1, keepdim=True)
    sum_x = (w * x).sum(1, keepdim=True)
    rng = mx - mn
    flat = rng == 0
    rng = torch.where(flat, torch.ones_like(rng), rng)

    def err(scale, m, L):
        d = scale * L + m - x
        d = d.abs() if use_mad else d * d
        return (w * d).sum(1, keepdim=True)

    iscale = nmax / rng
    scale = 1 / iscale
    L = _round(iscale * (x - mn)).clamp(0, nmax)
    best = err(scale, mn, L)
    bmin = mn
    for s in range(nstep + 1):
        isc = (rmin + rdelta * s + nmax) / rng
        La = _round(isc * (x - mn)).clamp(0, nmax)
        wl = w * La
        sum_l = wl.sum(1, keepdim=True)
        sum_l2 = (wl * La).sum(1, keepdim=True)
        sum_xl = (wl * x).sum(1, keepdim=True)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = torch.where(ok, D, torch.ones_like(D))
        ts = (sum_w * sum_xl - sum_x * sum_l) / Ds
        tm = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        pos = tm > 0
        l2s = torch.where(sum_l2 > 0, sum_l2, torch.ones_like(sum_l2))
        ts = torch.where(pos, sum_xl / l2s, ts)
        tm = torch.where(pos, torch.zeros_like(tm), tm)
        cur = err(ts, tm, La)
        upd = ok & (cur < best)
        best = torch.where(upd, cur, best)
        scale = torch.where(upd, ts, scale)
        bmin = torch.where(upd, tm, bmin)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return scale.reshape(-1), (-bmin).reshape(-1)


def _make_qx(x, nmax: int):
    """Vectorized ``make_qx_quants(n, nmax, x, L, rmse_type=1, NULL)`` -> scale [N] (signed)."""
    idx = x.abs().argmax(1, keepdim=True)
    mx = torch.gather(x, 1, idx)
    tiny = mx.abs() < GROUP_MAX_EPS
    mx = torch.where(tiny, torch.ones_like(mx), mx)
    w = x * x

    def sums(iscale):
        L = _round(iscale * x).clamp(-nmax, nmax - 1)
        wl = w * L
        return (wl * x).sum(1, keepdim=True), (wl * L).sum(1, keepdim=True)

    sumlx, suml2 = sums(-nmax / mx)
    scale = torch.where(suml2 > 0, sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2)), torch.zeros_like(sumlx))
    best = scale * sumlx
    for s in range(-9, 10):
        if s == 0:
            continue
        slx, sl2 = sums(-(nmax + 0.1 * s) / mx)
        upd = (sl2 > 0) & (slx * slx > best * sl2)
        new_scale = slx / torch.where(sl2 > 0, sl2, torch.ones_like(sl2))
        scale = torch.where(upd, new_scale, scale)
        best = torch.where(upd, new_scale * slx, best)
    return torch.where(tiny, torch.zeros_like(scale), scale).reshape(-1)


def _make_q3(x, nmax: int = 4):
    """Vectorized ``make_q3_quants(n, nmax, x, L, do_rmse=true)`` -> scale [N]."""
    idx = x.abs().argmax(1, keepdim=True)
    mx = torch.gather(x, 1, idx)
    tiny = mx.abs() < GROUP_MAX_EPS
    mx = torch.where(tiny, torch.ones_like(mx), mx)
    w = x * x
    L = _round((-nmax / mx) * x).clamp(-nmax, nmax - 1)
    sumlx = (w * x * L).sum(1)
    suml2 = (w * L * L).sum(1)
    n = x.shape[1]
    for _ in range(5):
        changed = torch.zeros_like(sumlx, dtype=torch.bool)
        for i in range(n):
            xi, wi, Li = x[:, i], w[:, i], L[:, i]
            slx = sumlx - wi * xi * Li
            sl2 = suml2 - wi * Li * Li
            okp = slx > 0
            new_l = _round(xi * sl2 / torch.where(okp, slx, torch.ones_like(slx))).clamp(-nmax, nmax - 1)
            slx2 = slx + wi * xi * new_l
            sl22 = sl2 + wi * new_l * new_l
            upd = okp & (new_l != Li) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
            L[:, i] = torch.where(upd, new_l, Li)
            sumlx = torch.where(upd, slx2, sumlx)
            suml2 = torch.where(upd, sl22, suml2)
            changed |= upd
        if not bool(changed.any()):
            break
    scale = sumlx / torch.where(suml2 > 0, suml2, torch.ones_like(suml2))
    return torch.where(tiny.reshape(-1), torch.zeros_like(scale), scale)


def _pack_scale_min_k4(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """6-bit scales/mins [nb, 8] -> the 12-byte Q4_K/Q5_K layout."""
    ls = ls.to(torch.int32)
    lm = lm.to(torch.int32)
    s = torch.zeros(ls.shape[0], 12, dtype=torch.int32, device=ls.device)
    s[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    s[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return s.to(torch.uint8)


def _q45_k(x: torch.Tensor, nmax: int, rmin: float, nstep: int):
    nb = x.shape[0]
    xs = x.reshape(nb, 8, 32)
    av_x = torch.sqrt((xs * xs).sum(-1, keepdim=True) / 32)
    w = av_x + xs.abs()
    scales, mins = _make_qkx2(xs.reshape(-1, 32), w.reshape(-1, 32), nmax, rmin, 0.1, nstep, False)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)
    max_scale = scales.amax(1, keepdim=True)
    max_min = mins.amax(1, keepdim=True)
    inv_scale = torch.where(max_scale > 0, 63 / torch.where(max_scale > 0, max_scale, 1), torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, 63 / torch.where(max_min > 0, max_min, 1), torch.zeros_like(max_min))
    ls = _round(inv_scale * scales).clamp(0, 63)
    lm = _round(inv_min * mins).clamp(0, 63)
    d_bytes, d = _fp16(max_scale / 63)
    m_bytes, dmin = _fp16(max_min / 63)
    dd = (d.reshape(nb, 1) * ls).reshape(nb, 8, 1)
    dm = (dmin.reshape(nb, 1) * lm).reshape(nb, 8, 1)
    L = _round((xs + dm) / torch.where(dd == 0, torch.ones_like(dd), dd)).clamp(0, nmax)
    L = torch.where(dd == 0, torch.zeros_like(L), L).to(torch.uint8).reshape(nb, 4, 2, 32)
    head = torch.cat([d_bytes.reshape(nb, 2), m_bytes.reshape(nb, 2), _pack_scale_min_k4(ls, lm)], dim=1)
    return head, L


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    head, L = _q45_k(x, 15, -1.0, 20)
    qs = (L[:, :, 0, :] | (L[:, :, 1, :] << 4)).reshape(-1, 128)
    return torch.cat([head, qs], dim=1)


def _q5_k(x: torch.Tensor) -> torch.Tensor:
    head, L = _q45_k(x, 31, -0.5, 15)
    nb = x.shape[0]
    lo = L & 0xF
    qs = (lo[:, :, 0, :] | (lo[:, :, 1, :] << 4)).reshape(nb, 128)
    hi = (L >> 4).to(torch.int32).reshape(nb, 8, 32)  # sub-block s -> bit s of qh
    shifts = torch.arange(8, dtype=torch.int32, device=x.device).reshape(1, 8, 1)
    qh = (hi << shifts).sum(1).to(torch.uint8)
    return torch.cat([head, qh, qs], dim=1)


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    xs = x.reshape(nb, 16, 16)
    scales = _make_qx(xs.reshape(-1, 16), 32).reshape(nb, 16)
    idx = scales.abs().argmax(1, keepdim=True)
    max_scale = torch.gather(scales, 1, idx)
    zero = max_scale.abs() < GROUP_MAX_EPS
    ms = torch.where(zero, torch.ones_like(max_scale), max_scale)
    iscale = -128.0 / ms
    d_bytes, d = _fp16(torch.where(zero, torch.zeros_like(ms), 1 / iscale))
    sc = _round(iscale * scales).clamp(-128, 127)
    sc = torch.where(zero, torch.zeros_like(sc), sc)
    dd = (d.reshape(nb, 1) * sc).reshape(nb, 16, 1)
    L = _round(xs / torch.where(dd == 0, torch.ones_like(dd), dd)).clamp(-32, 31) + 32
    L = torch.where(dd == 0, torch.full_like(L, 32), L).to(torch.uint8).reshape(nb, 2, 4, 32)
    ql = torch.cat(
        [(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4), (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], dim=2
    ).reshape(nb, 128)
    qh = ((L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6)).reshape(nb, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), d_bytes.reshape(nb, 2)], dim=1)


def _q3_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    xs = x.reshape(nb, 16, 16)
    scales = _make_q3(xs.reshape(-1, 16).clone(), 4).reshape(nb, 16)
    idx = scales.abs().argmax(1, keepdim=True)
    max_scale = torch.gather(scales, 1, idx)
    zero = max_scale == 0
    iscale = -32.0 / torch.where(zero, torch.ones_like(max_scale), max_scale)
    l = (_round(iscale * scales).clamp(-32, 31) + 32).to(torch.int32)
    l = torch.where(zero, torch.zeros_like(l), l)
    s = torch.zeros(nb, 12, dtype=torch.int32, device=x.device)
    s[:, 0:8] = (l[:, 0:8] & 0xF) | ((l[:, 8:16] & 0xF) << 4)
    hi = (l >> 4).reshape(nb, 4, 4)  # [j//4, j%4]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=x.device).reshape(1, 4, 1)
    s[:, 8:12] = (hi << shifts).sum(1)
    d_bytes, d = _fp16(torch.where(zero, torch.zeros_like(iscale), 1 / iscale))
    sc = (l - 32).to(torch.float32)
    sc = torch.where(zero, torch.zeros_like(sc), sc)
    dd = (d.reshape(nb, 1) * sc).reshape(nb, 16, 1)
    L = _round(xs / torch.where(dd == 0, torch.ones_like(dd), dd)).clamp(-4, 3) + 4
    L = torch.where(dd == 0, torch.full_like(L, 4), L).to(torch.int32).reshape(nb, 256)
    hbit = (L > 3).to(torch.int32).reshape(nb, 8, 32)  # element j -> hmask[j % 32] bit j // 32
    bit = torch.arange(8, dtype=torch.int32, device=x.device).reshape(1, 8, 1)
    hmask = (hbit << bit).sum(1)
    L = torch.where(L > 3, L - 4, L).reshape(nb, 2, 4, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(nb, 64)
    return torch.cat([hmask.to(torch.uint8), qs.to(torch.uint8), s.to(torch.uint8), d_bytes.reshape(nb, 2)], dim=1)


def _q2_k(x: torch.Tensor) -> torch.Tensor:
    nb = x.shape[0]
    xs = x.reshape(nb, 16, 16)
    scales, mins = _make_qkx2(xs.reshape(-1, 16), xs.abs().reshape(-1, 16), 3, -0.5, 0.1, 15, True)
    scales = scales.reshape(nb, 16)
    mins = mins.reshape(nb, 16)
    max_scale = scales.amax(1, keepdim=True)
    max_min = mins.amax(1, keepdim=True)
    ok_s = max_scale > 0
    ok_m = max_min > 0
    ls = torch.where(ok_s, _round((15.0 / torch.where(ok_s, max_scale, 1)) * scales), 0).clamp(0, 15)
    lm = torch.where(ok_m, _round((15.0 / torch.where(ok_m, max_min, 1)) * mins), 0).clamp(0, 15)
    d_bytes, d = _fp16(torch.where(ok_s, max_scale / 15.0, 0))
    m_bytes, dmin = _fp16(torch.where(ok_m, max_min / 15.0, 0))
    dd = (d.reshape(nb, 1) * ls).reshape(nb, 16, 1)
    dm = (dmin.reshape(nb, 1) * lm).reshape(nb, 16, 1)
    L = _round((xs + dm) / torch.where(dd == 0, torch.ones_like(dd), dd)).clamp(0, 3)
    L = torch.where(dd == 0, torch.zeros_like(L), L).to(torch.uint8).reshape(nb, 2, 4, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 2) | (L[:, :, 2] << 4) | (L[:, :, 3] << 6)).reshape(nb, 64)
    sc = (ls.to(torch.uint8) | (lm.to(torch.uint8) << 4))
    return torch.cat([sc, qs, d_bytes.reshape(nb, 2), m_bytes.reshape(nb, 2)], dim=1)


def _in_blocks(block_fn):
    """A whole-tensor quantizer from a function of ``[n, QK_K]`` float32 blocks -> ``[n, block_bytes]``
    bytes, run ``chunk_elems`` values at a time (bounds the float32 temporaries of the searches)."""

    def quantize_blocks(flat: np.ndarray, chunk_elems: int) -> np.ndarray:
        x = torch.from_numpy(flat)
        nb = x.numel() // QK_K
        step = max(1, chunk_elems // QK_K)
        out = None
        for b0 in range(0, nb, step):
            b1 = min(nb, b0 + step)
            q = block_fn(x[b0 * QK_K : b1 * QK_K].reshape(b1 - b0, QK_K)).cpu()
            if out is None:
                out = torch.empty(nb, q.shape[1], dtype=torch.uint8)
            out[b0:b1] = q
        return np.empty(0, dtype=np.uint8) if out is None else out.numpy().reshape(-1)

    return quantize_blocks


quantize_q2_k = _in_blocks(_q2_k)
quantize_q3_k = _in_blocks(_q3_k)
quantize_q4_k = _in_blocks(_q4_k)
quantize_q5_k = _in_blocks(_q5_k)
quantize_q6_k = _in_blocks(_q6_k)


def quantize_f32(flat: np.ndarray, chunk_elems: int) -> np.ndarray:
    return flat.view(np.uint8)


def quantize_f16(flat: np.ndarray, chunk_elems: int) -> np.ndarray:
    return flat.astype(np.float16).view(np.uint8)  # round to nearest even, as torch and ggml do


def quantize_bf16(flat: np.ndarray, chunk_elems: int) -> np.ndarray:
    return torch.from_numpy(flat).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
