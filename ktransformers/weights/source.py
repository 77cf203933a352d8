"""The weight-source protocol every loader implements.

Operators and the injection engine only ever ask a source for tensors by their Hugging Face
parameter name (``model.layers.3.self_attn.q_proj.weight``).  How a name is found on disk
(safetensors keys, GGUF names, per-expert checkpoint keys, fused layouts) is the source's
business, so one operator serves every file format.

Routed experts are addressed with three stacked *virtual* names below the experts module,
whatever the checkpoint layout::

    <experts>.gate_proj   [E, I, H]
    <experts>.up_proj     [E, I, H]
    <experts>.down_proj   [E, H, I]
    <experts>.gate_up_proj [E, 2I, H]   (transformers 5's fused layout = cat(gate, up, dim=1))

A source serves whichever of them it stores natively and this base class derives the others.
A checkpoint written by transformers stores the experts module's own parameters under those
names, in the module's layout; for every family but gpt-oss (transposed, gate/up interleaved)
that is the stacked layout above.  :meth:`WeightSource.stores_parameter` says which of the two a
name holds; the experts ops convert (``operators/experts.py``, ``ExpertsLayout``).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from ..errors import WeightError
from .ggml_types import GGMLType

EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class RawTensor:
    """A tensor exactly as stored, for kernels that compute on it without dequantizing.

    * a ggml type (GGUF): ``data`` is a flat ``uint8`` view of ``rows * bytes_per_row`` bytes
      (zero-copy where the source allows) and ``type`` the :class:`GGMLType`;
    * FP8 block-quantized (DeepSeek-V3 safetensors): ``data`` is the ``float8`` tensor, ``type``
      is None and ``scale_inv`` the fp32 per-block scales.

    ``shape`` is the logical torch shape (rows first, e.g. ``[E, I, H]``).
    """

    name: str
    data: np.ndarray | torch.Tensor
    type: GGMLType | None
    shape: tuple[int, ...]
    scale_inv: torch.Tensor | None = None

    @property
    def ggml_type(self):
        """gguf-py's enum member of the type (None for FP8)."""
        return self.type.qtype if self.type is not None else None

    @property
    def is_fp8(self) -> bool:
        return self.scale_inv is not None

    @property
    def nbytes(self) -> int:
        if isinstance(self.data, np.ndarray):
            return int(self.data.nbytes)
        return self.data.numel() * self.data.element_size()


class WeightSource(abc.ABC):
    """Read-only access to a model's weights by Hugging Face parameter name."""

    #: file or directory the weights come from (for error messages)
    path: str = ""

    # -- what a source implements -------------------------------------------------------
    @abc.abstractmethod
    def _has_native(self, name: str) -> bool:
        """True when ``name`` can be served without deriving it from other tensors."""

    @abc.abstractmethod
    def _load_native(self, name: str) -> torch.Tensor:
        """The tensor for ``name`` in its stored precision (or float32 when it is quantized)."""

    @abc.abstractmethod
    def _native_shape(self, name: str) -> tuple[int, ...]:
        """Shape of a native tensor without loading it."""

    @abc.abstractmethod
    def names(self) -> list[str]:
        """The HF names this source can serve natively."""

    def raw(self, name: str) -> RawTensor | None:
        """Stored bytes of a quantized tensor, or None when the source holds plain floats."""
        return None

    def config(self):
        """A transformers config built from the file's own metadata, when it has one."""
        return None

    def stores_parameter(self, name: str) -> bool:
        """True when ``name`` is stored as the model's own parameter (a transformers checkpoint, in
        the layout of the model's class); False when it is served in the stacked layout above."""
        return False

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return f"{type(self).__name__}({self.path})"

    # -- derived access used by the engine and operators ---------------------------------
    def has(self, name: str) -> bool:
        if self._has_native(name):
            return True
        base, leaf = _split_expert(name)
        if base is None:
            return False
        if leaf == "gate_up_proj":
            return self._has_native(f"{base}.gate_proj") and self._has_native(f"{base}.up_proj")
        if leaf in ("gate_proj", "up_proj"):
            return self._has_native(f"{base}.gate_up_proj")
        return False

    def shape(self, name: str) -> tuple[int, ...]:
        if self._has_native(name):
            return tuple(self._native_shape(name))
        base, leaf = _split_expert(name)
        if base is not None and leaf == "gate_up_proj" and self.has(name):
            g = self._native_shape(f"{base}.gate_proj")
            return (g[0], 2 * g[1], g[2])
        if base is not None and leaf in ("gate_proj", "up_proj") and self.has(name):
            f = self._native_shape(f"{base}.gate_up_proj")
            return (f[0], f[1] // 2, f[2])
        raise self.missing(name)

    def tensor(
        self,
        name: str,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The tensor for an HF name, dequantized, converted to ``dtype`` and moved to ``device``."""
        if self._has_native(name):
            return self._load_as(name, dtype, device).contiguous()
        base, leaf = _split_expert(name)
        if base is not None and leaf == "gate_up_proj" and self.has(name):
            g, u = f"{base}.gate_proj", f"{base}.up_proj"
            E, inter, H = self._native_shape(g)
            dt = dtype or self._natural_dtype(g)
            import torch

            # filled half by half: no second full-size copy of gate and up
            out = torch.empty((E, 2 * inter, H), dtype=dt, device=device or "cpu")
            self._load_into(g, out[:, :inter])
            self._load_into(u, out[:, inter:])
            return out
        if base is not None and leaf in ("gate_proj", "up_proj") and self.has(name):
            fused = self._load_as(f"{base}.gate_up_proj", dtype, device)
            half = fused.shape[1] // 2
            return (fused[:, :half] if leaf == "gate_proj" else fused[:, half:]).contiguous()
        raise self.missing(name)

    # hooks a source may override to avoid intermediate copies
    def _natural_dtype(self, name: str) -> torch.dtype:
        """The dtype ``tensor(name)`` has when no dtype is asked for."""
        return self._load_native(name).dtype

    def _load_as(self, name: str, dtype: torch.dtype | None, device) -> torch.Tensor:
        """A native tensor in ``dtype`` on ``device``."""
        t = self._load_native(name)
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.to(device) if device is not None else t

    def _load_into(self, name: str, out: torch.Tensor) -> None:
        """Write a native tensor into ``out`` (its shape; any strides), converting dtype/device."""
        out.copy_(self._load_as(name, out.dtype, out.device))

    def stored_name(self, name: str) -> str:
        """The name a file of this kind stores the HF tensor ``name`` under (present or not)."""
        return name

    def missing(self, name: str, hint: str = "") -> WeightError:
        near = _nearest(name, self.names())
        stored = self.stored_name(name)
        msg = f"{self.path}: tensor '{name}'" + (f" ('{stored}')" if stored != name else "") + " not found"
        if near:
            msg += f" (closest stored names: {', '.join(near)})"
        if hint:
            msg += f"; {hint}"
        return WeightError(msg)


def _split_expert(name: str) -> tuple[str | None, str | None]:
    base, _, leaf = name.rpartition(".")
    if leaf in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") and base.endswith("experts"):
        return base, leaf
    return None, None


def _nearest(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    import difflib

    return difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.6)
