"""From paths to a ready model: config, weights, default rules, injection — no model hub."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

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
        raise ConfigError(f"{source.path}: no model config in these weights; pass --model_path with a config.json")
    raise ConfigError("no model config: pass --model_path (a folder with config.json) or GGUF weights")


def load_model(
    weights,
    model_path: str | os.PathLike | None = None,
    rules=None,
    *,
    device: str | None = None,
    dtype: torch.dtype | None = None,
    allow_unmatched: bool = True,
    progress: bool = False,
):
    """Build the model for ``weights`` (+ optional config folder), inject ``rules``, load.

    ``rules`` defaults to the shipped rule file for the architecture (the CPU variant when
    there is no CUDA device).  ``device`` is where modules no rule places go.
    """
    from ..optimize.inject import build_model, inject
    from ..optimize_rules import default_rule_file
    from ..weights import WeightSource, open_weights

    source = weights if isinstance(weights, WeightSource) else open_weights(weights)
    config = load_config(model_path, source)
    if dtype is not None:
        config.dtype = dtype
    if rules is None:
        rules = default_rule_file(config)
    device = device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    model = build_model(config, dtype)
    return inject(model, rules, source, default_device=device, allow_unmatched=allow_unmatched, progress=progress)
