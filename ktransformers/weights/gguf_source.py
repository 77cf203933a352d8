"""GGUF files (llama.cpp) as a weight source: HF parameter names in, tensors out.

Reading is gguf-py's ``GGUFReader`` (memory-mapped, zero-copy); this module only adds a faster
parse of large metadata arrays (262k-entry vocabularies), turns gguf-py's assorted exceptions into
one-line :class:`WeightError` s that name the file and tensor, and maps names (:mod:`.gguf_names`).

* a file, or a directory; split shards ``*-00001-of-0000N.gguf`` are merged into one namespace
  (pass any shard or the folder);
* tensors by HF name (``model.layers.0.self_attn.q_proj.weight``, stacked experts
  ``model.layers.0.mlp.experts.gate_proj``) or by GGUF name (``blk.0.attn_q.weight``, returned as
  stored: no llama Q/K un-permutation, no gemma norm offset);
* :meth:`GGUFSource.raw` gives the stored bytes (zero-copy ``uint8`` view of the mapping) for kernels
  that compute on quantized data; :meth:`GGUFSource.tensor` dequantizes (torch, any device);
* :meth:`GGUFSource.config` / :meth:`GGUFSource.tokenizer` build transformers objects from metadata.

The file is mapped copy-on-write, so a caller that writes into a returned zero-copy tensor changes
its private copy of that page, never the file (and never faults on a read-only mapping).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from ..errors import WeightError
from . import gguf_names as gn
from .dequant import UnsupportedTypeError, dequantize
from .ggml_types import GGMLType, ggml_type_info
from .source import RawTensor, WeightSource, _split_expert

_SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<i>\d{5})-of-(?P<n>\d{5})\.gguf$")


# ------------------------------------------------------------------------------------ reader


def _reader_class():
    import gguf
    from gguf.constants import GGUFValueType

    class PackedStringsField(gguf.ReaderField):
        """A string-array field whose one data part is the packed array; ``contents()`` as gguf-py's."""

        def contents(self, index_or_slice: int | slice = slice(None)) -> Any:
            return _unpack_strings(self.parts[self.data[0]])[index_or_slice]

    class FastGGUFReader(gguf.GGUFReader):
        """gguf-py's reader, with large metadata arrays parsed in one pass instead of one
        ``_get`` per element (13 s -> well under 1 s on a 262k vocab) and kept as one part each
        (a string array's ``contents()`` decodes it on the call),
        and with errors while building a tensor tagged with the tensor's name."""

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            n = int(alen[0])
            itype = GGUFValueType(int(raw_itype[0]))
            offs = orig_offs + 12
            base = np.asarray(self.data)
            nptype = self.gguf_scalar_to_np.get(itype)
            parts: list = [raw_itype, alen]
            if n == 0:
                return super()._get_field_parts(orig_offs, raw_type)
            if nptype is not None:
                size = np.dtype(nptype).itemsize
                end = offs + n * size
                if end > len(base):
                    raise ValueError(f"metadata array at offset {orig_offs} runs past the end of the file")
                # one part for the whole array (a 262k-entry vocab's scores as 262k one-element
                # views cost ~30 MB of Python objects); field.data still lists it, and both
                # field_value() and gguf-py's contents() flatten the parts it names
                parts.append(base[offs:end].view(nptype))
                return end - orig_offs, parts, [2], [GGUFValueType.ARRAY, itype]
            if itype == GGUFValueType.STRING:
                # one part for the whole array as well (a 262k-token vocabulary and its 515k merges
                # as one view per string held ~40 MB for the life of the source); field_value()
                # walks it.  Here only the bounds are checked, in one pass over the lengths.
                mv = memoryview(base)
                from_bytes = int.from_bytes
                total = len(base)
                for _ in range(n):
                    if offs + 8 > total:
                        raise ValueError(f"metadata string array at offset {orig_offs} runs past the end of the file")
                    slen = from_bytes(mv[offs : offs + 8], "little")
                    if offs + 8 + slen > total:
                        raise ValueError(f"metadata string at offset {offs} runs past the end of the file")
                    offs += 8 + slen
                parts.append(base[orig_offs + 12 : offs].view(_PackedStrings))
                return offs - orig_offs, parts, [2], [GGUFValueType.ARRAY, GGUFValueType.STRING]
            return super()._get_field_parts(orig_offs, raw_type)

        def _push_field(self, field, skip_sum=False):
            if len(field.data) == 1 and isinstance(field.parts[field.data[0]], _PackedStrings):
                field = PackedStringsField(*field)
            return super()._push_field(field, skip_sum)

        def _build_tensors(self, start_offs, fields):
            out = []
            seen = set()
            for f in fields:
                name = bytes(f.parts[1]).decode("utf-8", errors="replace")
                if name in seen:
                    raise _TensorProblem(name, "appears twice in the file")
                seen.add(name)
                try:
                    super()._build_tensors(start_offs, [f])
                except Exception as e:
                    raw_type = int(f.parts[4][0])
                    try:
                        info = ggml_type_info(raw_type)
                    except KeyError:
                        raise _TensorProblem(name, f"has unknown ggml type id {raw_type}") from e
                    try:
                        dims = [int(d) for d in f.parts[3]]
                        n = int(np.prod(dims, dtype=np.int64))
                        nbytes = n // info.block_elems * info.block_bytes
                        end = start_offs + int(f.parts[5][0]) + nbytes
                    except Exception:
                        end = None
                    if end is not None and end > len(self.data):
                        raise _TensorProblem(
                            name, f"data runs past the end of the file ({end} > {len(self.data)} bytes: truncated?)"
                        ) from e
                    raise _TensorProblem(name, f"cannot be mapped ({type(e).__name__}: {e})") from e
                out.extend(self.tensors)
            self.tensors = out

    return FastGGUFReader


class _TensorProblem(Exception):
    def __init__(self, tensor: str, what: str):
        super().__init__(f"tensor '{tensor}' {what}")
        self.tensor = tensor


_READER_CLS = None


def open_reader(path: str | os.PathLike):
    """gguf-py reader for one file (copy-on-write mapping); WeightError with the file name on failure."""
    global _READER_CLS
    if _READER_CLS is None:
        _READER_CLS = _reader_class()
    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError as e:
        raise WeightError(f"{p}: cannot read ({e.strerror})") from e
    if size < 24:
        raise WeightError(f"{p}: not a GGUF file ({size} bytes, too short for a GGUF header)")
    with open(p, "rb") as fh:
        magic = fh.read(4)
    if magic != b"GGUF":
        raise WeightError(f"{p}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        return _READER_CLS(p, mode="c")
    except _TensorProblem as e:
        raise WeightError(f"{p}: {e}") from None
    except Exception as e:  # gguf-py raises ValueError/IndexError/KeyError/... on corrupt headers
        raise WeightError(f"{p}: corrupt or truncated GGUF header ({type(e).__name__}: {e})") from None


class _PackedStrings(np.ndarray):
    """A metadata string array as the file stores it: (u64 length, bytes) repeated (uint8)."""


def _unpack_strings(packed: np.ndarray) -> list[str]:
    buf = packed.view(np.ndarray).tobytes()
    out, offs, end, from_bytes = [], 0, len(buf), int.from_bytes
    while offs < end:
        n = from_bytes(buf[offs : offs + 8], "little")
        out.append(buf[offs + 8 : offs + 8 + n].decode("utf-8", errors="replace"))
        offs += 8 + n
    return out


def field_value(field) -> Any:
    """Python value of a metadata field (str, int, float, bool, or list of those)."""
    from gguf.constants import GGUFValueType

    main = field.types[0] if field.types else None
    if main == GGUFValueType.ARRAY:
        sub = field.types[-1] if len(field.types) > 1 else None
        if sub == GGUFValueType.STRING:
            if len(field.data) == 1 and isinstance(field.parts[field.data[0]], _PackedStrings):
                return _unpack_strings(field.parts[field.data[0]])
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [v for i in field.data for v in field.parts[i].tolist()]
    if main == GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8", errors="replace")
    return field.parts[-1].tolist()[0]


class _Metadata(Mapping[str, Any]):
    """Lazy key -> python value view over the fields of all shards (first shard wins)."""

    def __init__(self, readers):
        self._fields: dict[str, Any] = {}
        for r in readers:
            for k, f in r.fields.items():
                if k.startswith("GGUF."):
                    continue
                self._fields.setdefault(k, f)
        self._cache: dict[str, Any] = {}

    #: arrays longer than this are decoded on each access, not kept (a vocabulary as Python
    #: strings is tens of MB that only the tokenizer's construction reads, once)
    CACHE_MAX_LEN = 4096

    def __getitem__(self, key):
        if key in self._cache:
            return self._cache[key]
        v = field_value(self._fields[key])
        if not isinstance(v, list) or len(v) <= self.CACHE_MAX_LEN:
            self._cache[key] = v
        return v

    def __iter__(self) -> Iterator[str]:
        return iter(self._fields)

    def scalar_items(self) -> Iterator[tuple[str, Any]]:
        """(key, value) of the fields that are not arrays, without decoding the arrays (Gemma-3's
        262k-token vocabulary as Python strings and floats is ~50 MB that a check has no use for)."""
        from gguf.constants import GGUFValueType

        for key, f in self._fields.items():
            if not f.types or f.types[0] != GGUFValueType.ARRAY:
                yield key, self[key]

    def array_len(self, key: str) -> int:
        """Entries of an array field, read from its header (no element is decoded)."""
        from gguf.constants import GGUFValueType

        f = self._fields[key]
        if not f.types or f.types[0] != GGUFValueType.ARRAY:
            raise TypeError(f"metadata '{key}' is not an array")
        return int(f.parts[4][0])  # key length, key, value type, item type, count

    def __len__(self):
        return len(self._fields)


# ------------------------------------------------------------------------------------ source


@dataclass
class _Tensor:
    name: str  # GGUF name
    file: Path
    type: GGMLType  # looked up once, when the file is opened
    shape: tuple[int, ...]  # torch order
    data: np.ndarray  # flat uint8 view into the mapping


class _Entry:
    """How one HF name is served from stored GGUF tensors (``parts``, GGUF names)."""

    #: listed by ``names()`` (False for the tied ``lm_head`` alias)
    listed = True

    def __init__(self, parts: list[str], shape: tuple[int, ...]):
        self.parts = parts
        self.shape = shape

    def load(self, src: "GGUFSource", dtype, device) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def load_into(self, src: "GGUFSource", out: torch.Tensor) -> None:
        out.copy_(self.load(src, out.dtype, out.device))

    def raw(self, src: "GGUFSource", name: str) -> RawTensor | None:
        """Stored bytes, or None where the HF tensor is computed from stored values."""
        return None

    def stored_type(self, src: "GGUFSource") -> int | None:
        """ggml type id of the stored tensor(s), None where computed."""
        return None

    def natural_dtype(self, src: "GGUFSource") -> torch.dtype:
        return src._natural_dtype_of(self.parts[0])


class _Plain(_Entry):
    """One stored tensor, as stored."""

    def load(self, src, dtype, device):
        t = src._tensors[self.parts[0]]
        return src._deq(t, t.data, self.shape, dtype, device)  # the HF shape (gguf_names.hf_shape)

    def load_into(self, src, out):
        t = src._tensors[self.parts[0]]
        if len(self.shape) == 3 and out.dtype.is_floating_point:  # stacked experts: one expert at a time
            per = t.data.size // self.shape[0]
            for e in range(self.shape[0]):
                piece = out[e] if out[e].is_contiguous() else torch.empty_like(out[e])
                src._deq(t, t.data[e * per:(e + 1) * per], self.shape[1:], out.dtype, out.device, out=piece)
                if piece is not out[e]:
                    out[e].copy_(piece)
            return
        super().load_into(src, out)

    def raw(self, src, name):
        t = src._tensors[self.parts[0]]
        return RawTensor(name, t.data, t.type, self.shape)

    def stored_type(self, src):
        return src._tensors[self.parts[0]].type.id


class _Alias(_Plain):
    """``lm_head.weight`` of a tied model: the embedding."""

    listed = False


class _UnpermutedQK(_Plain):
    """llama's ``attn_q`` / ``attn_k``: llama.cpp interleaved the rotary rows per head."""

    def __init__(self, parts, shape, n_head: int, n_head_kv: int):
        super().__init__(parts, shape)
        self.n_head, self.n_head_kv = int(n_head), int(n_head_kv)

    def _order(self) -> torch.Tensor:
        return gn.qk_row_order(self.shape[0], self.n_head, self.n_head_kv)

    def load(self, src, dtype, device):
        w = super().load(src, dtype, device)
        return w[self._order().to(w.device)]

    def raw(self, src, name):
        # whole quantized rows reordered: a copy, but no requantization
        t = src._tensors[self.parts[0]]
        data = t.data.reshape(self.shape[0], -1)[self._order().numpy()].reshape(-1)
        return RawTensor(name, data, t.type, self.shape)


class _FromStored(_Plain):
    """An entry whose value llama.cpp stores transformed: served computed from the stored values
    (read as F32), so it has no raw bytes to hand out and no stored type of its own."""

    def compute(self, stored: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} names no transform")

    def load(self, src, dtype, device):
        t = src._tensors[self.parts[0]]
        return self.compute(src._deq(t, t.data, t.shape, torch.float32, device)).to(dtype)

    def raw(self, src, name):
        return None

    def stored_type(self, src):
        return None  # computed from the stored values, as raw() says

    def natural_dtype(self, src):
        return torch.float32


class _OffsetNorm(_FromStored):
    """gemma3 / qwen3next / qwen35moe norms: llama.cpp stores ``w + 1``."""

    def compute(self, stored):
        return stored - 1.0


class _ALog(_FromStored):
    """qwen3next / qwen35moe ``ssm_a``: llama.cpp stores ``A = -exp(A_log)``; HF holds ``A_log``."""

    def compute(self, stored):
        return torch.log(-stored)


class _VHeadOrder(_Entry):
    """qwen35moe DeltaNet tensors: V heads stored tiled, served grouped per key head
    (``gn.v_head_orders``).  Reordered rows keep their stored bytes; reordered columns (``ssm_out``)
    are computed."""

    def __init__(self, inner: _Entry, dim: int, order: torch.Tensor):
        super().__init__(inner.parts, inner.shape)
        self.inner, self.dim, self.order = inner, dim, order

    def _check(self, src):
        if self.shape[self.dim] != self.order.numel():
            t = src._tensors[self.parts[0]]
            raise WeightError(f"{t.file}: tensor '{t.name}' {list(t.shape)} does not have the "
                              f"{self.order.numel()} {'rows' if self.dim == 0 else 'columns'} the ssm.* metadata implies")

    def load(self, src, dtype, device):
        self._check(src)
        w = self.inner.load(src, dtype, device)
        return w.index_select(self.dim, self.order.to(w.device))

    def raw(self, src, name):
        self._check(src)
        r = self.inner.raw(src, name) if self.dim == 0 else None
        if r is None:
            return None
        rows = r.data.reshape(self.shape[0], -1)[self.order.numpy()].reshape(-1)
        return RawTensor(name, rows, r.type, self.shape)

    def stored_type(self, src):
        return self.inner.stored_type(src) if self.dim == 0 else None

    def natural_dtype(self, src):
        return self.inner.natural_dtype(src)


class _IntTable(_Plain):
    """An integer table (DeepSeek-V4's hash router ``ffn_gate_tid2eid``: llama.cpp stores I32, the
    HF buffer is int64); served as integers whatever float dtype a caller asks for."""

    _NP = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}

    def load(self, src, dtype, device):
        t = src._tensors[self.parts[0]]
        if t.type.name not in self._NP:
            raise WeightError(f"{t.file}: tensor '{t.name}' has ggml type {t.type.name}; an integer table "
                              "is stored I8 / I16 / I32 / I64")
        v = torch.from_numpy(t.data.view(self._NP[t.type.name]).astype(np.int64)).reshape(self.shape)
        return v.to(device) if device is not None else v

    def natural_dtype(self, src):
        return torch.int64


class _FusedQKVZ(_Entry):
    """qwen3next gated DeltaNet: ``attn_qkv`` + ``attn_gate`` rebuild HF's ``in_proj_qkvz`` (rows
    regrouped per key head; whole rows, so quantized bytes are served reordered, not requantized)."""

    def __init__(self, parts, shape, order: torch.Tensor):
        super().__init__(parts, shape)
        self.order = order

    def _check(self, src):
        qkv, z = (src._tensors[p] for p in self.parts)
        if qkv.shape[0] + z.shape[0] != self.order.numel() or qkv.shape[1] != z.shape[1]:
            raise WeightError(f"{qkv.file}: tensors '{qkv.name}' {list(qkv.shape)} and '{z.name}' {list(z.shape)} "
                              f"do not make the {self.order.numel()} rows the ssm.* metadata implies")
        return qkv, z

    def load(self, src, dtype, device):
        qkv, z = self._check(src)
        w = torch.cat([src._deq(t, t.data, t.shape, dtype, device) for t in (qkv, z)])
        return w[self.order.to(w.device)]

    def raw(self, src, name):
        qkv, z = self._check(src)
        if qkv.type != z.type:
            return None
        rows = np.concatenate([t.data.reshape(t.shape[0], -1) for t in (qkv, z)])
        return RawTensor(name, rows[self.order.numpy()].reshape(-1), qkv.type, self.shape)

    def stored_type(self, src):
        qkv, z = (src._tensors[p] for p in self.parts)
        return qkv.type.id if qkv.type == z.type else None

    def natural_dtype(self, src):
        return src._natural_dtype_of(self.parts[0])


class _Stack(_Entry):
    """Per-expert tensors (``blk.L.ffn_gate.E.weight``) stacked into ``[E, ...]``."""

    def load(self, src, dtype, device):
        out = torch.empty(self.shape, dtype=dtype, device=device or "cpu")
        self.load_into(src, out)
        return out

    def load_into(self, src, out):
        for i, p in enumerate(self.parts):
            t = src._tensors[p]
            if tuple(t.shape) != tuple(self.shape[1:]):
                raise WeightError(f"{t.file}: tensor '{t.name}' has shape {list(t.shape)}, expected "
                                  f"{list(self.shape[1:])} for its stack")
            out[i].copy_(src._deq(t, t.data, t.shape, out.dtype, out.device))

    def raw(self, src, name):
        ts = [src._tensors[p] for p in self.parts]
        if len({t.type for t in ts}) != 1:
            return None
        return RawTensor(name, np.concatenate([t.data for t in ts]), ts[0].type, self.shape)

    def stored_type(self, src):
        types = {src._tensors[p].type for p in self.parts}
        return types.pop().id if len(types) == 1 else None  # mixed types: floats, as raw() says


class _SplitKvB(_Entry):
    """DeepSeek split MLA: ``attn_k_b`` + ``attn_v_b`` rebuild ``kv_b_proj``."""

    def load(self, src, dtype, device):
        kt, vt = src._tensors[self.parts[0]], src._tensors[self.parts[1]]
        kb = src._deq(kt, kt.data, kt.shape, torch.float32, device)
        vb = src._deq(vt, vt.data, vt.shape, torch.float32, device)
        if kb.shape[0] != vb.shape[0] or kb.shape[1] != vb.shape[2]:
            raise WeightError(
                f"{kt.file}: tensor '{vt.name}' has shape {list(vb.shape)}, which does not fit "
                f"'{kt.name}' {list(kb.shape)}"
            )
        return gn.kv_b_from_split(kb, vb).to(dtype)


def _resolve_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if not files:
            raise WeightError(f"{path}: no .gguf files in this directory")
        groups: dict[str, list[Path]] = {}
        for f in files:
            m = _SHARD_RE.match(f.name)
            groups.setdefault(m.group("stem") if m else f.name, []).append(f)
        if len(groups) > 1:
            raise WeightError(
                f"{path}: holds several GGUF models ({', '.join(sorted(groups))}); pass the file you mean"
            )
        files = next(iter(groups.values()))
    else:
        m = _SHARD_RE.match(path.name)
        files = sorted(path.parent.glob(f"{m.group('stem')}-*-of-{m.group('n')}.gguf")) if m else [path]
    m = _SHARD_RE.match(files[0].name)
    if m:
        n = int(m.group("n"))
        have = {int(_SHARD_RE.match(f.name).group("i")) for f in files}
        lacking = sorted(set(range(1, n + 1)) - have)
        if lacking:
            raise WeightError(
                f"{files[0].parent}: split GGUF '{m.group('stem')}' lacks shard(s) "
                + ", ".join(f"{i:05d}-of-{n:05d}" for i in lacking)
            )
    return files


def _served_shapes(model: torch.nn.Module):
    """(name, shape) of every tensor the file must serve for ``model``: its parameters, the experts'
    under the stacked names where the module's own layout differs (gpt-oss)."""
    from .experts_layout import ExpertsLayout

    for hf, p in model.state_dict().items():
        base, _, leaf = hf.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj", "gate_up_proj_bias") and base.endswith("experts"):
            layout = ExpertsLayout.of(model.get_submodule(base))
            for name, shape in layout.stacked_shapes(leaf, tuple(p.shape)).items():
                yield f"{base}.{name}", shape
        else:
            yield hf, tuple(p.shape)


class GGUFSource(WeightSource):
    """Weights of a GGUF model (one file, or split shards merged)."""

    def __init__(self, path: str | os.PathLike):
        p = Path(path)
        if not p.exists():
            raise WeightError(f"{p}: no such file or directory")
        self.path = str(p)
        self.files = _resolve_files(p)
        self._readers = [open_reader(f) for f in self.files]
        self.metadata: Mapping[str, Any] = _Metadata(self._readers)
        arch = self.metadata.get("general.architecture")
        if arch is None:
            raise WeightError(f"{self.files[0]}: GGUF metadata lacks 'general.architecture'")
        self.arch = str(arch)
        self._tensors: dict[str, _Tensor] = {}
        for f, r in zip(self.files, self._readers):
            for t in r.tensors:
                if t.name in self._tensors:
                    raise WeightError(f"{f}: tensor '{t.name}' also appears in {self._tensors[t.name].file}")
                shape = tuple(int(d) for d in reversed(t.shape.tolist()))
                data = np.asarray(t.data).reshape(-1).view(np.uint8)
                self._tensors[t.name] = _Tensor(t.name, f, ggml_type_info(int(t.tensor_type)), shape, data)
        from .gguf_checks import check_gguf

        check_gguf(self)  # the header against the file and itself, before anything is sized from it
        self._config = None
        self._entries: dict[str, _Entry] = {}
        self._build_entries()

    # ---------------------------------------------------------------- name table
    def _build_entries(self) -> None:
        arch = self.arch
        try:
            nmap = gn.name_map(arch)
        except KeyError:
            nmap = None  # unknown arch: tensors stay reachable by their GGUF names
        self._nmap = nmap
        md = self.metadata
        n_head = md.get(f"{arch}.attention.head_count")
        n_head_kv = md.get(f"{arch}.attention.head_count_kv", n_head)
        if isinstance(n_head, list):
            n_head = max(n_head)
        if isinstance(n_head_kv, list):
            n_head_kv = max(n_head_kv)
        per_expert: dict[str, dict[int, str]] = {}
        for gname, t in self._tensors.items():
            hf = nmap.gguf_to_hf(gname) if nmap else None
            if hf is None:
                continue
            pe = gn.PER_EXPERT_RE.match(gname)
            if pe:
                virt = f"model.layers.{pe.group(1)}.mlp.experts.{pe.group(2)}_proj"
                per_expert.setdefault(virt, {})[int(pe.group(3))] = gname
                continue
            if arch == "llama" and re.search(r"\.attn_(q|k)\.(weight|bias)$", gname):
                if n_head is None:
                    raise WeightError(f"{t.file}: GGUF metadata lacks '{arch}.attention.head_count'")
                kv = n_head if ".attn_q." in gname else (n_head_kv or n_head)
                self._entries[hf] = _UnpermutedQK([gname], t.shape, n_head, kv)
            elif gn.has_norm_offset(arch, gname):
                self._entries[hf] = _OffsetNorm([gname], t.shape)
            elif arch in gn.LINEAR_ATTN_ARCHS and gname.endswith(".ssm_a"):
                self._entries[hf] = _ALog([gname], t.shape)
            elif t.type.name in _IntTable._NP:
                self._entries[hf] = _IntTable([gname], t.shape)
            else:
                self._entries[hf] = _Plain([gname], gn.hf_shape(gname, t.shape))
        for virt, experts in per_expert.items():
            idx = sorted(experts)
            if idx != list(range(len(idx))):
                t = self._tensors[experts[idx[0]]]
                raise WeightError(f"{t.file}: per-expert tensors of {virt} are not numbered 0..{len(idx) - 1}")
            parts = [experts[i] for i in idx]
            shp = self._tensors[parts[0]].shape
            self._entries[virt] = _Stack(parts, (len(parts), *shp))
        # split MLA (attn_k_b + attn_v_b) -> kv_b_proj
        for gname in self._tensors:
            m = re.match(r"^blk\.(\d+)\.attn_k_b\.weight$", gname)
            if not m:
                continue
            vname = f"blk.{m.group(1)}.attn_v_b.weight"
            hf = f"model.layers.{m.group(1)}.self_attn.kv_b_proj.weight"
            if vname in self._tensors and hf not in self._entries:
                kb, vb = self._tensors[gname].shape, self._tensors[vname].shape  # [H, r, nope], [H, v, r]
                self._entries[hf] = _SplitKvB([gname, vname], (kb[0] * (kb[2] + vb[1]), kb[1]))
        if arch == "qwen3next":
            self._qwen3next_qkvz()
        if arch == "qwen35moe":
            self._qwen35_v_heads()
        if "lm_head.weight" not in self._entries and "model.embed_tokens.weight" in self._entries:
            emb = self._entries["model.embed_tokens.weight"]
            self._entries["lm_head.weight"] = _Alias(list(emb.parts), emb.shape)

    def _ssm_dims(self, t: _Tensor) -> tuple[int, int, int, int]:
        """(key heads, key head size, value heads, value head size) of the DeltaNet ``t`` belongs to."""
        md, arch = self.metadata, self.arch
        dims = {}
        for key in ("ssm.group_count", "ssm.state_size", "ssm.time_step_rank", "ssm.inner_size"):
            v = md.get(f"{arch}.{key}")
            if v is None:
                raise WeightError(f"{t.file}: GGUF metadata lacks '{arch}.{key}'")
            dims[key] = int(v)
        nk, dk, nv = dims["ssm.group_count"], dims["ssm.state_size"], dims["ssm.time_step_rank"]
        if nk <= 0 or nv <= 0 or nv % nk or dims["ssm.inner_size"] % nv:
            raise WeightError(f"{t.file}: '{arch}.ssm.*' metadata (group_count {nk}, time_step_rank {nv}, "
                              f"inner_size {dims['ssm.inner_size']}) does not describe whole heads")
        return nk, dk, nv, dims["ssm.inner_size"] // nv

    def _qwen3next_qkvz(self) -> None:
        """``in_proj_qkvz`` of every DeltaNet layer from its ``attn_qkv`` + ``attn_gate``."""
        for gname, t in self._tensors.items():
            m = re.match(r"^blk\.(\d+)\.attn_qkv\.weight$", gname)
            if not m:
                continue
            zname = f"blk.{m.group(1)}.attn_gate.weight"
            if zname not in self._tensors:
                raise WeightError(f"{t.file}: tensor '{gname}' has no '{zname}' beside it")
            order = gn.qkvz_row_order(*self._ssm_dims(t))
            hf = f"model.layers.{m.group(1)}.linear_attn.in_proj_qkvz.weight"
            self._entries[hf] = _FusedQKVZ([gname, zname], (order.numel(), t.shape[1]), order)

    def _qwen35_v_heads(self) -> None:
        """The DeltaNet tensors whose V heads llama.cpp stored tiled, served in HF's grouped order."""
        orders = None
        for hf, e in list(self._entries.items()):
            m = re.match(r"^model\.layers\.\d+\.(linear_attn\..+)$", hf)
            if not m:
                continue
            if orders is None:
                orders = gn.v_head_orders(*self._ssm_dims(self._tensors[e.parts[0]]))
            if m.group(1) in orders:
                self._entries[hf] = _VHeadOrder(e, *orders[m.group(1)])

    # ---------------------------------------------------------------- protocol
    def names(self) -> list[str]:
        return [n for n, e in self._entries.items() if e.listed]

    def gguf_names(self) -> list[str]:
        return list(self._tensors)

    def gguf_name(self, name: str) -> str | None:
        """The stored GGUF tensor behind an HF name (first part for derived ones), or None."""
        e = self._entries.get(name)
        if e is not None:
            return e.parts[0]
        return name if name in self._tensors else None

    def stored_name(self, name: str) -> str:
        """The GGUF name of an HF name (llama.cpp's, by the name table; the HF name where the
        table has none)."""
        got = self.gguf_name(name)
        if got is not None or self._nmap is None:
            return got or name
        base, leaf = _split_expert(name)
        m = re.match(r"^model\.layers\.(\d+)\.self_attn\.kv_b_proj\.weight$", name)
        if leaf == "gate_up_proj":  # served from two stored tensors: the ones missing
            parts = [self.stored_name(f"{base}.{p}") for p in ("gate_proj", "up_proj")]
        elif m and self.arch in gn.MLA_ARCHS and any(".attn_k_b." in t for t in self._tensors):  # split MLA
            parts = [f"blk.{m.group(1)}.attn_{p}_b.weight" for p in ("k", "v")]
        else:
            return self._nmap.hf_to_gguf(name) or name
        return " + ".join([p for p in parts if p not in self._tensors] or parts)

    def _has_native(self, name: str) -> bool:
        return name in self._entries or name in self._tensors

    def _native_shape(self, name: str) -> tuple[int, ...]:
        e = self._entries.get(name)
        if e is not None:
            return e.shape
        return self._tensors[name].shape

    def _load_native(self, name: str) -> torch.Tensor:
        return self._load_as(name, torch.float32, None)

    def _load_as(self, name: str, dtype, device) -> torch.Tensor:
        """Dequantized straight into ``dtype`` on ``device`` (no float32 intermediate)."""
        dt = dtype or self._natural_dtype(name)
        e = self._entries.get(name)
        if e is None:  # by GGUF name: as stored
            t = self._tensors[name]
            return self._deq(t, t.data, t.shape, dt, device)
        return e.load(self, dt, device)

    def _load_into(self, name: str, out: torch.Tensor) -> None:
        e = self._entries.get(name)
        if e is None:
            return super()._load_into(name, out)
        e.load_into(self, out)

    def raw(self, name: str) -> RawTensor | None:
        """Stored bytes for a kernel: a zero-copy ``uint8`` view of the mapping, ggml type, torch shape.

        Copies only where the stored layout is not the HF one: llama Q/K rows are reordered
        (whole quantized rows, no requantization) and per-expert files are concatenated.  None where
        the HF tensor is computed from stored values (gemma norms, split-MLA ``kv_b_proj``).
        """
        e = self._entries.get(name)
        if e is not None:
            return e.raw(self, name)
        t = self._tensors.get(name)
        return RawTensor(name, t.data, t.type, t.shape) if t is not None else None

    def ggml_type(self, name: str) -> int | None:
        """Stored ggml type id of the tensor behind a name (None for derived tensors)."""
        e = self._entries.get(name)
        if e is None:
            return self._tensors[name].type.id if name in self._tensors else None
        return e.stored_type(self)

    def config(self, dtype: torch.dtype | str = torch.float32):
        """transformers config from the metadata (cached for the default dtype)."""
        from .gguf_config import config_from_metadata

        if self._config is not None and dtype == torch.float32:
            return self._config
        shapes = {n: t.shape for n, t in self._tensors.items()}
        cfg = config_from_metadata(self.metadata, shapes, where=str(self.files[0]), dtype=dtype)
        if dtype == torch.float32:
            self._config = cfg
        return cfg

    def tokenizer(self):
        """transformers tokenizer from the file's vocabulary, or None for ``no_vocab`` files."""
        from .gguf_config import tokenizer_from_gguf

        return tokenizer_from_gguf(self.files[0], self.metadata)

    def validate(self, config=None, model: torch.nn.Module | None = None) -> None:
        """Check every parameter of the HF model built from ``config`` (default: :meth:`config`)
        against the file: a missing tensor or a shape that disagrees raises WeightError naming the
        file and the tensor."""
        if model is None:
            from accelerate import init_empty_weights
            from transformers import AutoModelForCausalLM

            config = config or self.config()
            with init_empty_weights():
                model = AutoModelForCausalLM.from_config(config)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        for hf, want in _served_shapes(model):
            if not self.has(hf):
                if tied and hf == "lm_head.weight":
                    continue
                raise self.missing(hf)
            got = tuple(self.shape(hf))
            if got != want:
                g = self.gguf_name(hf) or self.gguf_name(f"{_split_expert(hf)[0]}.gate_proj") or hf
                t = self._tensors.get(g)
                where = t.file if t is not None else self.path
                raise WeightError(
                    f"{where}: tensor '{g}' ({hf}) has shape {list(got)} but the config expects {list(want)}"
                )

    def describe(self) -> str:
        n = len(self.files)
        return f"GGUFSource({self.path}, arch={self.arch}, {len(self._tensors)} tensors" + (
            f", {n} shards)" if n > 1 else ")"
        )

    def close(self) -> None:
        self._tensors.clear()
        self._entries.clear()
        self._readers = []

    # ---------------------------------------------------------------- loading
    def _natural_dtype(self, name: str) -> torch.dtype:
        e = self._entries.get(name)
        return e.natural_dtype(self) if e is not None else self._natural_dtype_of(name)

    def _natural_dtype_of(self, gguf_name: str) -> torch.dtype:
        tname = self._tensors[gguf_name].type.name
        return {"F16": torch.float16, "BF16": torch.bfloat16}.get(tname, torch.float32)

    def _deq(self, t: _Tensor, data: np.ndarray, shape, dtype, device, out=None) -> torch.Tensor:
        try:
            return dequantize(data, t.type, shape, dtype=dtype, device=device, out=out)
        except UnsupportedTypeError as err:
            raise WeightError(f"{t.file}: tensor '{t.name}' has ggml type {t.type.name}, "
                              "which cannot be dequantized") from err
        except ValueError as err:
            raise WeightError(f"{t.file}: tensor '{t.name}': {err}") from err

    # ---------------------------------------------------------------- extras
    def release(self, name: str) -> None:
        """Drop the mapped pages behind ``name`` from this process's resident set (MADV_DONTNEED).

        For loaders that dequantize a tensor into their own memory and will not read its bytes
        again: the pages stay in the OS page cache, but stop counting towards our RSS.  Views
        handed out earlier stay valid (pages are faulted back in from the file on access).
        """
        import mmap

        e = self._entries.get(name)
        parts = e.parts if e is not None else ([name] if name in self._tensors else [])
        for g in parts:
            t = self._tensors[g]
            reader = self._readers[self.files.index(t.file)]
            mm = getattr(reader.data, "_mmap", None)
            if mm is None or not hasattr(mm, "madvise") or t.data.size == 0:
                continue
            start = t.data.__array_interface__["data"][0] - reader.data.__array_interface__["data"][0]
            page = mmap.PAGESIZE
            lo = -(-start // page) * page
            hi = ((start + t.data.size) // page) * page
            if hi > lo:
                try:
                    mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
                except (OSError, ValueError):
                    pass

    def tensor_info(self) -> list[tuple[str, str, tuple[int, ...], str]]:
        """(GGUF name, ggml type name, torch shape, HF name or '') for every stored tensor."""
        back = {}
        for hf, e in self._entries.items():
            if e.listed and isinstance(e, (_Plain, _Stack)):
                for p in e.parts:
                    back[p] = hf
        return [(n, t.type.name, t.shape, back.get(n, "")) for n, t in self._tensors.items()]
