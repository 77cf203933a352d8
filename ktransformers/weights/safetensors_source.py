"""Hugging Face safetensors checkpoints (one file or a folder of shards) as a weight source.

Accepts the layouts found in the wild: transformers 5's fused experts
(``experts.gate_up_proj``), per-expert keys as ``save_pretrained`` writes them
(``experts.E.{gate,up,down}_proj.weight``), and Mixtral's ``block_sparse_moe.experts.E.w{1,2,3}``.
ERNIE-4.5-VL-MoE's release layout (also what ``save_pretrained`` writes for it): transformers'
renamings for the family, each layer's one list of 2E experts split into ``text_moe``'s (the first E)
and ``vision_moe``'s, its two routers (``mlp.gate.weight`` / ``weight_1``, stored ``[hidden, E]``)
transposed, their correction biases (one ``[2, E]`` tensor) split.
DeepSeek-V4's release names (``layers.N.attn.wq_a``, ``ffn.experts.E.w1``, ``hc_attn_fn`` ...; also
what ``save_pretrained`` writes for the family) are mapped to the module names by transformers'
own renamings for the family; its block scales (``<linear>.scale``: FP8 linears, served by fp8.py as
``weight_scale_inv``; ``experts.E.w1.scale``: FP4 experts, stacked as ``experts.gate_proj_scales``
for mxfp4.py).  Tensors are read lazily, one at a time; per-expert tensors are read with ``pread``
straight into the stacked tensor (no file mapping stays resident beside the copy the kernels keep,
which would otherwise double the peak RSS of a bf16 checkpoint's experts).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import WeightError
from .safetensors_header import read_header
from .source import WeightSource

_PER_EXPERT = re.compile(r"^(?P<base>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
                         r"\.(?P<kind>weight|scale)$")
#: stacked name suffix of per-expert block scales (``experts.E.w1.scale`` -> ``experts.gate_proj_scales``)
EXPERT_SCALES = "_scales"
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _hf_name(key: str) -> str:
    return key.replace(".block_sparse_moe.", ".mlp.")


#: a key only the release naming of this family has -> the family's model_type in transformers'
#: checkpoint conversion mapping
_RELEASE_NAMED = {"hc_attn_fn": "deepseek_v4", "mlp.gate.weight_1": "ernie4_5_vl_moe",
                  "mlp.moe_statics.e_score_correction_bias": "ernie4_5_vl_moe",
                  "resampler_model.spatial_linear.0.weight": "ernie4_5_vl_moe"}
#: the stored names by which ERNIE-4.5-VL-MoE's two expert sets are told apart
_ERNIE_VL_MOE_KEYS = (".mlp.gate.weight_1", ".mlp.moe_statics.e_score_correction_bias")
_ERNIE_VL_EXPERT = re.compile(r"^(?P<pre>.*\.mlp)\.experts\.(?P<e>\d+)\.(?P<rest>.*)$")


def _ernie_vl_split(names: dict[str, tuple[int, str]], shape, path) -> dict[str, tuple[int, str, object]]:
    """ERNIE-4.5-VL-MoE's stored MoE tensors (``names``: renamed name -> location) as the module's:
    name -> (file, key, the function of the stored tensor that gives it); ``shape(location)``."""
    out: dict[str, tuple[int, str, object]] = {}
    text_experts: dict[str, int] = {}
    for name, loc in names.items():
        if name.endswith(".mlp.gate.weight") or name.endswith(".mlp.gate.weight_1"):
            if len(shape(loc)) != 2:
                raise WeightError(f"{path}: tensor '{loc[1]}' has shape {list(shape(loc))}, expected "
                                  f"[hidden, experts] (an ERNIE-4.5-VL router)")
            pre = name[: name.rindex(".gate.")]
            moe = "vision_moe" if name.endswith("_1") else "text_moe"
            out[f"{pre}.{moe}.gate.weight"] = (*loc, lambda t: t.t())
            if moe == "text_moe":
                text_experts[pre] = shape(loc)[1]
        elif name.endswith(".mlp.moe_statics.e_score_correction_bias"):
            if len(shape(loc)) != 2 or shape(loc)[0] != 2:
                raise WeightError(f"{path}: tensor '{loc[1]}' has shape {list(shape(loc))}, expected "
                                  f"[2, experts] (ERNIE-4.5-VL's text and vision router biases)")
            pre = name[: name.rindex(".moe_statics.")]
            for row, moe in enumerate(("text_moe", "vision_moe")):
                out[f"{pre}.{moe}.gate.moe_statics.e_score_correction_bias"] = (*loc, lambda t, r=row: t[r:r + 1])
    for name, loc in names.items():
        m = _ERNIE_VL_EXPERT.match(name)
        if m and m["pre"] in text_experts:
            e, n_text = int(m["e"]), text_experts[m["pre"]]
            moe, e = ("text_moe", e) if e < n_text else ("vision_moe", e - n_text)
            out[f"{m['pre']}.{moe}.experts.{e}.{m['rest']}"] = (*loc, None)
    return out


def _release_renamer(keys):
    """A function mapping the checkpoint's keys to module names, when the checkpoint uses the release
    names of a family whose renamings transformers knows; None otherwise."""
    family = next((f for k in keys for tail, f in _RELEASE_NAMED.items() if k.endswith(tail)), None)
    if family is None:
        return None
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    renamings = [t for t in get_checkpoint_conversion_mapping(family) or [] if isinstance(t, WeightRenaming)]
    stored = set(keys)

    def rename(key: str) -> str:
        # the renamings are written for keys without the base model's prefix (``layers.0.attn.norm``
        # but ``norm.weight``), as the release stores them; save_pretrained's keep ``model.``
        bare = key[len("model."):] if key.startswith("model.") else key
        out, _ = rename_source_key(bare, renamings, [])
        out = out if out.startswith(("model.", "lm_head.")) else f"model.{out}"
        if out.endswith(".scale") and key[: -len(".scale")] + ".weight" in stored and not _PER_EXPERT.match(out):
            # an FP8 linear's block scales, under the name fp8.py reads (transformers' FP8 renaming)
            out = out[: -len(".scale")] + ".weight_scale_inv"
        return out

    return rename


class SafetensorsSource(WeightSource):
    def __init__(self, path: str | Path):
        p = Path(path)
        self.path = str(p)
        files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
        if not files:
            raise WeightError(f"{p}: no .safetensors files")
        self._files = files
        self._handles = []
        self._headers: list[dict] = []  # per file: key -> TensorEntry (byte ranges for pread)
        self._fds: dict[int, int] = {}
        self._index: dict[str, tuple[int, str]] = {}  # hf name -> (file idx, key)
        self._experts: dict[str, dict[str, dict[int, tuple[int, str]]]] = {}  # base -> proj -> e -> loc
        for f in files:
            try:
                self._handles.append(safe_open(str(f), framework="pt"))
            except (SafetensorError, OSError, ValueError) as e:
                raise WeightError(f"{f}: not a readable safetensors file ({e})") from None
            self._headers.append(read_header(f))
        self._derived: dict[str, tuple[int, str, object]] = {}  # name -> (file idx, key, fn of the stored tensor)
        rename = _release_renamer([k for h in self._handles for k in h.keys()])
        renamed = {rename(key) if rename else key: (i, key) for i, h in enumerate(self._handles) for key in h.keys()}
        if any(n.endswith(_ERNIE_VL_MOE_KEYS) for n in renamed):  # ERNIE-4.5-VL-MoE's two expert sets
            split = _ernie_vl_split(renamed, lambda loc: self._handles[loc[0]].get_slice(loc[1]).get_shape(),
                                    self.path)
            consumed = {(i, key) for i, key, _ in split.values()}
            renamed = {n: loc for n, loc in renamed.items() if loc not in consumed}
            for name, (i, key, fn) in split.items():
                if fn is None:
                    renamed[name] = (i, key)
                else:
                    self._derived[name] = (i, key, fn)
        for name, (i, key) in renamed.items():
            m = _PER_EXPERT.match(name)
            if m:
                base = _hf_name(m["base"])
                proj = _MIXTRAL_PROJ.get(m["proj"], m["proj"]) + (EXPERT_SCALES if m["kind"] == "scale" else "")
                self._experts.setdefault(base, {}).setdefault(proj, {})[int(m["e"])] = (i, key)
            else:
                self._index[_hf_name(name)] = (i, key)
        for base, projs in self._experts.items():
            for proj, per in projs.items():
                n = len(per)
                if sorted(per) != list(range(n)):
                    missing = sorted(set(range(max(per) + 1)) - set(per))
                    raise WeightError(f"{self.path}: experts of '{base}' are incomplete for {proj} "
                                      f"(missing expert(s) {missing[:5]})")

    # -- protocol -------------------------------------------------------------------
    def names(self) -> list[str]:
        out = list(self._index) + list(self._derived)
        for base, projs in self._experts.items():
            out += [f"{base}.{proj}" for proj in projs]
        return out

    def _expert_entry(self, name: str):
        base, _, proj = name.rpartition(".")
        return self._experts.get(base, {}).get(proj)

    def stores_parameter(self, name: str) -> bool:
        # a key as transformers saved it (per-expert keys are stacked)
        return name in self._index or name in self._derived

    def _has_native(self, name: str) -> bool:
        return name in self._index or name in self._derived or self._expert_entry(name) is not None

    def _native_shape(self, name: str) -> tuple[int, ...]:
        if name in self._derived:
            i, key, fn = self._derived[name]
            return tuple(fn(torch.empty(self._handles[i].get_slice(key).get_shape(), device="meta")).shape)
        if name in self._index:
            i, key = self._index[name]
            return tuple(self._handles[i].get_slice(key).get_shape())
        per = self._expert_entry(name)
        if per is None:
            raise self.missing(name)
        i, key = per[0]
        return (len(per), *self._handles[i].get_slice(key).get_shape())

    def _load_native(self, name: str) -> torch.Tensor:
        if name in self._derived:
            i, key, fn = self._derived[name]
            return fn(self._read(i, key)).contiguous()
        if name in self._index:
            i, key = self._index[name]
            return self._read(i, key)
        return self._load_as(name, None, None)

    def _natural_dtype(self, name: str) -> torch.dtype:
        if name in self._derived:
            i, key = self._derived[name][:2]
        else:
            i, key = self._index[name] if name in self._index else self._first_expert(name)
        dt = _TORCH_DTYPES.get(self._headers[i][key].dtype)
        return dt if dt is not None else self._read(i, key).dtype

    def _first_expert(self, name: str) -> tuple[int, str]:
        per = self._expert_entry(name)
        if per is None:
            raise self.missing(name)
        return per[0]

    def _load_as(self, name: str, dtype: torch.dtype | None, device) -> torch.Tensor:
        if name in self._index or name in self._derived:
            return super()._load_as(name, dtype, device)
        out = torch.empty(self._native_shape(name), dtype=dtype or self._natural_dtype(name))
        self._load_into(name, out)
        return out.to(device) if device is not None else out

    def _load_into(self, name: str, out: torch.Tensor) -> None:
        per = None if name in self._index or name in self._derived else self._expert_entry(name)
        if per is None:
            return super()._load_into(name, out)
        for e in range(len(per)):
            i, key = per[e]
            dst = out[e]
            entry = self._headers[i][key]
            if (dst.device.type == "cpu" and dst.is_contiguous() and _TORCH_DTYPES.get(entry.dtype) == dst.dtype
                    and dst.numel() * dst.element_size() == entry.end - entry.start):
                self._pread(i, entry.start, dst)
            else:  # another dtype or device: converted from a temporary
                dst.copy_(self._read(i, key))

    def _pread(self, i: int, offset: int, dst: torch.Tensor) -> None:
        """Fill the contiguous CPU tensor ``dst`` with the file's bytes from ``offset``."""
        fd = self._fds.get(i)
        if fd is None:
            fd = self._fds[i] = os.open(self._files[i], os.O_RDONLY)
        buf = memoryview(dst.view(torch.uint8).reshape(-1).numpy())
        done = 0
        while done < len(buf):
            try:
                n = os.preadv(fd, [buf[done:]], offset + done)
            except OSError as e:
                raise WeightError(f"{self._files[i]}: cannot read at byte {offset + done} ({e})") from None
            if n <= 0:
                raise WeightError(f"{self._files[i]}: truncated at byte {offset + done}")
            done += n

    def _read(self, i: int, key: str) -> torch.Tensor:
        try:
            return self._handles[i].get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise WeightError(f"{self.path}: cannot read tensor '{key}' ({e})") from None

    def close(self) -> None:
        self._handles.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
