"""A Hugging Face tokenizer folder as llama.cpp's GGUF vocabulary metadata (for the converter).

Byte-level BPE (``tokenizer.json`` with a BPE model and a ByteLevel pre-tokenizer or decoder:
GPT-2, Qwen, DeepSeek, Llama-3 ...) becomes ``tokenizer.ggml.model = "gpt2"`` with the tokens
by id, their types (normal / control for special added tokens / user-defined for other added
tokens / unused for ids no token has, written ``[PAD<id>]`` as llama.cpp does), the merges, the
pre-tokenizer name when its split pattern is one llama.cpp knows, and the chat template.
Other tokenizers give None (the converter then writes ``no_vocab``).
"""

from __future__ import annotations

import json
from pathlib import Path

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


def _uses_byte_level(node) -> bool:
    if isinstance(node, dict):
        if node.get("type") == "ByteLevel":
            return True
        return any(_uses_byte_level(v) for v in node.values())
    if isinstance(node, list):
        return any(_uses_byte_level(v) for v in node)
    return False


def _split_patterns(node) -> list[str]:
    out = []
    if isinstance(node, dict):
        if node.get("type") == "Split" and isinstance(node.get("pattern"), dict):
            pat = node["pattern"].get("Regex") or node["pattern"].get("String")
            if pat:
                out.append(pat)
        for v in node.values():
            out += _split_patterns(v)
    elif isinstance(node, list):
        for v in node:
            out += _split_patterns(v)
    return out


def _pre_name(tok_json: dict) -> str:
    """llama.cpp's pre-tokenizer name for the file's split regex ('default' when not one we know)."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        return "default"
    pats = _split_patterns(tok_json.get("pre_tokenizer"))
    for name in ("qwen2", "llama-bpe", "tekken", "gpt-4o"):  # the canonical name of each pattern
        if GGUF_PRE_TOKENIZER_SPLITS.get(name) in pats:
            return name
    return "default"


def tokenizer_metadata(folder: str | Path, vocab_size: int | None = None) -> dict | None:
    """``{key: (kind, value)}`` for the converter's writer, or None when the folder has no
    byte-level BPE ``tokenizer.json``.  ``vocab_size``: the model's row count (ids beyond the
    tokenizer are padded)."""
    folder = Path(folder)
    f = folder / "tokenizer.json"
    if not f.is_file():
        return None
    tj = json.loads(f.read_text(encoding="utf-8"))
    model = tj.get("model") or {}
    if model.get("type") != "BPE" or not (_uses_byte_level(tj.get("pre_tokenizer")) or _uses_byte_level(tj.get("decoder"))):
        return None
    by_id: dict[int, str] = {int(i): t for t, i in model.get("vocab", {}).items()}
    types: dict[int, int] = {i: TOKEN_NORMAL for i in by_id}
    for a in tj.get("added_tokens", []):
        by_id[int(a["id"])] = a["content"]
        types[int(a["id"])] = TOKEN_CONTROL if a.get("special") else TOKEN_USER_DEFINED
    n = max(vocab_size or 0, max(by_id) + 1 if by_id else 0)
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n)]
    ttypes = [types.get(i, TOKEN_UNUSED) for i in range(n)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    md: dict = {
        "tokenizer.ggml.model": ("str", "gpt2"),
        "tokenizer.ggml.pre": ("str", _pre_name(tj)),
        "tokenizer.ggml.tokens": ("arr", tokens),
        "tokenizer.ggml.token_type": ("arr", ttypes),
    }
    if merges:
        md["tokenizer.ggml.merges"] = ("arr", merges)
    cfg_file = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
    ids = {t: i for i, t in by_id.items()}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("pad_token", "padding_token_id"),
                      ("unk_token", "unknown_token_id")):
        v = cfg.get(name)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str) and v in ids:
            md[f"tokenizer.ggml.{key}"] = ("u32", ids[v])
    md["tokenizer.ggml.add_bos_token"] = ("bool", bool(cfg.get("add_bos_token", False)))
    tpl = cfg.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if not tpl and jinja.is_file():
        tpl = jinja.read_text(encoding="utf-8")
    if isinstance(tpl, str) and tpl.strip():
        md["tokenizer.chat_template"] = ("str", tpl)
    return md
