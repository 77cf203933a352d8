"""DeepSeek-V3 FP8 block-quantized checkpoints: helpers to dequantize (and, for tests and for
``KLinearFP8`` on non-FP8 weights, quantize) in plain torch, on any device.

Format (the DeepSeek-V3/R1 and Kimi-K2 safetensors releases, ``quantization_config``
``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}``): a linear weight
``W [out, in]`` is stored as ``<name>.weight`` ``float8_e4m3fn [out, in]`` plus
``<name>.weight_scale_inv`` ``float32 [ceil(out/128), ceil(in/128)]``; the real weight is
``W[i, j] = fp8[i, j] * scale_inv[i // 128, j // 128]`` (edge blocks are partial).

``FP8DequantSource`` wraps any ``WeightSource`` whose tensors may be FP8: it serves them
dequantized (plain tensors and per-expert stacks), hides the ``*_scale_inv`` names, and hands
ops that keep FP8 the stored weight with its scales through ``raw()`` (a :class:`RawTensor`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import WeightError
from .source import RawTensor, WeightSource

BLOCK = 128
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))
E4M3_MAX = 448.0


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype in FP8_DTYPES


def _block(block_size) -> tuple[int, int]:
    if isinstance(block_size, int):
        return block_size, block_size
    bo, bi = block_size
    return int(bo), int(bi)


def block_dequant(weight: torch.Tensor, scale_inv: torch.Tensor, block_size=BLOCK,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight [..., out, in]`` (fp8) times its per-block ``scale_inv [..., ceil(out/bo), ceil(in/bi)]``.

    Works on any device (CPU included) and for stacked experts (leading dims); computes in
    fp32 and returns ``dtype``."""
    bo, bi = _block(block_size)
    out, inp = weight.shape[-2:]
    nbo, nbi = -(-out // bo), -(-inp // bi)
    if tuple(scale_inv.shape[-2:]) != (nbo, nbi):
        raise WeightError(f"FP8 scale shape {list(scale_inv.shape)} does not fit weight {list(weight.shape)} "
                          f"with {bo}x{bi} blocks (expected [..., {nbo}, {nbi}])")
    lead = weight.shape[:-2]
    w = weight.to(torch.float32)
    pad_o, pad_i = nbo * bo - out, nbi * bi - inp
    if pad_o or pad_i:
        w = F.pad(w, (0, pad_i, 0, pad_o))
    w = w.view(*lead, nbo, bo, nbi, bi) * scale_inv.to(device=w.device, dtype=torch.float32)[..., :, None, :, None]
    w = w.view(*lead, nbo * bo, nbi * bi)
    if pad_o or pad_i:
        w = w[..., :out, :inp]
    return w.to(dtype).contiguous()


def block_quant(weight: torch.Tensor, block_size=BLOCK, fp8_dtype: torch.dtype | None = None):
    """(fp8 weight, fp32 scale_inv) in the DeepSeek block format (amax / 448 per block)."""
    fp8_dtype = fp8_dtype or torch.float8_e4m3fn
    fmax = torch.finfo(fp8_dtype).max
    bo, bi = _block(block_size)
    out, inp = weight.shape[-2:]
    nbo, nbi = -(-out // bo), -(-inp // bi)
    lead = weight.shape[:-2]
    w = weight.to(torch.float32)
    pad_o, pad_i = nbo * bo - out, nbi * bi - inp
    if pad_o or pad_i:
        w = F.pad(w, (0, pad_i, 0, pad_o))
    wb = w.view(*lead, nbo, bo, nbi, bi)
    amax = wb.abs().amax(dim=(-3, -1))  # [..., nbo, nbi]
    scale_inv = torch.where(amax > 0, amax / fmax, torch.ones_like(amax))
    q = (wb / scale_inv[..., :, None, :, None]).clamp(-fmax, fmax).to(fp8_dtype)
    q = q.view(*lead, nbo * bo, nbi * bi)[..., :out, :inp].contiguous()
    return q, scale_inv.contiguous()


def checkpoint_block_size(config) -> tuple[int, int]:
    """``weight_block_size`` of a config's ``quantization_config`` (default 128x128)."""
    qc = getattr(config, "quantization_config", None) or {}
    if not isinstance(qc, dict):
        qc = getattr(qc, "to_dict", lambda: {})()
    bs = qc.get("weight_block_size") or [BLOCK, BLOCK]
    return int(bs[0]), int(bs[1])


class FP8DequantSource(WeightSource):
    """Wraps a source whose tensors may be FP8 + ``*_scale_inv``: serves them dequantized
    (float32), including per-expert stacks (``<experts>.gate_proj`` from ``experts.E.gate_proj.weight``
    and their per-expert scales), so every op — CPU expert kernels included — sees plain
    floats.  ``raw(name)`` returns the FP8 weight with its scales for ops that keep FP8."""

    def __init__(self, inner: WeightSource, block_size=BLOCK):
        if isinstance(inner, FP8DequantSource):  # open_weights already wraps FP8 checkpoints
            inner = inner.inner
        self.inner = inner
        self.path = inner.path
        self.block_size = _block(block_size)

    # scales of a name: plain "<x>.weight" -> "<x>.weight_scale_inv"; stacked experts
    # "<base>.<proj>" -> ["<base>.<e>.<proj>.weight_scale_inv" for e]
    def _scale(self, name: str, n_experts: int | None):
        s = name + SCALE_SUFFIX
        if self.inner.has(s):
            return self.inner.tensor(s, dtype=torch.float32)
        base, _, proj = name.rpartition(".")
        if n_experts is not None and base.endswith("experts"):
            names = [f"{base}.{e}.{proj}.weight{SCALE_SUFFIX}" for e in range(n_experts)]
            if all(self.inner.has(n) for n in names):
                return torch.stack([self.inner.tensor(n, dtype=torch.float32) for n in names])
        return None

    def stores_parameter(self, name: str) -> bool:
        return self.inner.stores_parameter(name)

    def ggml_type(self, name: str) -> int | None:
        """The inner file's stored ggml type of ``name`` (None for a checkpoint of floats / FP8), read
        from its header: no tensor is read."""
        probe = getattr(self.inner, "ggml_type", None)
        return probe(name) if callable(probe) and self.inner.has(name) else None

    def raw(self, name: str) -> RawTensor | None:
        """The FP8 weight with its fp32 ``scale_inv`` when ``name`` is stored as FP8; else the inner raw."""
        if not self.inner.has(name):
            return None
        t = self.inner.tensor(name)
        if not is_fp8(t):
            return self.inner.raw(name)
        scale = self._scale(name, t.shape[0] if t.dim() == 3 else None)
        if scale is None:
            raise WeightError(f"{self.path}: tensor '{name}' is {t.dtype} but has no '{SCALE_SUFFIX}' scales")
        return RawTensor(name, t, None, tuple(t.shape), scale_inv=scale)

    def _has_native(self, name):
        if name.endswith(SCALE_SUFFIX):
            return False
        base, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj" and base.endswith("experts") and self.inner.has(f"{base}.gate_proj") \
                and self.inner.has(f"{base}.up_proj"):
            return False  # derived by the base class from the dequantized gate and up stacks
        return self.inner.has(name)

    def _native_shape(self, name):
        return self.inner.shape(name)

    def _load_native(self, name):
        raw = self.raw(name)
        if raw is not None and raw.is_fp8:
            return block_dequant(raw.data, raw.scale_inv, self.block_size)
        return self.inner.tensor(name)

    def names(self):
        return [n for n in self.inner.names() if not n.endswith(SCALE_SUFFIX)]

    def config(self):
        return self.inner.config()

    def close(self):
        self.inner.close()

    def describe(self):
        return f"FP8DequantSource({self.inner.describe()})"
