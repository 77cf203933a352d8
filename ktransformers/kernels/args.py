"""Argument checking for the CPU kernels, in one place: every array handed to C++ is checked
here (device, contiguity, dtype, shape, bytes for the ggml type, alignment) and turned into a
pointer.  The decode fast path (``moe_call_args`` / ``linear_call_args``) reads a few attributes
of well-formed torch tensors and falls back to the checked path, which raises the errors."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..weights.ggml_types import GGMLType, KERNEL_TYPES, ggml_type_info

_F32, _BF16 = 0, 1


def ggml_type(t: Any, arg: str = "type") -> GGMLType:
    """A kernel weight type given as GGMLType, name, gguf enum or int; TypeError/ValueError otherwise."""
    if not isinstance(t, (GGMLType, str)):
        try:
            t = int(t)
        except (TypeError, ValueError):
            raise TypeError(f"{arg}: expected a ggml type name, gguf.GGMLQuantizationType or int, "
                            f"got {type(t).__name__}") from None
    try:
        info = ggml_type_info(t)
    except KeyError:
        info = None
    if info is None or not info.kernel:
        what = f"ggml type id {t}" if isinstance(t, int) else f"ggml type {t!r}"
        raise ValueError(f"{arg}: unknown or unsupported {what}; expected one of {', '.join(KERNEL_TYPES)}")
    return info


def _torch():
    try:
        import torch
        return torch
    except ImportError:  # pragma: no cover
        return None


def _is_torch(a: Any) -> bool:
    t = _torch()
    return t is not None and isinstance(a, t.Tensor)


def _desc(a: Any, name: str) -> tuple[int, str, tuple[int, ...]]:
    """(pointer, dtype name, shape) of a C-contiguous CPU array; TypeError/ValueError otherwise."""
    if _is_torch(a):
        if a.device.type != "cpu":
            raise ValueError(f"{name}: must be a CPU tensor, got device {a.device}")
        if not a.is_contiguous():
            raise ValueError(f"{name}: must be contiguous")
        return a.data_ptr(), str(a.dtype).replace("torch.", ""), tuple(a.shape)
    if isinstance(a, np.ndarray):
        if not a.flags.c_contiguous:
            raise ValueError(f"{name}: must be C-contiguous")
        return a.ctypes.data, a.dtype.name, tuple(a.shape)
    raise TypeError(f"{name}: expected a numpy array or torch tensor, got {type(a).__name__}")


def _nbytes(a: Any) -> int:
    return a.numel() * a.element_size() if _is_torch(a) else a.nbytes


_FLOAT_WEIGHT_DTYPES = {0: "float32", 1: "float16", 30: "bfloat16"}


def _weight(a: Any, t: GGMLType, shape: tuple[int, ...], name: str) -> int:
    ptr, dt, shp = _desc(a, name)
    tname, be = t.name, t.block_elems
    if shape[-1] % be:
        raise ValueError(f"{name}: {tname} stores rows in blocks of {be} elements, but the row length is "
                         f"{shape[-1]} (shape {list(shape)}); use a type whose block divides it")
    need = int(np.prod(shape[:-1])) * t.row_bytes(shape[-1])
    if dt == "uint8" or dt == "int8":
        if _nbytes(a) != need:
            raise ValueError(f"{name}: expected {need} bytes for {tname} {list(shape)}, got {_nbytes(a)} bytes")
    elif dt == _FLOAT_WEIGHT_DTYPES.get(t.id):
        if tuple(shp) != tuple(shape) and int(np.prod(shp)) != int(np.prod(shape)):
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(shp)}")
    else:
        raise TypeError(f"{name}: expected uint8 bytes of {tname}"
                        + (f" or a {_FLOAT_WEIGHT_DTYPES[t.id]} tensor" if t.id in _FLOAT_WEIGHT_DTYPES else "")
                        + f", got dtype {dt}")
    if ptr % 4:
        raise ValueError(f"{name}: data must be at least 4-byte aligned (address {ptr:#x})")
    return ptr


def _act(x: Any, name: str, cols: int) -> tuple[int, int, int]:
    ptr, dt, shp = _desc(x, name)
    if len(shp) != 2 or shp[1] != cols:
        raise ValueError(f"{name}: expected shape [T, {cols}], got {list(shp)}")
    if dt == "float32":
        return ptr, _F32, shp[0]
    if dt == "bfloat16":
        return ptr, _BF16, shp[0]
    raise TypeError(f"{name}: expected float32 or bfloat16, got {dt}")


def _empty_like(x: Any, shape: tuple[int, int], dtype: str | None):
    if _is_torch(x):
        torch = _torch()
        td = x.dtype if dtype is None else getattr(torch, dtype)
        return torch.empty(shape, dtype=td)
    if dtype not in (None, "float32"):
        raise TypeError(f"out_dtype: numpy outputs are float32 only, got {dtype}")
    return np.empty(shape, dtype=np.float32)


def _routing(ids: Any, w: Any, T: int) -> tuple[Any, Any, int]:
    """Returns (ids int64, weights float32, k), converting dtype with a copy when needed."""
    _, idt, ishape = _desc(ids, "ids")
    _, wdt, wshape = _desc(w, "weights")
    if len(ishape) != 2 or ishape[0] != T:
        raise ValueError(f"ids: expected shape [T={T}, k], got {list(ishape)}")
    if tuple(wshape) != tuple(ishape):
        raise ValueError(f"weights: expected shape {list(ishape)} (same as ids), got {list(wshape)}")
    if idt not in ("int64", "int32"):
        raise TypeError(f"ids: expected int64 (or int32), got {idt}")
    if wdt not in ("float32", "bfloat16", "float16", "float64"):
        raise TypeError(f"weights: expected float32, got {wdt}")
    if idt != "int64":
        ids = ids.to(_torch().int64) if _is_torch(ids) else ids.astype(np.int64)
    if wdt != "float32":
        w = w.to(_torch().float32).contiguous() if _is_torch(w) else np.ascontiguousarray(w, dtype=np.float32)
    return ids, w, ishape[1]


def _out(out: Any, name: str, T: int, cols: int) -> tuple[int, int]:
    ptr, dt, shp = _desc(out, name)
    if tuple(shp) != (T, cols):
        raise ValueError(f"{name}: expected shape [{T}, {cols}], got {list(shp)}")
    if dt not in ("float32", "bfloat16"):
        raise TypeError(f"{name}: expected float32 or bfloat16, got {dt}")
    return ptr, (_F32 if dt == "float32" else _BF16)


_fast_types: tuple | None = None


def _tensor_types() -> tuple | None:
    """(torch.Tensor, float32, bfloat16, int64), looked up once for the fast paths; None without torch."""
    global _fast_types
    if _fast_types is None:
        torch = _torch()
        if torch is None:
            return None
        _fast_types = (torch.Tensor, torch.float32, torch.bfloat16, torch.int64)
    return _fast_types


def _fast_moe_args(x, ids, w, out, H: int):
    """Decode fast path (a few attribute reads instead of the full validation): torch CPU tensors,
    contiguous, x/out [T, H] float32|bfloat16, ids [T, k] int64, weights [T, k] float32.  Returns
    the extension arguments, or None to fall back to the checked path (which raises the errors)."""
    if _tensor_types() is None:
        return None
    TT, f32, bf16, i64 = _fast_types
    if not (type(x) is TT and type(ids) is TT and type(w) is TT and type(out) is TT):
        return None
    xd, od = x.dtype, out.dtype
    if ids.dtype is not i64 or w.dtype is not f32 or (xd is not f32 and xd is not bf16) or (od is not f32 and od is not bf16):
        return None
    xs, ishp = x.shape, ids.shape
    if len(xs) != 2 or xs[1] != H or len(ishp) != 2 or ishp[0] != xs[0] or w.shape != ishp or out.shape != xs:
        return None
    if not (x.is_contiguous() and ids.is_contiguous() and w.is_contiguous() and out.is_contiguous()):
        return None
    if not (x.is_cpu and ids.is_cpu and w.is_cpu and out.is_cpu):
        return None
    return (xs[0], ishp[1], x.data_ptr(), _F32 if xd is f32 else _BF16, ids.data_ptr(), w.data_ptr(),
            out.data_ptr(), _F32 if od is f32 else _BF16)


def _fast_linear_args(x, out, n_in: int, n_out: int):
    """Decode fast path of LinearKernel: torch CPU tensors, contiguous, x [T, in] / out [T, out]
    float32|bfloat16.  Returns the extension arguments or None (checked path raises the errors)."""
    if _tensor_types() is None:
        return None
    TT, f32, bf16, _ = _fast_types
    if type(x) is not TT or type(out) is not TT:
        return None
    xd, od = x.dtype, out.dtype
    if (xd is not f32 and xd is not bf16) or (od is not f32 and od is not bf16):
        return None
    xs, os_ = x.shape, out.shape
    if len(xs) != 2 or xs[1] != n_in or len(os_) != 2 or os_[0] != xs[0] or os_[1] != n_out:
        return None
    if not (x.is_contiguous() and out.is_contiguous() and x.is_cpu and out.is_cpu):
        return None
    return (xs[0], x.data_ptr(), _F32 if xd is f32 else _BF16, out.data_ptr(), _F32 if od is f32 else _BF16)


def moe_call_args(x, ids, weights, out, hidden: int):
    """(extension arguments, arrays to keep alive) of one MoE forward."""
    fast = _fast_moe_args(x, ids, weights, out, hidden)
    if fast is not None:
        return fast, (x, ids, weights, out)
    px, xdt, T = _act(x, "x", hidden)
    ids, weights, k = _routing(ids, weights, T)
    po, odt = _out(out, "out", T, hidden)
    return (T, k, px, xdt, _desc(ids, "ids")[0], _desc(weights, "weights")[0], po, odt), (x, ids, weights, out)


def linear_call_args(x, out, n_in: int, n_out: int):
    """Extension arguments of one linear forward."""
    fast = _fast_linear_args(x, out, n_in, n_out)
    if fast is not None:
        return fast
    px, xdt, T = _act(x, "x", n_in)
    po, odt = _out(out, "out", T, n_out)
    return (T, px, xdt, po, odt)


def positive_ints(**values) -> None:
    for n, v in values.items():
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{n}: expected a positive int, got {v!r}")


def rows_of(x: Any) -> int:
    return _desc(x, "x")[2][0]
