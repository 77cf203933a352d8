"""gpt-oss checkpoints as published: routed experts in MXFP4 (``quant_method: mxfp4``).

The safetensors hold, per experts module, ``gate_up_proj_blocks [E, 2I, H/32, 16]`` (uint8, two
e2m1 codes a byte: element 2j in the low nibble, 2j+1 in the high one) with ``gate_up_proj_scales
[E, 2I, H/32]`` (E8M0 exponents, value = code * 2^(e - 127)), gate and up rows interleaved; and
``down_proj_blocks [E, H, I/32, 16]`` / ``down_proj_scales``.  Rows are in the stacked ``[out, in]``
order already.

DeepSeek-V4 as published: per-expert ``experts.E.w{1,2,3}.weight`` ``int8 [rows, cols/2]`` (the same
e2m1 pairs a byte) with ``experts.E.w{1,2,3}.scale`` ``[rows, cols/32]`` (E8M0, one per 32 elements);
the safetensors source stacks them as ``<experts>.gate_proj`` and ``<experts>.gate_proj_scales``.

:class:`Mxfp4ExpertsSource` serves them under the stacked names of ``source.py`` as ggml ``MXFP4``
blocks (``e | qs[16]``, element j in the low nibble of ``qs[j]``, j + 16 in its high nibble: the
same codes and exponent, the nibbles reordered), so ``KExpertsCPU`` computes on them in place of a
bf16 copy; ``tensor()`` dequantizes them.  The interleaved ``gate_up_proj_bias`` is served as
``gate_proj_bias`` / ``up_proj_bias``; everything else passes through.
"""

from __future__ import annotations

import torch

from ..errors import WeightError
from .ggml_types import ggml_type_info
from .source import RawTensor, WeightSource

BLOCKS, SCALES = "_blocks", "_scales"
_MXFP4 = ggml_type_info("MXFP4")
_PACKED = tuple(f".experts.{p}{SCALES}" for p in ("gate_proj", "up_proj", "down_proj"))


def is_mxfp4_checkpoint(source: WeightSource) -> bool:
    return any(n.endswith((".experts.gate_up_proj" + BLOCKS, *_PACKED)) for n in source.names())


def _exponents(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales as their exponent bytes (a float8_e8m0fnu tensor's bits, not its value)."""
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    return scales.view(torch.uint8) if e8m0 is not None and scales.dtype == e8m0 else scales.to(torch.uint8)


def ggml_mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``[..., G, 16]`` packed codes + ``[..., G]`` exponents (the checkpoint's layout) -> ggml MXFP4
    bytes ``[..., G * 17]``."""
    b = blocks.view(torch.uint8) if blocks.dtype == torch.int8 else blocks.to(torch.uint8)
    codes = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(*b.shape[:-1], 32)  # element order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    out = torch.cat((_exponents(scales).unsqueeze(-1), qs), dim=-1)
    return out.reshape(*b.shape[:-2], b.shape[-2] * 17).contiguous()


class Mxfp4ExpertsSource(WeightSource):
    """A safetensors source of an MXFP4 checkpoint (gpt-oss, DeepSeek-V4), its experts under the
    stacked names."""

    def __init__(self, inner: WeightSource):
        self.inner = inner
        self.path = inner.path
        # stacked name -> (blocks name, rows: all / even / odd; packed: [E, rows, cols/2] codes)
        self._experts: dict[str, tuple[str, str]] = {}
        for n in inner.names():
            if n.endswith(_PACKED) and not inner.has(n[: -len(SCALES)] + BLOCKS):  # not gpt-oss's blocks + scales
                if not inner.has(n[: -len(SCALES)]):
                    raise WeightError(f"{self.path}: '{n}' has no '{n[: -len(SCALES)]}' beside it")
                self._experts[n[: -len(SCALES)]] = (n[: -len(SCALES)], "packed")
                continue
            if not n.endswith(BLOCKS) or ".experts." not in n:
                continue
            base, _, leaf = n[: -len(BLOCKS)].rpartition(".")
            if not inner.has(n[: -len(BLOCKS)] + SCALES):
                raise WeightError(f"{self.path}: '{n}' has no '{n[: -len(BLOCKS)] + SCALES}' beside it")
            if leaf == "gate_up_proj":
                self._experts[f"{base}.gate_proj"] = (n, "even")
                self._experts[f"{base}.up_proj"] = (n, "odd")
            elif leaf == "down_proj":
                self._experts[f"{base}.down_proj"] = (n, "all")
            else:
                raise WeightError(f"{self.path}: MXFP4 tensor '{n}' is not a gpt-oss expert projection")

    # -- the stacked expert projections ------------------------------------------------------
    def _bytes(self, name: str) -> tuple[torch.Tensor, tuple[int, int, int]]:
        blocks_name, rows = self._experts[name]
        if rows == "packed":
            blocks, scales = self.inner.tensor(name), self.inner.tensor(name + SCALES)
            if blocks.dim() != 3 or scales.dim() != 3 or blocks.shape[-1] * 2 != scales.shape[-1] * 32 \
                    or blocks.shape[:2] != scales.shape[:2] or blocks.element_size() != 1:
                raise WeightError(f"{self.path}: '{name}' {list(blocks.shape)} {blocks.dtype} with scales "
                                  f"{list(scales.shape)} is not packed e2m1 [E, rows, cols/2] + [E, rows, cols/32]")
            E, R, G = scales.shape
            return ggml_mxfp4_blocks(blocks.reshape(E, R, G, 16), scales), (E, R, G * 32)
        blocks = self.inner.tensor(blocks_name)
        scales = self.inner.tensor(blocks_name[: -len(BLOCKS)] + SCALES)
        if blocks.dim() != 4 or blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
            raise WeightError(f"{self.path}: '{blocks_name}' {list(blocks.shape)} with scales {list(scales.shape)} "
                              f"is not the MXFP4 layout [E, rows, cols/32, 16] + [E, rows, cols/32]")
        if rows != "all":
            sl = slice(0, None, 2) if rows == "even" else slice(1, None, 2)
            blocks, scales = blocks[:, sl], scales[:, sl]
        E, R, G, _ = blocks.shape
        return ggml_mxfp4_blocks(blocks, scales), (E, R, G * 32)

    def ggml_type(self, name: str) -> int | None:
        """The stored ggml type id of ``name`` without reading or converting a tensor (the plan decides
        formats by it): MXFP4 for the stacked expert projections, else the inner source's."""
        if name in self._experts:
            return _MXFP4.id
        probe = getattr(self.inner, "ggml_type", None)
        if callable(probe):
            return probe(name)
        raw = self.inner.raw(name)
        return raw.type.id if raw is not None and raw.type is not None else None

    def raw(self, name: str) -> RawTensor | None:
        if name not in self._experts:
            return self.inner.raw(name)
        data, shape = self._bytes(name)
        return RawTensor(name, data.reshape(-1), _MXFP4, shape)

    # -- protocol ------------------------------------------------------------------------------
    def names(self) -> list[str]:
        hidden = {n for n in self.inner.names() if n.endswith((BLOCKS, SCALES)) and ".experts." in n}
        hidden |= set(self._experts)  # listed once, below
        biases = [n.replace("gate_up_proj_bias", p) for n in self.inner.names() if n.endswith(".experts.gate_up_proj_bias")
                  for p in ("gate_proj_bias", "up_proj_bias")]
        return [n for n in self.inner.names() if n not in hidden] + list(self._experts) + biases

    def _split_bias(self, name: str):
        for p, sl in (("gate_proj_bias", slice(0, None, 2)), ("up_proj_bias", slice(1, None, 2))):
            if name.endswith(".experts." + p):
                fused = name[: -len(p)] + "gate_up_proj_bias"
                if self.inner.has(fused):
                    return fused, sl
        return None

    def _has_native(self, name: str) -> bool:
        base, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj" and f"{base}.gate_proj" in self._experts:
            return False  # derived by the base class from the dequantized gate and up stacks
        return name in self._experts or self._split_bias(name) is not None or self.inner.has(name)

    def _native_shape(self, name: str) -> tuple[int, ...]:
        if name in self._experts:
            blocks_name, rows = self._experts[name]
            if rows == "packed":
                E, R, half = self.inner.shape(name)
                return (E, R, 2 * half)
            E, R, G, _ = self.inner.shape(blocks_name)
            return (E, R if rows == "all" else R // 2, G * 32)
        sb = self._split_bias(name)
        if sb is not None:
            E, two_i = self.inner.shape(sb[0])
            return (E, two_i // 2)
        return self.inner.shape(name)

    def _load_native(self, name: str) -> torch.Tensor:
        if name in self._experts:
            from .dequant import dequantize

            data, shape = self._bytes(name)
            return dequantize(data, _MXFP4, shape)
        sb = self._split_bias(name)
        if sb is not None:
            return self.inner.tensor(sb[0])[:, sb[1]].contiguous()
        return self.inner.tensor(name)

    def stores_parameter(self, name: str) -> bool:
        return name not in self._experts and self._split_bias(name) is None and self.inner.stores_parameter(name)

    def close(self) -> None:
        self.inner.close()
