"""Prefix cache: KV pages of earlier requests, reused by later requests that start the same way.

A page (``page_size`` token slots in every attention layer of the :class:`PagePool`) is addressed
by a *chain hash*: ``key(page i) = H(key(page i-1), token ids of page i)`` with the chain rooted
in the model fingerprint and the page size, so a key depends on every earlier token and on the
exact model that computed it.  A page holding image tokens hashes its pictures' content digests
too (:func:`image_salts`): their placeholder ids are the same whatever the picture.  Only full
pages are cached.

Three tiers, searched in this order for each page of a prompt:

* **device**: pages of the pool itself.  Pages of finished requests stay indexed here; the cache
  holds one reference (``pool.incref``) on each, in an LRU.  When the pool runs short it calls
  ``pool.on_pressure(n)`` and the cache releases up to ``n`` pages nobody else uses, least
  recently used first, copying each to the RAM tier (or the disk tier without RAM) on the way.
* **RAM**: page payloads (``pool.read_page``) in an LRU of at most ``ram_bytes``; what falls out
  goes to disk.
* **disk**: one safetensors file per page under ``disk_dir``, at most ``disk_bytes`` in all,
  LRU by file mtime so the order survives restarts.  The index is rebuilt from the folder at
  start; files are written by a background thread (a page bound for disk is served from memory
  until its file exists).  See :func:`write_page_file` for the header.  A file that is corrupt, truncated, of
  another format version or of another model is skipped with a warning and deleted.

RAM and disk are inclusive: a page promoted to the device stays in the tier it came from, so
releasing it again costs nothing and the disk tier keeps what the device held at shutdown.  A
disk hit is not also copied into RAM (its pages would be fresh memory, slower to fault in than
the file is to read); it reaches RAM when its device page is released.

Why one file per page: a page is the unit of matching and of eviction, so the disk LRU and the
byte limit are exact, a bad file loses one page only, and two prompts sharing a prefix share its
files.  A page is 0.1–1 MB for the models served here, large enough that open/rename costs are
small next to the write.

Why not ``transformers``' ``compute_block_hash``: its 64-bit per-process key is right for an
in-memory pool, but keys here persist on disk across restarts and models, so they are 128-bit
and rooted in the model fingerprint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from array import array
from collections import OrderedDict
from pathlib import Path
from typing import Callable

import torch

from .settings import Settings

log = logging.getLogger("ktransformers.server")

#: bump when the payload layout, the header or the checksum changes: older files are then
#: skipped and deleted (2: CRC-32 checksum, read as views of the file's bytes)
FORMAT_VERSION = 2
FILE_MAGIC = "ktransformers.kv_page"
FILE_SUFFIX = ".kvpage.safetensors"
#: a safetensors JSON header larger than this is not one of ours (a page's header is a few KiB)
MAX_HEADER_BYTES = 16 << 20
TIERS = ("device", "ram", "disk")

Payload = dict[str, torch.Tensor]

#: defaults of the server flags --prefix_cache_ram_gb and --prefix_cache_disk_gb, as ``Settings``
#: has them (the disk tier is on only with --prefix_cache_dir too)
DEFAULT_RAM_GB = Settings.prefix_cache_ram_gb
DEFAULT_DISK_GB = Settings.prefix_cache_disk_gb


class PageFileError(Exception):
    """A prefix-cache file that must not be loaded (the message says why)."""


# ------------------------------------------------------------------------------- keys


def chain_root(fingerprint: str, page_size: int) -> bytes:
    """The key 'before page 0': ties every key to the model and the page geometry."""
    return hashlib.blake2b(f"ktkv/{FORMAT_VERSION}/{fingerprint}/{page_size}".encode(), digest_size=16).digest()


def page_key(parent: bytes, tokens, salt: bytes = b"") -> bytes:
    """Key of a page from its parent's key, its own token ids (int64, little endian) and its
    ``salt``: what the token ids do not say about the page's K/V (its pictures, :func:`image_salts`;
    empty for text, whose keys are then those of a cache without pictures)."""
    h = hashlib.blake2b(parent, digest_size=16)
    a = array("q", tokens)
    if a.itemsize != 8 or struct.pack("=q", 1) != struct.pack("<q", 1):  # pragma: no cover - exotic platforms
        a = array("q", [int(t) for t in tokens])
        a.byteswap()
    h.update(a.tobytes())
    if salt:  # after a fixed-length token block: no salt can pose as tokens
        h.update(salt)
    return h.digest()


def image_salts(images, page_size: int, n_pages: int) -> list[bytes]:
    """Per page, the salt of its image tokens: for each picture whose token span ``[start, end)``
    meets the page, the picture's content digest and the span.  ``images``: ``[(start, end,
    digest)]`` (multimodal/prompt.py ``VisionInputs.spans``).  An image token's K/V depends on its
    picture's pixels, which its placeholder id does not carry; text before the first picture gets
    no salt, so its pages are those of the same text without pictures."""
    salts = [b""] * n_pages
    for start, end, digest in images or ():
        if not (0 <= start < end) or not isinstance(digest, bytes) or not digest:
            raise ValueError(f"image span [{start}, {end}) with digest {digest!r}: need 0 <= start < end "
                             "and a non-empty bytes digest")
        for i in range(start // page_size, min(n_pages, -(-end // page_size))):
            salts[i] += digest + struct.pack("<qq", start, end)
    return salts


def page_keys(root: bytes, token_ids, page_size: int, n_pages: int, images=None) -> list[bytes]:
    """Keys of the first ``n_pages`` full pages of ``token_ids`` (``images``: :func:`image_salts`)."""
    return _chain(root, token_ids, page_size, image_salts(images, page_size, n_pages))


def _chain(root: bytes, token_ids, page_size: int, salts: list[bytes]) -> list[bytes]:
    keys, parent = [], root
    for i in range(len(salts)):
        parent = page_key(parent, token_ids[i * page_size:(i + 1) * page_size], salts[i])
        keys.append(parent)
    return keys


# ------------------------------------------------------------------------------- fingerprint


def _stable(v):
    """A JSON-able, process-independent view of ``v`` (no ids or memory addresses)."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_stable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _stable(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
    if isinstance(v, (torch.device, torch.dtype)):
        return str(v)
    if isinstance(v, type):
        return f"{v.__module__}.{v.__qualname__}"
    return type(v).__qualname__


def _file_identity(p: Path) -> dict:
    """Name, size, mtime and a hash of the first and last MiB: cheap, and a re-written file differs."""
    st = p.stat()
    h = hashlib.sha256()
    with open(p, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read(1 << 20))
    return {"name": p.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256_ends": h.hexdigest()}


def _weight_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(q for q in path.iterdir() if q.is_file() and q.suffix in (".gguf", ".safetensors"))
    return []


def _plan_identity(model) -> dict | None:
    """What the rules resolved to (operator, devices, kwargs per module) + the rule files' text."""
    plan = getattr(model, "kt_plan", None)
    if plan is None:
        return None
    placements = []
    for name in sorted(plan.placements):
        p = plan.placements[name]
        placements.append([name, p.operator_name, str(p.generate_device), str(p.prefill_device),
                           p.generate_op, p.prefill_op, _stable(p.kwargs)])
    sources = {}
    for r in plan.rules:
        src = Path(str(r.source))
        if str(r.source) not in sources and src.is_file():
            sources[str(r.source)] = hashlib.sha256(src.read_bytes()).hexdigest()
    return {"placements": hashlib.sha256(json.dumps(placements).encode()).hexdigest(),
            "rule_files": sorted(sources.values())}


def model_fingerprint(model, weights_path, *, cache_dtype: torch.dtype | str | None = None) -> str:
    """A hex id of everything that decides a page's K/V values: architecture, config, weight
    files, the injected operators (rule file), the cache dtype and the page format.  Pages made
    under another fingerprint are never reused (keys differ; foreign disk files are deleted)."""
    from .. import __version__

    cfg = getattr(model, "config", None)
    cfg_dict = cfg.to_dict() if cfg is not None and hasattr(cfg, "to_dict") else {}
    cfg_dict.pop("transformers_version", None)
    if cache_dtype is None:
        cache_dtype = getattr(model, "dtype", None) or cfg_dict.get("dtype") or cfg_dict.get("torch_dtype")
    weights = [_file_identity(p) for p in _weight_files(Path(weights_path))] if weights_path else []
    parts = {
        "page_format": FORMAT_VERSION,
        "ktransformers": __version__,
        "architecture": _stable(getattr(cfg, "architectures", None) or type(model).__qualname__),
        "config": hashlib.sha256(json.dumps(_stable(cfg_dict), sort_keys=True).encode()).hexdigest(),
        "weights": weights,
        "rules": _plan_identity(model),
        "cache_dtype": str(cache_dtype),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


# ------------------------------------------------------------------------------- page files


def payload_nbytes(payload: Payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())


def payload_checksum(payload: Payload) -> str:
    """CRC-32 over the tensors in name order (name, dtype, shape, raw bytes).

    It guards against damage (a torn write, a bad disk, a truncated copy), not against an
    adversary, so a CRC is enough: zlib's runs at ~4 GB/s and releases the GIL, where SHA-256
    took a third of a disk hit's time."""
    crc = 0
    for name in sorted(payload):
        t = payload[name].detach().contiguous().cpu()
        crc = zlib.crc32(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode(), crc)
        if t.numel():
            crc = zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), crc)  # the buffer itself, no copy
    return f"crc32:{crc:08x}"


def write_page_file(path: Path, payload: Payload, *, fingerprint: str, page_size: int, key: bytes,
                    parent: bytes, tokens, salt: bytes = b"") -> int:
    """Write one page atomically (temporary file + rename: a crash leaves no half file under
    ``path``); returns its size.

    The file is safetensors: its JSON header lists every tensor's dtype, shape and offsets, and
    its ``__metadata__`` holds ``format`` (the magic, ``ktransformers.kv_page``),
    ``format_version``, ``fingerprint``, ``page_size``, ``key`` / ``parent`` (hex chain keys),
    ``tokens`` (the page's token ids, JSON), ``salt`` (hex, only on a page with image tokens: see
    :func:`page_key`) and ``checksum`` (:func:`payload_checksum`).  No
    fsync: after a power loss a file may hold garbage, which the checksum catches at load.
    """
    from safetensors.torch import save

    meta = {"format": FILE_MAGIC, "format_version": str(FORMAT_VERSION), "fingerprint": fingerprint,
            "page_size": str(page_size), "key": key.hex(), "parent": parent.hex(),
            "tokens": json.dumps([int(t) for t in tokens]), "checksum": payload_checksum(payload)}
    if salt:
        meta["salt"] = salt.hex()
    data = save({k: v.detach().contiguous().cpu() for k, v in payload.items()}, metadata=meta)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return len(data)


def _parse_header(head: bytes, file_size: int) -> dict:
    """The safetensors header of a page file; raises PageFileError on anything off."""
    if len(head) < 8:
        raise PageFileError("truncated (no header)")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER_BYTES or 8 + n > file_size:
        raise PageFileError("truncated or not a page file (header length out of range)")
    if len(head) < 8 + n:
        raise PageFileError("truncated (header cut short)")
    try:
        header = json.loads(head[8:8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise PageFileError("not a page file (header is not JSON)") from None
    if not isinstance(header, dict) or not isinstance(header.get("__metadata__"), dict):
        raise PageFileError("not a page file (no metadata)")
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise PageFileError(f"not a page file (tensor '{name}' has no offsets)") from None
    if 8 + n + end != file_size:
        raise PageFileError(f"truncated or padded: {file_size} bytes, header says {8 + n + end}")
    return header


def check_page_header(header: dict, *, fingerprint: str, page_size: int, key: bytes | None = None) -> dict:
    """The metadata of a parsed header, after checking magic, version, model, geometry and key."""
    meta = header["__metadata__"]
    if meta.get("format") != FILE_MAGIC:
        raise PageFileError("not a page file (format field)")
    if meta.get("format_version") != str(FORMAT_VERSION):
        raise PageFileError(f"format version {meta.get('format_version')} (this build reads {FORMAT_VERSION})")
    if meta.get("fingerprint") != fingerprint:
        raise PageFileError(f"made by another model (fingerprint {str(meta.get('fingerprint'))[:12]}…, "
                            f"this model {fingerprint[:12]}…)")
    if meta.get("page_size") != str(page_size):
        raise PageFileError(f"page size {meta.get('page_size')} (this cache uses {page_size})")
    try:
        tokens = json.loads(meta["tokens"])
        parent = bytes.fromhex(meta["parent"])
        stored_key = bytes.fromhex(meta["key"])
        salt = bytes.fromhex(meta.get("salt", ""))
    except (KeyError, ValueError, TypeError):
        raise PageFileError("metadata lacks tokens/parent/key (or has a bad salt)") from None
    if not isinstance(tokens, list) or len(tokens) != page_size:
        raise PageFileError("metadata tokens do not fill one page")
    if page_key(parent, tokens, salt) != stored_key or (key is not None and stored_key != key):
        raise PageFileError("key does not match the page's tokens (renamed or tampered file)")
    return meta


#: safetensors dtype names of the tensors a page may hold
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8}


def _views(buf: bytearray, header: dict) -> Payload:
    """The header's tensors as views of ``buf`` (no copy): a page is loaded only to be copied into
    the pool, so safetensors' own deserialize would copy every byte once more for nothing."""
    base = 8 + struct.unpack_from("<Q", buf)[0]
    payload: Payload = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            start, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise PageFileError(f"tensor '{name}': bad dtype, shape or offsets") from None
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if min(shape, default=0) < 0 or start < 0 or end - start != numel * itemsize or start % itemsize:
            raise PageFileError(f"tensor '{name}': offsets {start}..{end} do not hold {shape} {info['dtype']}")
        if numel == 0:
            payload[name] = torch.empty(shape, dtype=dtype)
        else:
            payload[name] = torch.frombuffer(buf, dtype=dtype, count=numel, offset=base + start).view(shape)
    return payload


def read_page_file(path: Path, *, fingerprint: str, page_size: int, key: bytes) -> Payload:
    """Load and verify one page file; raises PageFileError (or OSError) rather than return garbage.
    The tensors are read-write views of one buffer holding the file."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        if f.readinto(buf) != size:
            raise PageFileError("truncated (file shrank while read)")
    header = _parse_header(buf, size)
    meta = check_page_header(header, fingerprint=fingerprint, page_size=page_size, key=key)
    payload = _views(buf, header)
    if payload_checksum(payload) != meta.get("checksum"):
        raise PageFileError("checksum mismatch (corrupt payload)")
    return payload


# ------------------------------------------------------------------------------- the cache


def cache_limits(ram_gb: float | None = None, disk_dir: str | os.PathLike | None = None,
                 disk_gb: float | None = None) -> dict:
    """:class:`PrefixCache` keyword arguments from the server flags (GiB -> bytes); a bad value
    is a one-line ConfigError naming its flag."""
    from ..errors import ConfigError

    ram_gb = DEFAULT_RAM_GB if ram_gb is None else ram_gb
    disk_gb = DEFAULT_DISK_GB if disk_gb is None else disk_gb
    for flag, v in (("--prefix_cache_ram_gb", ram_gb), ("--prefix_cache_disk_gb", disk_gb)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (0 <= v < 1 << 20):
            raise ConfigError(f"{flag} {v!r}: must be a number of GiB, 0 or more (0 = tier off)")
    if disk_dir:
        p = Path(disk_dir)
        if p.exists() and not p.is_dir():
            raise ConfigError(f"--prefix_cache_dir {disk_dir}: exists and is not a directory")
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--prefix_cache_dir {disk_dir}: cannot create it ({e.strerror})") from None
        if not os.access(p, os.W_OK | os.X_OK):
            raise ConfigError(f"--prefix_cache_dir {disk_dir}: not writable")
    return {"ram_bytes": int(ram_gb * 2**30), "disk_dir": str(disk_dir) if disk_dir else None,
            "disk_bytes": int(disk_gb * 2**30) if disk_dir else 0}


class _TierStats:
    __slots__ = ("hits", "misses", "tokens")

    def __init__(self):
        self.hits = self.misses = self.tokens = 0


class PrefixCache:
    """Longest-prefix reuse of KV pages over the device pool, host RAM and disk (see module doc).

    Thread-safe (one re-entrant lock): the engine thread matches and inserts while /health and
    /metrics read :meth:`stats`; the pool's pressure callback re-enters from inside ``alloc``.
    """

    def __init__(self, pool, *, fingerprint: str, page_size: int, ram_bytes: int = 0,
                 disk_dir: str | os.PathLike | None = None, disk_bytes: int = 0):
        if page_size < 1:
            raise ValueError(f"page_size {page_size}: must be at least 1")
        if getattr(pool, "page_size", page_size) != page_size:
            raise ValueError(f"page_size {page_size} differs from the pool's {pool.page_size}")
        self.pool = pool
        self.fingerprint = fingerprint
        self.page_size = int(page_size)
        self.ram_bytes = max(0, int(ram_bytes))
        self.disk_dir = Path(disk_dir) if disk_dir and disk_bytes > 0 else None
        self.disk_bytes = max(0, int(disk_bytes)) if self.disk_dir else 0
        self._root = chain_root(fingerprint, self.page_size)
        self._lock = threading.RLock()
        self._device: OrderedDict[bytes, int] = OrderedDict()  # key -> pool page (LRU: oldest first)
        self._page_key: dict[int, bytes] = {}
        self._ram: OrderedDict[bytes, Payload] = OrderedDict()
        self._ram_used = 0
        self._disk: OrderedDict[bytes, int] = OrderedDict()  # key -> file size
        self._disk_used = 0
        self._pending: dict[bytes, Payload] = {}  # bound for disk, file not written yet
        self._writes: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self._meta: dict[bytes, tuple[bytes, tuple, bytes]] = {}  # key -> (parent key, tokens, salt), for spills
        self._page_bytes: int | None = getattr(pool, "page_bytes", None)
        self._tiers = {t: _TierStats() for t in TIERS}
        self.lookups = 0
        self.lookup_tokens = 0
        self.matched_tokens = 0
        self.dropped_files = 0
        self.evicted = {t: 0 for t in TIERS}
        self._previous_pressure: Callable[[int], int] | None = getattr(pool, "on_pressure", None)
        pool.on_pressure = self.release
        if self.disk_dir is not None:
            self._scan_disk()
            # files are written off the engine thread: a page costs ~10 ms to serialise and write
            self._writer = threading.Thread(target=self._write_loop, name="kt-prefix-disk", daemon=True)
            self._writer.start()

    # ---- public ------------------------------------------------------------------------
    def match(self, token_ids, images=None, *, count: bool = True) -> tuple[list[int], int, dict]:
        """Longest cached prefix of full pages, leaving at least one token to prefill.  ``images``:
        the prompt's pictures, ``[(start, end, digest)]`` (:func:`image_salts`): a page with image
        tokens matches only a page made with the same pictures at the same places.  ``count=False``:
        a lookup again for a request already counted (one waiting for pages), left out of :meth:`stats`.

        Returns ``(pages, n_tokens, {"device": n, "ram": n, "disk": n})``: pool pages holding the
        first ``n_tokens`` tokens, each incref'd for the caller (release them with the sequence).
        RAM and disk hits are copied into freshly allocated pool pages; if the pool has no page
        left for one, the match stops there."""
        from_tier = {t: 0 for t in TIERS}
        n_max = max(0, (len(token_ids) - 1) // self.page_size)
        tally = self._tiers if count else {t: _TierStats() for t in TIERS}
        with self._lock:
            if count:
                self.lookups += 1
                self.lookup_tokens += len(token_ids)
            salts = image_salts(images, self.page_size, n_max)
            keys = _chain(self._root, token_ids, self.page_size, salts)
            pages: list[int] = []
            parent = self._root
            for i, key in enumerate(keys):
                page = self._device.get(key)
                if page is not None:
                    self.pool.incref(page)
                    tier = "device"
                else:
                    tally["device"].misses += 1
                    page, tier = self._promote(key, parent, token_ids[i * self.page_size:(i + 1) * self.page_size],
                                               salts[i], tally)
                    if page is None:
                        break
                pages.append(page)
                from_tier[tier] += 1
                tally[tier].hits += 1
                tally[tier].tokens += self.page_size
                parent = key
            self._touch(keys[:len(pages)])
            n = len(pages) * self.page_size
            if count:
                self.matched_tokens += n
        return pages, n, from_tier

    def insert(self, token_ids, pages, images=None) -> None:
        """Index the full pages of a sequence: ``pages`` hold the K/V of ``token_ids`` in order
        (pass exactly the tokens whose K/V are written, e.g. ``runner.seq_len`` of them; a token
        sampled but not yet run through the model must not be included), before the sequence
        releases them.  Pages already cached under the same key keep the existing copy; new ones
        are incref'd by the cache.  Call it (and :meth:`match`) from the one thread that drives
        the pool: the pool calls back into :meth:`release` from ``alloc``.  ``images``: as for
        :meth:`match`."""
        n = min(len(token_ids) // self.page_size, len(pages))
        with self._lock:
            salts = image_salts(images, self.page_size, n)
            keys = _chain(self._root, token_ids, self.page_size, salts)
            parent = self._root
            for i, (key, page) in enumerate(zip(keys, pages)):
                self._meta.setdefault(key, (parent, tuple(token_ids[i * self.page_size:(i + 1) * self.page_size]),
                                            salts[i]))
                parent = key
                if key in self._device or page in self._page_key:
                    continue
                self.pool.incref(page)
                self._device[key] = page
                self._page_key[page] = key
                if self._page_bytes is None:  # once, for the device tier's byte count
                    self._page_bytes = payload_nbytes(self.pool.read_page(page))
            self._touch(keys)

    def release(self, n: int) -> int:
        """Give up to ``n`` device pages back to the pool, least recently used first (the pool's
        ``on_pressure``).  Pages a running sequence still uses are skipped when the pool can say
        so (``pool.refcount``).  Each released page is kept in the RAM (else disk) tier."""
        released = 0
        with self._lock:
            refcount = getattr(self.pool, "refcount", None)
            for key in list(self._device):
                if released >= n:
                    break
                page = self._device[key]
                if refcount is not None and refcount(page) > 1:
                    continue
                self._spill_from_device(key, page)
                del self._device[key]
                del self._page_key[page]
                before = self.pool.free_count()
                self.pool.decref(page)
                self.evicted["device"] += 1
                self._forget_if_gone(key)
                if refcount is not None or self.pool.free_count() > before:
                    released += 1
        if released < n and self._previous_pressure is not None:
            released += self._previous_pressure(n - released)
        return released

    def clear_device(self) -> int:
        """Release every device page the cache holds (spilling as :meth:`release` does)."""
        with self._lock:
            return self.release(len(self._device))

    def close(self) -> None:
        """At shutdown: write what the RAM and device tiers hold to the disk tier (least recent
        first, so the file mtimes keep the LRU order), release the device pages, wait for the
        files to be written and unhook from the pool.  Without a disk tier the cached pages are
        simply released."""
        with self._lock:
            if self.disk_dir is not None:
                for key, payload in list(self._ram.items()):
                    self._disk_put(key, payload)
                for key, page in list(self._device.items()):
                    if key not in self._disk:
                        payload = {k: v.detach().to("cpu", copy=True) for k, v in self.pool.read_page(page).items()}
                        self._disk_put(key, payload)
            self.clear_device()
            if getattr(self.pool, "on_pressure", None) == self.release:
                self.pool.on_pressure = self._previous_pressure
            writer, self._writer = self._writer, None
        if writer is not None:
            self._writes.put(None)
            writer.join()

    def flush(self) -> None:
        """Wait until every page bound for disk is written (do not call with the lock held)."""
        if self._writer is not None:
            self._writes.join()

    @property
    def device_pages(self) -> int:
        """Pool pages the cache holds a reference on."""
        return len(self._device)

    def stats(self) -> dict:
        """Counters for /health and /metrics: per tier hits / misses (pages), tokens served,
        pages and bytes resident, capacity; overall lookups and tokens matched."""
        with self._lock:
            page_bytes = self._page_bytes
            resident = {"device": (len(self._device), None if page_bytes is None else len(self._device) * page_bytes),
                        "ram": (len(self._ram), self._ram_used), "disk": (len(self._disk), self._disk_used)}
            capacity = {"device": None, "ram": self.ram_bytes, "disk": self.disk_bytes}
            tiers = {t: {"hits": s.hits, "misses": s.misses, "tokens": s.tokens, "pages": resident[t][0],
                         "bytes": resident[t][1], "capacity_bytes": capacity[t], "evicted": self.evicted[t]}
                     for t, s in self._tiers.items()}
            return {"page_size": self.page_size, "lookups": self.lookups, "lookup_tokens": self.lookup_tokens,
                    "matched_tokens": self.matched_tokens, "dropped_files": self.dropped_files,
                    "pending_writes": len(self._pending), "tiers": tiers}

    # ---- tiers -------------------------------------------------------------------------
    def _touch(self, keys: list[bytes]) -> None:
        """Mark a chain used, leaf first, so eviction takes a chain's tail before its head
        (a page is only reachable through its parents).  Disk files get increasing mtimes in
        the same order, so the LRU order survives a restart."""
        now = time.time_ns()
        for key in reversed(keys):
            if key in self._device:
                self._device.move_to_end(key)
            if key in self._ram:
                self._ram.move_to_end(key)
            if key in self._disk:
                self._disk.move_to_end(key)
                now += 1000
                try:
                    os.utime(self._path(key), ns=(now, now))
                except OSError:
                    pass

    def _forget_if_gone(self, key: bytes) -> None:
        if key not in self._device and key not in self._ram and key not in self._disk and key not in self._pending:
            self._meta.pop(key, None)

    def _promote(self, key: bytes, parent: bytes, tokens, salt: bytes,
                 tally: dict[str, _TierStats]) -> tuple[int | None, str]:
        """A RAM or disk copy of ``key`` written into a new pool page (held by the caller and indexed);
        misses counted in ``tally``."""
        payload, tier = self._ram.get(key), "ram"
        if payload is None:
            tally["ram"].misses += 1
            payload, tier = self._load_disk(key), "disk"
            if payload is None:
                tally["disk"].misses += 1
                return None, "disk"
        try:
            page = self.pool.alloc()
        except Exception as e:  # OutOfPages: every page is busy; prefill the rest instead
            if not any(c.__name__ == "OutOfPages" for c in type(e).__mro__):
                raise
            return None, tier
        self.pool.write_page(page, payload)
        # a disk hit is not kept in RAM here: its buffer would be fresh memory for every page,
        # and faulting it in cost more than reading the file; releasing the page spills it
        self._meta.setdefault(key, (parent, tuple(tokens), salt))
        self.pool.incref(page)
        self._device[key] = page
        self._page_key[page] = key
        return page, tier

    def _spill_from_device(self, key: bytes, page: int) -> None:
        if key in self._ram or (not self.ram_bytes and (self.disk_dir is None or key in self._disk
                                                          or key in self._pending)):
            return
        payload = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in self.pool.read_page(page).items()}
        if self._page_bytes is None:
            self._page_bytes = payload_nbytes(payload)
        if self.ram_bytes:
            self._ram_put(key, payload)
        else:
            self._disk_put(key, payload)

    def _ram_put(self, key: bytes, payload: Payload) -> None:
        size = payload_nbytes(payload)
        if key in self._ram:
            self._ram.move_to_end(key)
            return
        if size > self.ram_bytes:
            self._disk_put(key, payload)
            return
        self._ram[key] = payload
        self._ram_used += size
        while self._ram_used > self.ram_bytes:
            old_key, old = self._ram.popitem(last=False)
            self._ram_used -= payload_nbytes(old)
            self.evicted["ram"] += 1
            self._disk_put(old_key, old)
            self._forget_if_gone(old_key)

    # ---- disk --------------------------------------------------------------------------
    def _path(self, key: bytes) -> Path:
        return self.disk_dir / f"{key.hex()}{FILE_SUFFIX}"

    def _drop_file(self, path: Path, why: str) -> None:
        log.warning("prefix cache: skipping and deleting %s: %s", path, why)
        self.dropped_files += 1
        try:
            path.unlink()
        except OSError as e:
            log.warning("prefix cache: could not delete %s (%s)", path, e.strerror)

    def _disk_put(self, key: bytes, payload: Payload) -> None:
        """Queue ``payload`` (owned by the cache: never a view of a pool page) for the disk tier."""
        if self.disk_dir is None or key in self._disk or key in self._pending or key not in self._meta:
            return
        if payload_nbytes(payload) > self.disk_bytes:
            return
        self._pending[key] = payload
        if self._writer is None:  # closed: write here
            self._write_one(key)
        else:
            self._writes.put(key)

    def _write_loop(self) -> None:
        while True:
            key = self._writes.get()
            try:
                if key is None:
                    return
                self._write_one(key)
            except Exception:  # never let the writer die: the page simply stays off disk
                log.exception("prefix cache: writing a page failed")
                with self._lock:
                    self._pending.pop(key, None)
            finally:
                self._writes.task_done()

    def _write_one(self, key: bytes) -> None:
        with self._lock:
            payload, meta = self._pending.get(key), self._meta.get(key)
        size = None
        if payload is not None and meta is not None:
            try:
                size = write_page_file(self._path(key), payload, fingerprint=self.fingerprint,
                                       page_size=self.page_size, key=key, parent=meta[0], tokens=meta[1],
                                       salt=meta[2])
            except OSError as e:
                log.warning("prefix cache: could not write a page under %s (%s); disk tier skipped for it",
                            self.disk_dir, e.strerror or e)
        with self._lock:
            self._pending.pop(key, None)
            if size is not None:
                self._disk[key] = size
                self._disk_used += size
                self._evict_disk()
            self._forget_if_gone(key)

    def _evict_disk(self) -> None:
        while self._disk_used > self.disk_bytes and self._disk:
            key, size = self._disk.popitem(last=False)
            self._disk_used -= size
            self.evicted["disk"] += 1
            self._path(key).unlink(missing_ok=True)
            self._forget_if_gone(key)

    def _load_disk(self, key: bytes) -> Payload | None:
        if key in self._pending:  # spilled, not written yet
            return self._pending[key]
        if key not in self._disk:
            return None
        path = self._path(key)
        try:
            payload = read_page_file(path, fingerprint=self.fingerprint, page_size=self.page_size, key=key)
        except (PageFileError, OSError) as e:
            self._disk_used -= self._disk.pop(key)
            self._drop_file(path, str(e) if isinstance(e, PageFileError) else f"unreadable ({e})")
            self._forget_if_gone(key)
            return None
        if self._page_bytes is None:
            self._page_bytes = payload_nbytes(payload)
        return payload

    def _scan_disk(self) -> None:
        """Rebuild the disk index from the folder: headers checked (not payloads: the checksum is
        verified when a page is loaded), oldest mtime first; leftovers of interrupted writes removed."""
        self.disk_dir.mkdir(parents=True, exist_ok=True)
        found = []
        for path in self.disk_dir.iterdir():
            name = path.name
            if name.startswith(".") and name.endswith(".tmp") and FILE_SUFFIX in name:
                path.unlink(missing_ok=True)  # an interrupted write
                continue
            if not name.endswith(FILE_SUFFIX) or not path.is_file():
                continue
            try:
                key = bytes.fromhex(name[:-len(FILE_SUFFIX)])
                if len(key) != 16:
                    raise ValueError
            except ValueError:
                self._drop_file(path, "not named by a page key")
                continue
            try:
                st = path.stat()
                with open(path, "rb") as f:
                    head = f.read(8)
                    if len(head) == 8:
                        (n,) = struct.unpack("<Q", head)
                        head += f.read(min(n, MAX_HEADER_BYTES))
                header = _parse_header(head, st.st_size)
                meta = check_page_header(header, fingerprint=self.fingerprint, page_size=self.page_size, key=key)
            except PageFileError as e:
                self._drop_file(path, str(e))
                continue
            except OSError as e:
                self._drop_file(path, f"unreadable ({e.strerror or e})")
                continue
            found.append((st.st_mtime_ns, key, st.st_size, bytes.fromhex(meta["parent"]),
                          tuple(json.loads(meta["tokens"])), bytes.fromhex(meta.get("salt", ""))))
        for _, key, size, parent, tokens, salt in sorted(found):
            self._disk[key] = size
            self._disk_used += size
            self._meta[key] = (parent, tokens, salt)
        self._evict_disk()
        if found:
            log.info("prefix cache: %d page(s), %.1f MiB on disk under %s", len(self._disk),
                     self._disk_used / 2**20, self.disk_dir)
