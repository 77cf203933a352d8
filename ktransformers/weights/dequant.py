"""Dequantize ggml tensors with torch (CPU and CUDA tensors alike).

The public entry point is :func:`dequantize` (whole tensors, chunked so the extra memory stays
bounded).  Each type's block function is in its row of :mod:`.ggml_types` (the functions:
:mod:`.block_dequant`); a type whose row has none falls back to gguf-py's numpy code.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

from .ggml_types import TYPES, ggml_type_info

logger = logging.getLogger(__name__)

#: the types expanded in torch (bit-exact with gguf-py)
TORCH_DEQUANT_TYPES = tuple(t.name for t in TYPES.values() if t.dequant is not None)

#: values dequantized per step by :func:`dequantize`: small enough that the temporaries of one
#: chunk stay in cache (measured fastest on CPU), large enough that per-op overhead is negligible
DEFAULT_CHUNK_ELEMS = 1 << 17

_warned_fallback: set[str] = set()


class UnsupportedTypeError(ValueError):
    """Neither this module nor gguf-py can dequantize the ggml type."""


def _as_uint8_tensor(data) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data.reshape(-1).view(torch.uint8) if data.dtype != torch.uint8 else data.reshape(-1)
    arr = np.asarray(data)
    arr = arr.reshape(-1).view(np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only buffers: we never write through this view
        return torch.from_numpy(arr)


def _gguf_py_blocks(ggml_type, name: str):
    """A block function using gguf-py's numpy dequantizer (the fallback for exotic types)."""
    import gguf

    qtype = gguf.GGMLQuantizationType(int(ggml_type))

    def fn(blocks: torch.Tensor) -> torch.Tensor:
        if name not in _warned_fallback:
            _warned_fallback.add(name)
            msg = f"ggml type {name}: no torch dequantizer, using gguf-py's numpy one (slower, CPU)"
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            logger.warning(msg)
        dev = blocks.device
        arr = blocks.cpu().numpy()
        out = gguf.quants.dequantize(arr, qtype)
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(arr.shape[0], -1).to(dev)

    return fn


def block_dequantizer(ggml_type):
    """The block function for a ggml type (ours, else gguf-py's fallback); raises UnsupportedTypeError."""
    info = ggml_type_info(ggml_type)
    if info.dequant is not None:
        return info.dequant
    import gguf.quants

    if info.qtype in gguf.quants._type_traits:
        return _gguf_py_blocks(info.qtype, info.name)
    raise UnsupportedTypeError(f"ggml type {info.name} ({info.id}) cannot be dequantized")


def dequantize(
    data,
    ggml_type,
    shape=None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    chunk_blocks: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize raw ggml bytes into a ``dtype`` tensor of ``shape`` (torch order) on ``device``.

    ``data`` is a flat ``uint8`` numpy array (e.g. a zero-copy view of a memory-mapped file) or a
    ``uint8`` torch tensor (any device).  Work proceeds ``chunk_blocks`` blocks at a time (default: about 128k values): only
    that chunk is copied to ``device`` and expanded to float32, so the extra memory beyond the
    output stays bounded whatever the tensor size.  A plain element type (F32, F16, BF16, I32, ...)
    asked for as its own dtype on its own device is returned zero-copy, a view of ``data``.
    """
    info = ggml_type_info(ggml_type)
    src = _as_uint8_tensor(data)
    nbytes = src.numel()
    if nbytes % info.block_bytes:
        raise ValueError(f"{nbytes} bytes is not a whole number of {info.name} blocks ({info.block_bytes} B)")
    n_blocks = nbytes // info.block_bytes
    n_elems = n_blocks * info.block_elems
    if shape is None:
        shape = (n_elems,)
    shape = tuple(int(s) for s in shape)
    if int(np.prod(shape, dtype=np.int64)) != n_elems:
        raise ValueError(f"{info.name}: {nbytes} bytes hold {n_elems} values, not shape {list(shape)}")
    device = torch.device(device) if device is not None else src.device

    if out is None and info.torch_dtype is not None and src.device == device:
        native = getattr(torch, info.torch_dtype)
        if dtype == native:
            return src.view(native).reshape(shape)

    fn = block_dequantizer(info.id)
    if out is None:
        out = torch.empty(n_elems, dtype=dtype, device=device)
    else:
        if out.numel() != n_elems or not out.is_contiguous():
            raise ValueError("out has the wrong size or is not contiguous")
    flat = out.reshape(-1)
    if chunk_blocks is None:
        chunk_blocks = DEFAULT_CHUNK_ELEMS // info.block_elems
        if device.type != "cpu":
            chunk_blocks *= 64  # GPUs want big launches; memory stays bounded all the same
    step = max(1, int(chunk_blocks))
    bb, be = info.block_bytes, info.block_elems
    for b0 in range(0, n_blocks, step):
        b1 = min(n_blocks, b0 + step)
        chunk = src[b0 * bb : b1 * bb].to(device, non_blocking=False).reshape(b1 - b0, bb)
        flat[b0 * be : b1 * be].copy_(fn(chunk).reshape(-1))
    return out.reshape(shape)
