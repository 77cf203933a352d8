"""Our own ggml quantizers (vectorized torch, float32), for types gguf-py cannot produce.

gguf-py 0.19 quantizes F16/BF16/Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 bit-exactly like ggml's reference code,
so :func:`quantize` delegates those to it.  For the K-quants it raises NotImplementedError; this
module implements llama.cpp's *non-imatrix* reference algorithms (``quantize_row_q{2,3,4,5,6}_K_ref``
with ``make_qkx2_quants`` / ``make_qx_quants`` / ``make_q3_quants``), vectorized over blocks:

* Q4_K / Q5_K: per 32-value sub-block a weighted (``sqrt(mean x^2) + |x|``) least-squares search of
  scale and min over 21 / 16 candidate grids, then 6-bit scales/mins relative to the block maxima.
* Q6_K: per 16-value sub-block an ``x^2``-weighted search of the scale over 19 grids, 8-bit scales.
* Q3_K: per 16-value sub-block ``make_q3_quants`` (x^2-weighted, 5 rounds of coordinate descent).
* Q2_K: per 16-value sub-block ``make_qkx2_quants`` with absolute-error weights ``|x|``.

Rounding is round-half-to-even like ggml's ``nearest_int``, fp16 conversion round-to-nearest-even,
so results are usually byte-identical to llama-quantize's (sums are accumulated in a different
order, which can flip a near-tie); the tests check the RMS error against llama.cpp's own bytes.
"""

from __future__ import annotations

import numpy as np

from .ggml_types import ggml_type_info


class _LazyTorch:
    """torch, imported on first use: the converter's C++ and gguf-py paths run without it, so a
    conversion does not pay torch's import time."""

    def __getattr__(self, name):
        import torch as _torch

        globals()["torch"] = _torch
        return getattr(_torch, name)


torch = _LazyTorch()

QK_K = 256
GROUP_MAX_EPS = 1e-15

#: types :func:`quantize` can produce
QUANTIZABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "IQ4_NL", "IQ4_XS", "MXFP4")


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


_K_QUANTS = {"Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}

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
    the torch code below, which is the reference it is tested against); IQ4_NL / IQ4_XS exist in
    C++ only.
    """
    info = ggml_type_info(ggml_type)
    if isinstance(x, np.ndarray):
        a = np.ascontiguousarray(x, dtype=np.float32)
    else:  # a torch tensor
        a = x.detach().to(torch.float32).contiguous().cpu().numpy()
    if a.ndim == 0:
        a = a.reshape(1)
    n = a.shape[-1]
    if n % info.block_elems:
        raise ValueError(f"rows of {n} values are not a multiple of the {info.name} block ({info.block_elems})")
    flat = a.reshape(-1)
    if info.name == "F32":
        return flat.view(np.uint8)
    if info.name == "F16":
        return flat.astype(np.float16).view(np.uint8)  # round to nearest even, as torch and ggml do
    if info.name == "BF16":
        return torch.from_numpy(flat).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    ext = native_quantizer() if native else None
    if ext is not None and ext.quantize_rows_supported(info.id):
        out = np.empty(flat.size // info.block_elems * info.block_bytes, dtype=np.uint8)
        ext.quantize_rows(info.id, flat.ctypes.data, flat.size // n, n, out.ctypes.data, quantize_threads())
        return out
    fn = _K_QUANTS.get(info.name)
    if fn is None:
        import gguf

        qt = gguf.GGMLQuantizationType(info.id)
        try:
            arr = flat.reshape(-1, n)
            return np.ascontiguousarray(gguf.quants.quantize(arr, qt)).reshape(-1).view(np.uint8)
        except NotImplementedError as e:
            raise NotImplementedError(f"cannot quantize to {info.name} without the C++ extension's quantizer "
                                      f"(build it: python setup.py build_ext --inplace)") from e
    flat = torch.from_numpy(flat)
    nb = flat.numel() // info.block_elems
    out = torch.empty(nb, info.block_bytes, dtype=torch.uint8)
    step = max(1, chunk_elems // info.block_elems)
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        out[b0:b1] = fn(flat[b0 * info.block_elems : b1 * info.block_elems].reshape(b1 - b0, info.block_elems)).cpu()
    return out.numpy().reshape(-1)
