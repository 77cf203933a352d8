"""transformers tokenizers from a GGUF file's ``tokenizer.ggml.*`` metadata, cached on disk.

Converting a large vocabulary is slow (Gemma-3's 262k SentencePiece tokens: ~30 s, most of it
rebuilding merges), so the converted tokenizer is saved once under the cache directory, keyed
by a hash of the file's tokenizer metadata, and later starts load that (~1 s on an idle machine).

Memory matters as much as time here: parsing Gemma-3's 262k-token BPE from ``tokenizer.json``
(the ``tokenizers`` JSON path buffers the whole document) peaks ~340 MB above the process's size
before it, for a tokenizer that keeps ~90 MB, more than the model's own weights (~220 MB from the
arrays below).  So a BPE's vocabulary and merges are
cached as arrays (``bpe.npz``: UTF-8 tokens, their ids, merges as token positions) and handed to
``tokenizers.models.BPE`` directly, and the finished backend is given to transformers without the
deep copy it makes of a ``tokenizer_object``.

The cache directory is ``$KT_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/ktransformers`` (default
``~/.cache/ktransformers``); ``KT_CACHE_DIR=off`` disables it.  An unwritable cache is only a
slower start, never an error.

Building: transformers' own GGUF tokenizer conversion where it applies; files it refuses
(architectures its GGUF support lacks, e.g. ``deepseek2``; byte-level vocabularies without
merges) are built from the same transformers builders on the metadata read here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

from ..errors import WeightError

log = logging.getLogger("ktransformers")

#: bump when the way tokenizers are built changes, so old cache entries are not reused
CACHE_FORMAT = 3
_NO_VOCAB = (None, "", "none", "no_vocab")


def cache_root() -> Path | None:
    """Where converted tokenizers are kept, or None when caching is off."""
    env = os.environ.get("KT_CACHE_DIR")
    if env:
        return None if env.lower() in ("off", "0", "none") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ktransformers"


def tokenizer_key(meta: Mapping[str, Any]) -> str:
    """Hash of everything the tokenizer is built from (the ``tokenizer.*`` metadata + architecture)."""
    import numpy as np

    h = hashlib.sha256(f"kt-tokenizer-v{CACHE_FORMAT}\0{meta.get('general.architecture')}\0".encode())
    for key in sorted(k for k in meta if k.startswith("tokenizer.")):
        v = meta[key]
        h.update(key.encode() + b"\0")
        if isinstance(v, (list, tuple)) and v and isinstance(v[0], str):
            h.update("\0".join(v).encode("utf-8", "surrogatepass"))
        elif isinstance(v, (list, tuple)):
            h.update(np.asarray(v).tobytes())
        else:
            h.update(repr(v).encode())
        h.update(b"\1")
    return h.hexdigest()[:32]


def tokenizer_from_gguf(path, meta: Mapping[str, Any]):
    """The tokenizer a GGUF file describes, or None for ``no_vocab`` files (cached, see module doc)."""
    if meta.get("tokenizer.ggml.model") in _NO_VOCAB:
        return None
    root = cache_root()
    entry = root / "tokenizers" / tokenizer_key(meta) if root is not None else None
    if entry is not None and (entry / "kt_tokenizer.json").is_file():
        try:
            tok = _load_cached(entry)
            tok.kt_tokenizer_note = f"from the cache {entry.parent}"
            return tok
        except Exception as e:  # a damaged entry: rebuild it (and replace it below)
            log.warning("cached tokenizer %s unreadable (%s); rebuilding", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    tok = build_tokenizer(path, meta)
    saved = entry is not None and _save(tok, entry)
    # what a start's time went to (local_chat says it): the conversion happens once per vocabulary
    tok.kt_tokenizer_note = ("converted from the GGUF vocabulary, cached for later starts" if saved
                             else "converted from the GGUF vocabulary, not cached (see KT_CACHE_DIR)")
    return tok


_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")


def _load_cached(entry: Path):
    """Rebuild the saved tokenizer fast: the backend without its added tokens (parsing thousands of
    them from JSON takes seconds; adding them afterwards, milliseconds), then those tokens."""
    from tokenizers import AddedToken, Tokenizer

    meta = json.loads((entry / "kt_tokenizer.json").read_text(encoding="utf-8"))
    backend = Tokenizer.from_file(str(entry / "tokenizer.json"))
    if meta.get("bpe") is not None:
        backend.model = _bpe_from_arrays(entry / BPE_ARRAYS, meta["bpe"])
    tok = wrap_backend(backend, **meta["special_tokens"])
    added = [AddedToken(a["content"], single_word=a["single_word"], lstrip=a["lstrip"], rstrip=a["rstrip"],
                        normalized=a["normalized"], special=a["special"]) for a in meta["added_tokens"]]
    tok._tokenizer.add_special_tokens([a for a in added if a.special])
    tok._tokenizer.add_tokens([a for a in added if not a.special])
    if meta.get("chat_template"):
        tok.chat_template = meta["chat_template"]
    for flag in ("add_bos_token", "add_eos_token"):
        if meta.get(flag) is not None and hasattr(tok, flag):
            setattr(tok, flag, meta[flag])
    return tok


def wrap_backend(backend, **kwargs):
    """transformers' fast tokenizer around the ``tokenizers`` object ``backend``, used as it is.

    Passed as ``tokenizer_object`` it would be deep-copied, a JSON round trip of the whole
    vocabulary (for Gemma-3 +130 MB of RSS); a backend already in place when ``__init__`` runs is
    kept."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.__new__(PreTrainedTokenizerFast)
    tok._tokenizer = backend
    tok.__init__(**kwargs)
    return tok


#: the cached BPE vocabulary and merges as arrays (see the module doc)
BPE_ARRAYS = "bpe.npz"
_BPE_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                "byte_fallback", "ignore_merges")


def _bpe_to_arrays(model: dict) -> dict | None:
    """A serialized BPE model's vocabulary and merges as arrays, or None when a merge is not a pair
    of vocabulary tokens (then the entry keeps the JSON form)."""
    import numpy as np

    vocab = model.get("vocab")
    if model.get("type") != "BPE" or not isinstance(vocab, dict):
        return None
    tokens = list(vocab)
    pos = {t: i for i, t in enumerate(tokens)}
    pairs = []
    for m in model.get("merges") or []:
        if not (isinstance(m, list) and len(m) == 2 and m[0] in pos and m[1] in pos):
            return None
        pairs.append((pos[m[0]], pos[m[1]]))
    enc = [t.encode("utf-8") for t in tokens]
    return {"utf8": np.frombuffer(b"".join(enc), np.uint8),
            "lengths": np.fromiter(map(len, enc), np.int32, len(enc)),
            "ids": np.fromiter(vocab.values(), np.int64, len(vocab)),
            "merges": np.asarray(pairs, np.int32).reshape(-1, 2)}


def _bpe_from_arrays(path: Path, options: dict):
    """``tokenizers.models.BPE`` from :func:`_bpe_to_arrays`' arrays (the Python lists live only
    while the Rust model is built)."""
    import numpy as np
    from tokenizers.models import BPE

    with np.load(path, allow_pickle=False) as z:
        utf8, lengths, ids, merges = z["utf8"].tobytes(), z["lengths"], z["ids"].tolist(), z["merges"]
    ends = np.cumsum(lengths, dtype=np.int64)
    if len(ids) != len(lengths) or (len(ends) and ends[-1] != len(utf8)) or (merges.size and (
            merges.min() < 0 or merges.max() >= len(ids))):
        raise ValueError(f"{path.name}: inconsistent arrays")
    tokens = [utf8[a:b].decode("utf-8") for a, b in zip((ends - lengths).tolist(), ends.tolist())]
    vocab = dict(zip(tokens, ids))
    del utf8, ids
    pairs = list(zip(map(tokens.__getitem__, merges[:, 0].tolist()), map(tokens.__getitem__, merges[:, 1].tolist())))
    return BPE(vocab=vocab, merges=pairs, **{k: options[k] for k in _BPE_OPTIONS if options.get(k) is not None})


def _save(tok, entry: Path) -> bool:
    """Write the cache entry atomically: ``tokenizer.json`` without added tokens (and, for a BPE,
    without its vocabulary and merges: those go to ``bpe.npz``) + ``kt_tokenizer.json``.  False
    when the cache is not writable."""
    import numpy as np

    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=entry.parent))
        backend = json.loads(tok.backend_tokenizer.to_str())
        added = backend.pop("added_tokens", [])
        arrays = _bpe_to_arrays(backend.get("model") or {})
        bpe = None
        if arrays is not None:
            np.savez(tmp / BPE_ARRAYS, **arrays)
            bpe = {k: backend["model"][k] for k in _BPE_OPTIONS if k in backend["model"]}
            backend["model"]["vocab"], backend["model"]["merges"] = {}, []
        (tmp / "tokenizer.json").write_text(json.dumps(backend, ensure_ascii=False), encoding="utf-8")
        meta = {"special_tokens": {k: str(getattr(tok, k)) for k in _SPECIAL_NAMES if getattr(tok, k, None)},
                "added_tokens": sorted(added, key=lambda a: a["id"]),
                "chat_template": getattr(tok, "chat_template", None) or None,
                "add_bos_token": getattr(tok, "add_bos_token", None),
                "add_eos_token": getattr(tok, "add_eos_token", None),
                "bpe": bpe}
        (tmp / "kt_tokenizer.json").write_text(json.dumps(meta, ensure_ascii=False), encoding="utf-8")
        try:
            os.replace(tmp, entry)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
        return True
    except OSError as e:
        log.info("not caching the tokenizer in %s: %s", entry.parent, e.strerror or e)
        return False


def build_tokenizer(path, meta: Mapping[str, Any]):
    """Convert the file's vocabulary (no cache): transformers' GGUF path, else our own assembly."""
    p = Path(path)
    model = meta.get("tokenizer.ggml.model")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    except Exception as first:  # transformers raises assorted errors for files it does not cover
        try:
            return _assemble(meta)
        except Exception as e:
            raise WeightError(f"{p}: cannot build a tokenizer from its '{model}' vocabulary "
                              f"({type(first).__name__}: {first}; then {type(e).__name__}: {e})") from e


_DICT_KEYS = {"model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens", "scores": "scores",
              "token_type": "token_type", "merges": "merges", "add_space_prefix": "add_prefix_space"}
_SPECIALS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
             "pad_token": "padding_token_id"}


def _assemble(meta: Mapping[str, Any]):
    """A fast tokenizer from the metadata with transformers' GGUF builders, whatever the architecture."""
    from transformers.integrations.gguf import convert_gguf_tokenizer

    d = {name: meta[f"tokenizer.ggml.{key}"] for key, name in _DICT_KEYS.items() if f"tokenizer.ggml.{key}" in meta}
    if d.get("tokenizer_type") == "gpt2":
        d.setdefault("merges", [])  # a byte-level vocabulary may need no merges at all
    tokens = d["tokens"]
    backend, _ = convert_gguf_tokenizer(str(meta.get("general.architecture", "")), d)
    kw = {}
    for name, key in _SPECIALS.items():
        i = meta.get(f"tokenizer.ggml.{key}")
        if i is not None and 0 <= int(i) < len(tokens):
            kw[name] = tokens[int(i)]
    tok = wrap_backend(backend, **kw)
    for flag in ("add_bos_token", "add_eos_token"):
        v = meta.get(f"tokenizer.ggml.{flag}")
        if v is not None:
            setattr(tok, flag, bool(v))
    tpl = meta.get("tokenizer.chat_template")
    if isinstance(tpl, str) and tpl.strip():
        tok.chat_template = tpl
    return tok

