"""Where a model's transformers config comes from: a ``config.json`` (a folder or the file), else
the weights' own metadata (GGUF), else a ``config.json`` beside safetensors weights."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import ConfigError


def load_config(model_path: str | os.PathLike | None, source=None):
    """transformers config from ``model_path/config.json``, else from the weights' metadata."""
    from transformers import AutoConfig

    if model_path:
        p = Path(model_path)
        if not p.exists():
            raise ConfigError(f"{p}: --model_path does not exist")
        cfg_file = p / "config.json" if p.is_dir() else p
        if cfg_file.is_file():
            try:
                json.loads(cfg_file.read_text())
            except json.JSONDecodeError as e:
                raise ConfigError(f"{cfg_file}: not valid JSON ({e})") from None
            try:
                return AutoConfig.from_pretrained(str(cfg_file.parent), local_files_only=True)
            except (ValueError, KeyError, OSError) as e:
                raise ConfigError(f"{cfg_file}: transformers cannot read this config: {e}") from None
        if source is None:
            raise ConfigError(f"{p}: no config.json here, and no weights with metadata were given")
    if source is not None:
        cfg = source.config()
        if cfg is not None:
            return cfg
        folder = weights_folder(source)
        if folder is not None and (folder / "config.json").is_file():
            return load_config(folder)
        raise ConfigError(f"{source.path}: no model config in these weights and no config.json beside them; "
                          "pass model_path (a folder with config.json)")
    raise ConfigError("no model config: pass --model_path (a folder with config.json) or GGUF weights")


def weights_folder(source) -> Path | None:
    """The folder holding non-GGUF weights (a safetensors folder, or a file's folder), or None."""
    from ..weights.gguf_source import GGUFSource

    if source is None or isinstance(source, GGUFSource) or not getattr(source, "path", None):
        return None
    p = Path(source.path)
    return p if p.is_dir() else p.parent
