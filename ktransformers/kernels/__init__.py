"""CPU kernels for routed MoE experts and dense linear layers (the C++ extension
``ktransformers.cpuinfer_ext``, wrapped with argument checking).

The C++ core only sees raw pointers, shapes and ggml type ids; this module turns numpy arrays
and torch CPU tensors into those, keeps them alive while asynchronous work is in flight, and
raises ``ValueError`` / ``TypeError`` naming the offending argument.

Quick use::

    from ktransformers import kernels as K
    pool = K.cpu_infer(2)                                   # process-wide pool, 2 threads
    moe = K.MoEKernel(pool, "llamafile", num_experts=128, hidden=2048, intermediate=768,
                      gate=gate_raw, up=up_raw, down=down_raw,   # uint8 GGUF bytes (zero copy)
                      gate_type="Q4_K", up_type="Q4_K", down_type="Q6_K")
    y = moe.forward(x, topk_ids, topk_weights)              # blocking
    moe.submit(x, topk_ids, topk_weights, out); ...; pool.sync()   # asynchronous

API
---
``isa_tier() -> str``
    ISA tier in force: ``scalar | avx2 | avx512 | avx512bf16 | amx`` (best the CPU supports,
    lowered by the environment variable ``KT_ISA``; an invalid value raises ``ValueError``).
    Logged once (logger ``ktransformers.kernels``) when the first pool is created.

``cpu_infer(threads=None) -> CPUInfer``
    Shared pool per thread count (default: ``os.cpu_count()``).  ``CPUInfer(threads)`` makes a
    private one.  The thread that computes takes part, so ``threads=n`` starts ``n-1`` workers
    (+1 queue thread that only runs while a submitted task is in flight).  Idle workers block
    after a short spin (``KT_SPIN_US``, default 50).
    ``pool.sync()`` waits for submitted work (GIL released) and re-raises the first task error.

``MoEKernel(pool, backend, num_experts, hidden, intermediate, gate, up, down, gate_type,
up_type, down_type, activation="silu", alpha=1.702, limit=7.0)``
    ``backend``: ``"llamafile"`` (weights used in place in their ggml type), ``"AMXInt8"``
    (requantised at load to int8, per-row scales, VNNI/AMX tile layout) or ``"AMXBF16"``
    (repacked to bf16).  ``gate``/``up`` hold ``[E, I, H]`` and ``down`` ``[E, H, I]`` in the
    stacked GGUF layout: either raw bytes (numpy/torch ``uint8``, any shape, exactly
    ``E*rows*row_bytes(type, cols)`` bytes, C-contiguous) or, for F32/F16/BF16, float tensors of
    that shape.  Types: F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ4_NL
    IQ4_XS (name, ``gguf.GGMLQuantizationType`` or id).  Row lengths must be multiples of the
    type's block (32, or 256 for K-quants/IQ4_XS), else ``ValueError`` naming the projection and
    shape.  ``activation``: ``"silu"`` | ``"gelu_tanh"`` | ``"clamp_swiglu"`` (gpt-oss:
    ``(clamp(up,±limit)+1) * g*sigmoid(alpha*g)``, ``g = min(gate, limit)``).
    llamafile weights are referenced, not copied: the wrapper keeps the arrays alive.

    ``.forward(x, ids, weights, out=None, out_dtype=None) -> out`` (blocking)
    ``.submit(x, ids, weights, out)`` (returns at once; call ``pool.sync()`` before reading out)
        ``x [T, H]`` float32 or bfloat16 (torch) / float32 (numpy); ``ids [T, k]`` int64 (int32
        is converted), ``-1`` skips a slot; ``weights [T, k]`` float32; ``out [T, H]`` float32 or
        bfloat16, default dtype of x.  Expert ids >= num_experts raise ``IndexError``.

``LinearKernel(pool, backend, in_features, out_features, weight, weight_type)``
    ``y[T, out] = x[T, in] @ W^T``, ``W [out, in]`` as for MoEKernel.  ``.forward(x, out=None,
    out_dtype=None)``, ``.submit(x, out)``.  Contiguous torch CPU tensors take a decode fast path
    (no validation beyond dtype/shape/contiguity checks; anything else falls back to the checked
    path, which raises the errors).

``row_bytes(type, cols)``, ``type_info(type)``, ``dequantize(raw, type, n)`` (ggml reference
values, used by tests).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np

from .. import cpuinfer_ext as _ext

__all__ = ["isa_tier", "cpu_infer", "CPUInfer", "MoEKernel", "LinearKernel", "row_bytes", "type_info",
           "dequantize", "ggml_type", "BACKENDS", "ACTIVATIONS", "TYPES"]

log = logging.getLogger("ktransformers.kernels")

BACKENDS = {"llamafile": 0, "AMXInt8": 1, "AMXBF16": 2}
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "clamp_swiglu": 2}
TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11,
         "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30}
_TYPE_NAMES = {v: k for k, v in TYPES.items()}
_F32, _BF16 = 0, 1

_logged = False
_lock = threading.Lock()
_pools: dict[int, "CPUInfer"] = {}


def isa_tier() -> str:
    """ISA tier in force; raises ValueError for an invalid or unsupported KT_ISA."""
    try:
        return _ext.isa_tier()
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"cannot select CPU kernels: {e}") from None


def _log_tier_once() -> None:
    global _logged
    tier = isa_tier()
    if not _logged:
        _logged = True
        log.info("CPU kernels: ISA tier %s (best supported %s)", tier, _ext.best_isa_tier())


def ggml_type(t: Any, arg: str = "type") -> int:
    """Normalise a ggml type given as name, gguf enum or int; TypeError/ValueError otherwise."""
    if isinstance(t, str):
        if t.upper() not in TYPES:
            raise ValueError(f"{arg}: unknown or unsupported ggml type {t!r}; expected one of {', '.join(TYPES)}")
        return TYPES[t.upper()]
    try:
        v = int(t)
    except (TypeError, ValueError):
        raise TypeError(f"{arg}: expected a ggml type name, gguf.GGMLQuantizationType or int, got {type(t).__name__}") from None
    if v not in _TYPE_NAMES:
        raise ValueError(f"{arg}: ggml type id {v} is not supported; expected one of {', '.join(TYPES)}")
    return v


def type_info(t: Any) -> tuple[str, int, int, bool]:
    return _ext.type_info(ggml_type(t))


def row_bytes(t: Any, cols: int) -> int:
    return _ext.row_bytes(ggml_type(t), int(cols))


# --------------------------------------------------------------------------------------------
# array plumbing
# --------------------------------------------------------------------------------------------
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


def _weight(a: Any, t: int, shape: tuple[int, ...], name: str) -> int:
    ptr, dt, shp = _desc(a, name)
    tname = _TYPE_NAMES[t]
    be = _ext.type_info(t)[1]
    if shape[-1] % be:
        raise ValueError(f"{name}: {tname} stores rows in blocks of {be} elements, but the row length is "
                         f"{shape[-1]} (shape {list(shape)}); use a type whose block divides it")
    need = int(np.prod(shape[:-1])) * _ext.row_bytes(t, shape[-1])
    if dt == "uint8" or dt == "int8":
        if _nbytes(a) != need:
            raise ValueError(f"{name}: expected {need} bytes for {tname} {list(shape)}, got {_nbytes(a)} bytes")
    elif dt == _FLOAT_WEIGHT_DTYPES.get(t):
        if tuple(shp) != tuple(shape) and int(np.prod(shp)) != int(np.prod(shape)):
            raise ValueError(f"{name}: expected shape {list(shape)}, got {list(shp)}")
    else:
        raise TypeError(f"{name}: expected uint8 bytes of {tname}"
                        + (f" or a {_FLOAT_WEIGHT_DTYPES[t]} tensor" if t in _FLOAT_WEIGHT_DTYPES else "")
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


# --------------------------------------------------------------------------------------------
class CPUInfer:
    """Thread pool + async task queue.  ``threads`` counts the computing thread itself."""

    def __init__(self, threads: int | None = None):
        threads = (os.cpu_count() or 1) if threads is None else threads
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads: expected a positive int, got {threads!r}")
        _log_tier_once()
        self._c = _ext.CPUInfer(threads)
        self._keep: list[Any] = []

    @property
    def threads(self) -> int:
        return self._c.threads

    def sync(self) -> None:
        """Wait for all submitted tasks; re-raises the first task error."""
        try:
            self._c.sync()
        finally:
            self._keep.clear()

    def probe_read_bw(self, nbytes: int = 1 << 30, reps: int = 5) -> float:
        """Best-of-reps DRAM read bandwidth with all pool threads, GB/s."""
        return self._c.probe_read_bw(int(nbytes), int(reps))

    def probe_peak(self, kind: str = "fp32", iters: int = 5_000_000) -> float:
        """Register-only peak with all threads: 'fp32' (GFLOP/s), 'bf16' (GFLOP/s), 'int8' (GOP/s)."""
        return self._c.probe_peak({"fp32": 0, "bf16": 1, "int8": 2}[kind], int(iters))


def cpu_infer(threads: int | None = None) -> CPUInfer:
    """Process-wide pool for this thread count (created on first use)."""
    threads = (os.cpu_count() or 1) if threads is None else threads
    with _lock:
        if threads not in _pools:
            _pools[threads] = CPUInfer(threads)
        return _pools[threads]


def _backend(b: Any) -> int:
    if b not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(BACKENDS)}, got {b!r}")
    return BACKENDS[b]


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


class MoEKernel:
    """Routed experts of one MoE layer; see the module docstring."""

    def __init__(self, pool: CPUInfer, backend: str, num_experts: int, hidden: int, intermediate: int,
                 gate: Any, up: Any, down: Any, gate_type: Any, up_type: Any, down_type: Any,
                 activation: str = "silu", alpha: float = 1.702, limit: float = 7.0):
        if not isinstance(pool, CPUInfer):
            raise TypeError(f"pool: expected ktransformers.kernels.CPUInfer, got {type(pool).__name__}")
        for n, v in (("num_experts", num_experts), ("hidden", hidden), ("intermediate", intermediate)):
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{n}: expected a positive int, got {v!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {', '.join(ACTIVATIONS)}, got {activation!r}")
        E, H, I = int(num_experts), int(hidden), int(intermediate)
        self.pool, self.backend = pool, backend
        self.num_experts, self.hidden, self.intermediate = E, H, I
        gt, ut, dt = ggml_type(gate_type, "gate_type"), ggml_type(up_type, "up_type"), ggml_type(down_type, "down_type")
        self.types = (_TYPE_NAMES[gt], _TYPE_NAMES[ut], _TYPE_NAMES[dt])
        pg = _weight(gate, gt, (E, I, H), "gate")
        pu = _weight(up, ut, (E, I, H), "up")
        pd = _weight(down, dt, (E, H, I), "down")
        self._weights = (gate, up, down)  # zero-copy: keep alive
        self._m = _ext.MoE(pool._c, E, H, I, _backend(backend), pg, pu, pd, gt, ut, dt,
                           ACTIVATIONS[activation], float(alpha), float(limit))

    def _args(self, x, ids, weights, out):
        fast = _fast_moe_args(x, ids, weights, out, self.hidden)
        if fast is not None:
            return fast, (x, ids, weights, out)
        px, xdt, T = _act(x, "x", self.hidden)
        ids, weights, k = _routing(ids, weights, T)
        po, odt = _out(out, "out", T, self.hidden)
        return (T, k, px, xdt, _desc(ids, "ids")[0], _desc(weights, "weights")[0], po, odt), (x, ids, weights, out)

    def submit(self, x: Any, ids: Any, weights: Any, out: Any) -> None:
        """Queue the layer; returns at once.  Read ``out`` only after ``pool.sync()``."""
        args, keep = self._args(x, ids, weights, out)
        self.pool._keep.append(keep)
        self._m.submit(self.pool._c, *args)

    def forward(self, x: Any, ids: Any, weights: Any, out: Any = None, out_dtype: str | None = None) -> Any:
        """Blocking forward; returns ``out`` (allocated like x unless given)."""
        if out is None:
            out = _empty_like(x, (_desc(x, "x")[2][0], self.hidden), out_dtype)
        args, _ = self._args(x, ids, weights, out)
        self._m.forward(self.pool._c, *args)
        return out

    @property
    def packed_bytes(self) -> int:
        return self._m.packed_bytes


class LinearKernel:
    """y = x @ W^T on the CPU; see the module docstring."""

    def __init__(self, pool: CPUInfer, backend: str, in_features: int, out_features: int, weight: Any,
                 weight_type: Any):
        if not isinstance(pool, CPUInfer):
            raise TypeError(f"pool: expected ktransformers.kernels.CPUInfer, got {type(pool).__name__}")
        for n, v in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(v, (int, np.integer)) or v <= 0:
                raise ValueError(f"{n}: expected a positive int, got {v!r}")
        self.pool, self.backend = pool, backend
        self.in_features, self.out_features = int(in_features), int(out_features)
        t = ggml_type(weight_type, "weight_type")
        self.type = _TYPE_NAMES[t]
        p = _weight(weight, t, (self.out_features, self.in_features), "weight")
        self._weight = weight
        self._l = _ext.Linear(pool._c, self.in_features, self.out_features, _backend(backend), p, t)

    def _args(self, x, out):
        fast = _fast_linear_args(x, out, self.in_features, self.out_features)
        if fast is not None:
            return fast
        px, xdt, T = _act(x, "x", self.in_features)
        po, odt = _out(out, "out", T, self.out_features)
        return (T, px, xdt, po, odt)

    def submit(self, x: Any, out: Any) -> None:
        args = self._args(x, out)
        self.pool._keep.append((x, out))
        self._l.submit(self.pool._c, *args)

    def forward(self, x: Any, out: Any = None, out_dtype: str | None = None) -> Any:
        if out is None:
            out = _empty_like(x, (_desc(x, "x")[2][0], self.out_features), out_dtype)
        self._l.forward(self.pool._c, *self._args(x, out))
        return out


def dequantize(raw: Any, t: Any, n: int | None = None) -> np.ndarray:
    """float32 values of the first n elements stored in raw (ggml type t), via the C++ kernels."""
    t = ggml_type(t)
    ptr, _, _ = _desc(raw, "raw")
    be, bb = _ext.type_info(t)[1:3]
    n = _nbytes(raw) // bb * be if n is None else int(n)
    if n % be or n // be * bb > _nbytes(raw):
        raise ValueError(f"n: {n} elements do not fit whole {_TYPE_NAMES[t]} blocks in {_nbytes(raw)} bytes")
    out = np.empty(n, np.float32)
    _ext.dequantize(t, ptr, n, out.ctypes.data)
    return out
