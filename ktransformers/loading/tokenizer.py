"""The tokenizer of a load: from the model's folder, the weights' folder or the GGUF metadata, with its
chat template."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError
from ..weights.model_config import weights_folder


def _has_tokenizer_files(folder: Path) -> bool:
    return folder.is_dir() and any((folder / f).is_file() for f in
                                   ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"))


def load_tokenizer(model_path: str | os.PathLike | None, source, chat_template: str | None = None):
    """The tokenizer from ``model_path`` when it has one, else the weights' folder, else the GGUF metadata.

    A GGUF chat template fills in for a tokenizer folder without one; ``chat_template`` (a Jinja
    file or a template name, see :mod:`ktransformers.util.chat_templates`) replaces the model's own."""
    folder = Path(model_path) if model_path else weights_folder(source)
    if folder is not None and _has_tokenizer_files(folder):
        from transformers import AutoTokenizer

        try:
            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{folder}: cannot load its tokenizer: {str(e).splitlines()[0]}") from None
        tok.kt_template_origin = f"{folder} (tokenizer_config.json)"
    else:
        get = getattr(source, "tokenizer", None)
        tok = get() if callable(get) else None
        if tok is None:
            where = f"{model_path} has no tokenizer files and " if model_path else ""
            raise ConfigError(f"{where}{source.path} carries no tokenizer; pass --model_path with a tokenizer")
    if not getattr(tok, "chat_template", None):  # GGUF files usually carry the template
        tpl = (getattr(source, "metadata", None) or {}).get("tokenizer.chat_template")
        if isinstance(tpl, str) and tpl.strip():
            tok.chat_template = tpl
            tok.kt_template_origin = f"{source.path} (tokenizer.chat_template)"
    if not hasattr(tok, "kt_template_origin"):
        tok.kt_template_origin = f"{source.path} (tokenizer.chat_template)"
    from ..util.chat_templates import use_chat_template

    use_chat_template(tok, chat_template, getattr(source, "metadata", None))
    from ..util.heap import release_free_heap

    release_free_heap()  # what parsing a large vocabulary freed (~200 MB for a 262k-token BPE)
    return tok
