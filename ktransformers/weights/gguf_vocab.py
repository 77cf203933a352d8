"""A Hugging Face tokenizer folder as llama.cpp's GGUF vocabulary metadata (for the converter).

Byte-level BPE (``tokenizer.json`` with a BPE model and a ByteLevel pre-tokenizer or decoder:
GPT-2, Qwen, DeepSeek, Llama-3 ...) becomes ``tokenizer.ggml.model = "gpt2"`` with the tokens
by id, their types (normal / control for special added tokens / user-defined for other added
tokens / unused for ids no token has, written ``[PAD<id>]`` as llama.cpp does), the merges, the
pre-tokenizer name when its split pattern is one llama.cpp knows, and the chat template.

A SentencePiece ``tokenizer.model`` (Llama-2, Mistral, Gemma ...) becomes llama.cpp's ``llama``
vocabulary, read with the sentencepiece library: pieces, scores and types (normal / unknown /
control / unused / byte) by id; added tokens of ``added_tokens.json`` and the tokenizer config's
``added_tokens_decoder`` over them (control when special, user-defined otherwise, score -1000);
ids beyond the model's vocabulary padded as unused ``[PAD<id>]`` with score -10000; the special
token ids and the add-BOS/EOS flags as llama.cpp's converter takes them (tokenizer config,
``tokenizer.json``'s post-processor, ``config.json``).  Gemma-3 also says ``add_space_prefix =
false``.  Other tokenizers give None (the converter then writes ``no_vocab``).
"""

from __future__ import annotations

import json
from pathlib import Path

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6
#: added tokens llama.cpp's converter marks as control although the tokenizer does not say special
_LOOKS_SPECIAL = ("<pad>", "<mask>", "<2mass>", "[@BOS@]")


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


#: llama.cpp's pre-tokenizer names and the split regex each stands for (the ones the byte-level BPE
#: tokenizers of the supported families use; transformers' GGUF tokenizer mapping holds the same)
PRE_TOKENIZER_SPLITS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "tekken": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt-4o": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _pre_name(tok_json: dict) -> str:
    """llama.cpp's pre-tokenizer name for the file's split regex ('default' when not one we know)."""
    pats = _split_patterns(tok_json.get("pre_tokenizer"))
    for name, pat in PRE_TOKENIZER_SPLITS.items():
        if pat in pats:
            return name
    return "default"


def tokenizer_metadata(folder: str | Path, vocab_size: int | None = None, arch: str = "") -> dict | None:
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
    _add_chat_template(md, cfg, folder)
    return md


def _add_chat_template(md: dict, cfg: dict, folder) -> None:
    """The folder's chat template (tokenizer_config.json's, else chat_template.jinja) into ``md``."""
    tpl = cfg.get("chat_template")
    jinja = folder / "chat_template.jinja"
    if not tpl and jinja.is_file():
        tpl = jinja.read_text(encoding="utf-8")
    if isinstance(tpl, str) and tpl.strip():
        md["tokenizer.chat_template"] = ("str", tpl)


def _looks_special(tok: str) -> bool:
    return (tok in _LOOKS_SPECIAL or (tok.startswith("<|") and tok.endswith("|>"))
            or (tok.startswith("<\uff5c") and tok.endswith("\uff5c>")) or (tok.startswith("<unused") and tok.endswith(">")))


def _json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _special_ids(folder: Path, tokens: list[str]) -> tuple[dict[str, int], dict[str, bool]]:
    """(special-token ids, add-BOS/EOS flags) the way llama.cpp's converter reads a HF folder:
    the tokenizer config's ``<typ>_token`` looked up among ``tokenizer.json``'s added tokens, then
    ``config.json``'s ``<typ>_token_id``; the flags from a ``TemplateProcessing`` post-processor,
    else the config's ``add_<typ>_token``."""
    tj, cfg = _json(folder / "tokenizer.json"), _json(folder / "tokenizer_config.json")
    hf_cfg = _json(folder / "config.json")
    added = {a.get("content"): a.get("id") for a in tj.get("added_tokens", [])}
    ids: dict[str, int] = {}
    flags: dict[str, bool] = {}
    post = tj.get("post_processor") or {}
    for proc in post.get("processors", [post]) if post else []:
        if proc.get("type") == "TemplateProcessing":
            single = proc.get("single", [])
            if len(single) > 1:
                first = single[0].get("SpecialToken", {}).get("id")
                last = single[-1].get("SpecialToken", {}).get("id")
                if first:
                    flags["bos"] = first == _content(cfg.get("bos_token"))
                if last:
                    flags["eos"] = last == _content(cfg.get("eos_token"))
    for typ in ("bos", "eos", "unk", "pad"):
        v = cfg.get(f"add_{typ}_token")
        if isinstance(v, bool):
            flags.setdefault(typ, v)
        tid = added.get(_content(cfg.get(f"{typ}_token")))
        if tid is None:
            tid = hf_cfg.get(f"{typ}_token_id", (hf_cfg.get("text_config") or {}).get(f"{typ}_token_id"))
        if isinstance(tid, int) and 0 <= tid < len(tokens):
            ids[typ] = tid
    return ids, flags


def _content(v) -> str | None:
    return v.get("content") if isinstance(v, dict) else v if isinstance(v, str) else None


def sentencepiece_metadata(folder: str | Path, vocab_size: int | None = None, arch: str = "") -> dict | None:
    """``{key: (kind, value)}`` of llama.cpp's ``llama`` vocabulary for the folder's SentencePiece
    ``tokenizer.model``, or None when there is none.  ``vocab_size``: the model's row count."""
    folder = Path(folder)
    f = folder / "tokenizer.model"
    if not f.is_file():
        return None
    try:
        from sentencepiece import SentencePieceProcessor
    except ImportError as e:
        from ..errors import ConfigError

        raise ConfigError(f"{f}: reading a SentencePiece tokenizer needs the sentencepiece package "
                          f"(pip install sentencepiece), or convert with --no-tokenizer") from e
    sp = SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(f))
    except Exception as e:
        from ..errors import ConfigError

        raise ConfigError(f"{f}: not a SentencePiece model ({e})") from e
    n = vocab_size or sp.vocab_size()
    tokens = [f"[PAD{i}]" for i in range(n)]
    scores = [-10000.0] * n
    types = [TOKEN_UNUSED] * n
    for i in range(min(n, sp.vocab_size())):
        tokens[i] = sp.IdToPiece(i)
        scores[i] = float(sp.GetScore(i))
        types[i] = (TOKEN_UNKNOWN if sp.IsUnknown(i) else TOKEN_CONTROL if sp.IsControl(i) else
                    TOKEN_UNUSED if sp.IsUnused(i) else TOKEN_BYTE if sp.IsByte(i) else TOKEN_NORMAL)
    for tok, i in _json(folder / "added_tokens.json").items():
        if 0 <= int(i) < n:
            tokens[int(i)], scores[int(i)], types[int(i)] = tok, -1000.0, TOKEN_USER_DEFINED
    cfg = _json(folder / "tokenizer_config.json")
    for i, data in (cfg.get("added_tokens_decoder") or {}).items():
        i, tok = int(i), data["content"]
        if not 0 <= i < n:
            continue
        if data.get("special") or _looks_special(tok):
            types[i] = TOKEN_CONTROL
        else:
            tok = tok.replace("\u2581", " ")  # user-defined spaces are stored pre-normalized
            types[i] = TOKEN_USER_DEFINED
        tokens[i], scores[i] = tok, -1000.0
    md: dict = {
        "tokenizer.ggml.model": ("str", "llama"),
        "tokenizer.ggml.pre": ("str", "default"),
        "tokenizer.ggml.tokens": ("arr", tokens),
        "tokenizer.ggml.scores": ("f32arr", scores),
        "tokenizer.ggml.token_type": ("i32arr", types),
    }
    ids, flags = _special_ids(folder, tokens)
    # a folder that names no special tokens: the SentencePiece model's own (llama.cpp's defaults)
    for typ, tid in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("unk", sp.unk_id()), ("pad", sp.pad_id())):
        if typ not in ids and 0 <= tid < n:
            ids[typ] = tid
    key = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
    for typ, tid in ids.items():
        md[f"tokenizer.ggml.{key[typ]}"] = ("u32", tid)
    for typ in ("bos", "eos"):
        if typ in flags:
            md[f"tokenizer.ggml.add_{typ}_token"] = ("bool", flags[typ])
    if arch == "gemma3":
        md["tokenizer.ggml.add_space_prefix"] = ("bool", False)
    elif isinstance(cfg.get("add_prefix_space"), bool):
        md["tokenizer.ggml.add_space_prefix"] = ("bool", cfg["add_prefix_space"])
    _add_chat_template(md, cfg, folder)
    return md
