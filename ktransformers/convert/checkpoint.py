"""The converter's reader of a Hugging Face safetensors folder: lazy float32 tensors by canonical
transformers 5 names, through the safetensors library or, without torch, numpy."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from ..errors import WeightError
from ..weights.ggml_types import ggml_type_info
from ..weights.quantize import native_quantizer
from ..weights.safetensors_header import read_header


class LightUnsupported(Exception):
    """The light path (no torch, no transformers) cannot vouch for this folder: convert it with transformers."""


class _TorchFiles:
    """Safetensors files through the safetensors library (torch tensors, every stored dtype)."""

    def __init__(self, files: list[Path]):
        from safetensors import safe_open

        self._handles, self.where = {}, {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:
                raise WeightError(f"{f}: unreadable safetensors file ({e})") from e
            self._handles[f] = h
            for k in h.keys():
                self.where[k] = f

    def get(self, key: str, index: int | None = None):
        import torch

        h = self._handles[self.where[key]]
        t = h.get_tensor(key) if index is None else h.get_slice(key)[index]
        return t.to(torch.float32)


class _NumpyFiles:
    """Safetensors files read without torch: the header from :func:`read_header`, the data mapped with numpy.
    Only float32/float16/bfloat16 tensors (others: :class:`LightUnsupported`)."""

    _DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}

    def __init__(self, files: list[Path]):
        self.where, self._info, self._maps = {}, {}, {}
        for f in files:
            header = read_header(f)
            mm = np.memmap(f, dtype=np.uint8, mode="r")
            for k, e in header.items():
                if e.dtype not in self._DTYPES:
                    raise LightUnsupported(f"{k}: dtype {e.dtype}")
                self.where[k] = f
                self._info[k] = (e.dtype, e.shape, e.start, e.end)
                self._maps[k] = mm

    def shape(self, key: str) -> tuple[int, ...]:
        return self._info[key][1]

    def get(self, key: str, index: int | None = None) -> np.ndarray:
        dtype, shape, b0, b1 = self._info[key]
        a = self._maps[key][b0:b1].view(self._DTYPES[dtype]).reshape(shape)
        if index is not None:
            a = a[index]
        if dtype == "F32":
            return np.array(a)
        a = np.ascontiguousarray(a)
        out = np.empty(a.shape, dtype=np.float32)
        ext = native_quantizer()
        if ext is not None:  # F16C / AVX2 conversion, without the GIL
            ext.dequantize(ggml_type_info(dtype).id, a.ctypes.data, a.size, out.ctypes.data)
        elif dtype == "BF16":  # bfloat16 is the top half of a float32
            out[...] = (a.astype(np.uint32) << 16).view(np.float32)
        else:
            out[...] = a
        return out


class Checkpoint:
    """Lazy float32 tensors of an HF safetensors folder, by canonical transformers 5 names.

    Accepts per-expert keys (``experts.E.gate_proj.weight``), fused/stacked keys
    (``experts.gate_up_proj``), Mixtral's original ``block_sparse_moe.experts.E.w1/w2/w3`` and
    DeepSeek-V4's release names (what its ``save_pretrained`` writes; the safetensors source's renamer).
    ``light=True`` reads them as numpy arrays without importing torch (:class:`_NumpyFiles`).
    """

    def __init__(self, path: Path, light: bool = False):
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightError(f"{path}: no .safetensors files")
        self.path = path
        self.files = _NumpyFiles(files) if light else _TorchFiles(files)
        self._where = self.files.where
        self.keys = set(self._where)
        rename = None
        if not light:  # the safetensors source imports torch
            from ..weights.safetensors_source import _release_renamer

            rename = _release_renamer(list(self._where))
        self._renamed = {rename(k): k for k in self._where} if rename else {}

    def _alias(self, name: str) -> str | None:
        if name in self._where:
            return name
        alt = name.replace(".mlp.", ".block_sparse_moe.")
        alt = re.sub(r"\.experts\.(\d+)\.gate_proj\.", r".experts.\1.w1.", alt)
        alt = re.sub(r"\.experts\.(\d+)\.down_proj\.", r".experts.\1.w2.", alt)
        alt = re.sub(r"\.experts\.(\d+)\.up_proj\.", r".experts.\1.w3.", alt)
        if alt in self._where:
            return alt
        for n in (name, alt.replace(".block_sparse_moe.", ".mlp.")):
            if n in self._renamed:
                return self._renamed[n]
        return None

    def has(self, name: str) -> bool:
        return self._alias(name) is not None

    def get(self, name: str):
        key = self._alias(name)
        if key is None:
            raise WeightError(f"{self.path}: tensor '{name}' not found in the checkpoint")
        return self.files.get(key)

    def expert(self, base: str, proj: str, e: int, n_inter: int):
        """One expert's [out, in] matrix of ``proj`` (gate_proj/up_proj/down_proj) below ``base``."""
        per = f"{base}.{e}.{proj}.weight"
        if self.has(per):
            return self.get(per)
        if proj in ("gate_proj", "up_proj") and self.has(f"{base}.gate_up_proj"):
            fused = self.files.get(self._alias(f"{base}.gate_up_proj"), e)
            return fused[:n_inter] if proj == "gate_proj" else fused[n_inter:]
        if self.has(f"{base}.{proj}"):
            return self.files.get(self._alias(f"{base}.{proj}"), e)
        raise WeightError(f"{self.path}: no weights for expert {e} of {base}.{proj}")
