"""Hugging Face safetensors checkpoints (one file or a folder of shards) as a weight source.

Accepts the layouts found in the wild: transformers 5's fused experts
(``experts.gate_up_proj``), per-expert keys as ``save_pretrained`` writes them
(``experts.E.{gate,up,down}_proj.weight``), and Mixtral's ``block_sparse_moe.experts.E.w{1,2,3}``.
Tensors are read lazily from memory-mapped files, one at a time.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import WeightError
from .source import WeightSource

_PER_EXPERT = re.compile(r"^(?P<base>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _hf_name(key: str) -> str:
    return key.replace(".block_sparse_moe.", ".mlp.")


class SafetensorsSource(WeightSource):
    def __init__(self, path: str | Path):
        p = Path(path)
        self.path = str(p)
        files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
        if not files:
            raise WeightError(f"{p}: no .safetensors files")
        self._handles = []
        self._index: dict[str, tuple[int, str]] = {}  # hf name -> (file idx, key)
        self._experts: dict[str, dict[str, dict[int, tuple[int, str]]]] = {}  # base -> proj -> e -> loc
        for i, f in enumerate(files):
            try:
                h = safe_open(str(f), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise WeightError(f"{f}: not a readable safetensors file ({e})") from None
            self._handles.append(h)
            for key in h.keys():
                m = _PER_EXPERT.match(key)
                if m:
                    base = _hf_name(m["base"])
                    proj = _MIXTRAL_PROJ.get(m["proj"], m["proj"])
                    self._experts.setdefault(base, {}).setdefault(proj, {})[int(m["e"])] = (i, key)
                else:
                    self._index[_hf_name(key)] = (i, key)
        for base, projs in self._experts.items():
            for proj, per in projs.items():
                n = len(per)
                if sorted(per) != list(range(n)):
                    missing = sorted(set(range(max(per) + 1)) - set(per))
                    raise WeightError(f"{self.path}: experts of '{base}' are incomplete for {proj} "
                                      f"(missing expert(s) {missing[:5]})")

    # -- protocol -------------------------------------------------------------------
    def names(self) -> list[str]:
        out = list(self._index)
        for base, projs in self._experts.items():
            out += [f"{base}.{proj}" for proj in projs]
        return out

    def _expert_entry(self, name: str):
        base, _, proj = name.rpartition(".")
        return self._experts.get(base, {}).get(proj)

    def stores_parameter(self, name: str) -> bool:
        return name in self._index  # a key as transformers saved it (per-expert keys are stacked)

    def _has_native(self, name: str) -> bool:
        return name in self._index or self._expert_entry(name) is not None

    def _native_shape(self, name: str) -> tuple[int, ...]:
        if name in self._index:
            i, key = self._index[name]
            return tuple(self._handles[i].get_slice(key).get_shape())
        per = self._expert_entry(name)
        if per is None:
            raise self.missing(name)
        i, key = per[0]
        return (len(per), *self._handles[i].get_slice(key).get_shape())

    def _load_native(self, name: str) -> torch.Tensor:
        if name in self._index:
            i, key = self._index[name]
            return self._read(i, key)
        per = self._expert_entry(name)
        if per is None:
            raise self.missing(name)
        return torch.stack([self._read(*per[e]) for e in range(len(per))])

    def _read(self, i: int, key: str) -> torch.Tensor:
        try:
            return self._handles[i].get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise WeightError(f"{self.path}: cannot read tensor '{key}' ({e})") from None

    def close(self) -> None:
        self._handles.clear()
