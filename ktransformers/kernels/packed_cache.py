"""Packed expert weights cached on disk: repack once, map afterwards.

The packed MoE backends (``AMXInt8`` / ``AMXBF16`` / ``AMXInt4`` / ``AMXInt4_1``) requantize every
expert when a layer loads: minutes for a full-size model, and a private copy the size of the
packed weights.  :func:`packed_moe` writes each layer's packed copy once into the cache folder
and maps it on later loads (no repacking; the pages are the file's, shared with the page cache).

One file per layer: a 4096-byte header (magic, then JSON) and the packed bytes.  The header
names what the bytes were made from and how -- the source weight file(s) (path, size,
modification time), the layer key, backend, ISA tier (the dequantizers used while packing are
the tier's), the packed layout version, shapes and types -- and carries a 64-bit checksum of the
bytes (``CPUInfer.checksum``: memory speed on the pool).  A file whose header does not match, whose
size is wrong or whose checksum fails is stale or corrupt: it is reported, rebuilt and
replaced, never used.  Files are written to a temporary name and renamed into place, so a crash
leaves no half file behind.

Where: ``KT_PACKED_CACHE`` (a folder; ``0`` turns the cache off), else
``$XDG_CACHE_HOME/ktransformers/packed`` (``~/.cache/...``).  A folder that cannot be written is
reported once and the load goes on without the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from .moe import MoEKernel
from .pool import CPUInfer, isa_tier

log = logging.getLogger("ktransformers.packed_cache")

MAGIC = b"KTPACK1\n"
HEADER = 4096
#: bump when a backend's packed layout changes (csrc/weights.cpp pack_weights)
LAYOUT_VERSION = 1
_warned: set[str] = set()


def cache_dir() -> Path | None:
    """The cache folder, or None when ``KT_PACKED_CACHE=0``."""
    v = os.environ.get("KT_PACKED_CACHE")
    if v is not None and v.strip() in ("0", "", "off", "false"):
        return None
    if v:
        return Path(v).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ktransformers" / "packed"


def source_identity(path: str | os.PathLike) -> list | None:
    """What identifies the source weights: [(resolved path, size, mtime_ns)] of the file, or of the
    weight files of a folder; None when there is no such file."""
    p = Path(path)
    try:
        if p.is_file():
            files = [p]
        elif p.is_dir():
            files = sorted(f for f in p.iterdir() if f.suffix in (".gguf", ".safetensors") and f.is_file())
        else:
            return None
        out = []
        for f in files:
            st = f.stat()
            out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
        return out or None
    except OSError:
        return None


def layer_ident(key: str, backend: str, source_path, num_experts: int, hidden: int, intermediate: int,
                types) -> dict | None:
    """What a layer's cache file must have been made from (its header's fields), or None when the
    source is not a file the cache can identify."""
    src = source_identity(source_path) if source_path else None
    if src is None:
        return None
    return {"format": LAYOUT_VERSION, "key": key, "backend": backend, "tier": isa_tier(), "source": src,
            "shape": [int(num_experts), int(hidden), int(intermediate)],
            "types": [str(getattr(t, "name", t)) for t in types]}


def cached(ident: dict | None) -> bool:
    """Whether the cache holds a file for this layer whose header matches (the memory plan's
    guess; the load also checks size and checksum)."""
    folder = cache_dir()
    if folder is None or ident is None:
        return False
    path = _file_for(folder, ident)
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER)
        n = int.from_bytes(head[len(MAGIC):len(MAGIC) + 4], "little")
        meta = json.loads(head[len(MAGIC) + 4:len(MAGIC) + 4 + n])
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return head.startswith(MAGIC) and isinstance(meta, dict) and all(meta.get(k) == v for k, v in ident.items())


def _file_for(folder: Path, ident: dict) -> Path:
    src = hashlib.sha1(json.dumps(ident["source"]).encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in ident["key"])
    return folder / src / f"{safe}.{ident['backend']}.ktpack"


def _read(path: Path, ident: dict, pool: CPUInfer) -> tuple[np.ndarray | None, str | None]:
    """(packed bytes mapped from ``path``, None) when it is a valid copy for ``ident``, else (None, why)."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER)
        if len(head) < HEADER or not head.startswith(MAGIC):
            return None, "not a packed-weight file"
        n = int.from_bytes(head[len(MAGIC):len(MAGIC) + 4], "little")
        meta = json.loads(head[len(MAGIC) + 4:len(MAGIC) + 4 + n])
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return None, f"unreadable header ({e})"
    if not isinstance(meta, dict):
        return None, "unreadable header (not a JSON object)"
    for k, v in ident.items():
        if meta.get(k) != v:
            return None, f"made for another {k}"
    size = meta.get("packed_bytes")
    if not isinstance(size, int) or path.stat().st_size != HEADER + size:
        return None, "truncated"
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=HEADER, shape=(size,))
    if pool._c.checksum(data.ctypes.data, size) != meta.get("checksum"):
        return None, "checksum mismatch"
    return data, None


def _write(path: Path, ident: dict, data: np.ndarray, pool: CPUInfer) -> None:
    meta = dict(ident, packed_bytes=int(data.nbytes), checksum=pool._c.checksum(data.ctypes.data, int(data.nbytes)))
    body = json.dumps(meta).encode()
    if len(MAGIC) + 4 + len(body) > HEADER:
        raise ValueError("packed cache header too long")
    head = MAGIC + len(body).to_bytes(4, "little") + body
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(head.ljust(HEADER, b"\0"))
            f.write(memoryview(data))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def packed_moe(pool: CPUInfer, backend: str, key: str, source_path, num_experts: int, hidden: int,
               intermediate: int, gate: Any, up: Any, down: Any, gate_type: Any, up_type: Any, down_type: Any,
               **kwargs) -> tuple[MoEKernel, str]:
    """A ``MoEKernel`` on a packed backend, from the cache when it holds a valid copy of this layer
    (else packed now and written there).  Returns (kernel, how: "mapped" | "packed+cached" |
    "packed" | "in place": a ``llamafile_panels`` layer with no weight it packs on this tier);
    the arguments are ``MoEKernel``'s plus the layer ``key`` and the source path."""
    from .moe import packed_weight_bytes

    E, H, I = num_experts, hidden, intermediate
    if not any(packed_weight_bytes(backend, t, E, r, c) for t, r, c in
               ((gate_type, I, H), (up_type, I, H), (down_type, H, I))):
        return MoEKernel(pool, backend, E, H, I, gate, up, down, gate_type, up_type, down_type, **kwargs), "in place"
    folder = cache_dir()
    ident = layer_ident(key, backend, source_path, num_experts, hidden, intermediate, (gate_type, up_type, down_type))
    if folder is None or ident is None:
        return MoEKernel(pool, backend, num_experts, hidden, intermediate, gate, up, down, gate_type, up_type,
                         down_type, **kwargs), "packed"
    path = _file_for(folder, ident)
    if path.exists():
        data, why = _read(path, ident, pool)
        if data is not None:
            try:
                return MoEKernel(pool, backend, num_experts, hidden, intermediate, gate, up, down, gate_type, up_type,
                                 down_type, prepacked=data, **kwargs), "mapped"
            except ValueError as e:
                why = str(e)
        log.warning("%s: packed cache %s is %s; repacking", key, path, why)
    kernel = MoEKernel(pool, backend, num_experts, hidden, intermediate, gate, up, down, gate_type, up_type,
                       down_type, **kwargs)
    try:
        _write(path, ident, kernel.packed_view(), pool)
    except OSError as e:
        if str(folder) not in _warned:
            _warned.add(str(folder))
            log.warning("packed cache %s cannot be written (%s); loading without it", folder, e)
        return kernel, "packed"
    # from now on the file's pages, not a private copy: a full-size first load keeps one layer's
    # packed copy in its own memory at a time (the read also checks what was written)
    data, why = _read(path, ident, pool)
    if data is None:
        log.warning("%s: packed cache %s written but %s; keeping the packed copy in memory", key, path, why)
        return kernel, "packed"
    del kernel
    return MoEKernel(pool, backend, num_experts, hidden, intermediate, gate, up, down, gate_type, up_type,
                     down_type, prepacked=data, **kwargs), "packed+cached"


__all__ = ["cache_dir", "cached", "layer_ident", "packed_moe", "source_identity"]
