"""One Hugging Face folder to one GGUF file: config, type policy, tensor plan (light path first),
metadata, vocabulary, writer.

A byte-level BPE ``tokenizer.json`` in the folder is written as llama.cpp's ``gpt2`` vocabulary, a
SentencePiece ``tokenizer.model`` as its ``llama`` vocabulary (Llama and Gemma-3 prefer the latter, as
llama.cpp's converter does); otherwise the file says ``tokenizer.ggml.model = "no_vocab"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ..errors import ConfigError
from ..weights.ggml_types import FILE_TYPES
from .checkpoint import Checkpoint
from .light import LIGHT_MODEL_TYPES, plan_light
from .metadata import metadata_for
from .policy import PresetPolicy, TypePolicy
from .tensor_plan import arch_of, plan
from .writer import write_gguf


def convert(
    model_path: str | Path,
    output: str | Path,
    experts: str = "Q4_K",
    attention: str = "Q8_0",
    default: str = "Q6_K",
    embeddings: str | None = None,
    output_type: str | None = None,
    norms: str = "F32",
    log: Callable[[str], None] | None = None,
    preset: str | None = None,
    progress: bool = False,
    tokenizer: bool = True,
    light: bool = True,
) -> Path:
    """Convert an HF safetensors model folder into one GGUF file; returns the output path.

    ``preset`` (``Q4_K_M``, ``Q6_K``, ...) picks every tensor's type the way llama-quantize does
    for that preset and replaces the per-role types; ``tokenizer`` writes the folder's tokenizer.
    ``light``: convert the :data:`LIGHT_MODEL_TYPES` without importing torch or transformers when the
    folder allows it (the same file either way); False always goes through transformers.
    """
    mp = Path(model_path)
    if not (mp / "config.json").is_file():
        raise ConfigError(f"{mp}: no config.json (expected a Hugging Face model folder)")
    try:
        raw_cfg = json.loads((mp / "config.json").read_text(encoding="utf-8"))
        if not isinstance(raw_cfg, dict):
            raise ValueError("not a JSON object")
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{mp / 'config.json'}: not a valid JSON config ({e})") from e
    policy = None if preset else TypePolicy(experts, attention, default, embeddings, output_type, norms)
    planned = plan_light(mp, raw_cfg, preset, policy) if light and raw_cfg.get("model_type") in LIGHT_MODEL_TYPES \
        else None
    if planned is None:
        config = _transformers_config(mp, raw_cfg)
        text_cfg = config.get_text_config() if config.model_type == "gemma3" else config
        if preset:
            policy = PresetPolicy.for_config(preset, text_cfg, arch_of(config))
        arch, outs = plan(config, Checkpoint(mp), policy)
        md = metadata_for(text_cfg, arch, [o.name for o in outs])
    else:
        text_cfg, policy, arch, outs, md = planned
        if log:
            log("reading the folder without transformers (light path)")
    md["general.name"] = ("str", raw_cfg.get("_name_or_path") or mp.name)
    if preset:
        md["general.file_type"] = ("u32", FILE_TYPES[policy.preset])
    if tokenizer:
        from ..weights.gguf_vocab import sentencepiece_metadata, tokenizer_metadata

        # like llama.cpp's converter: Llama and Gemma take a SentencePiece model before tokenizer.json
        first, second = ((sentencepiece_metadata, tokenizer_metadata) if arch in ("llama", "gemma3")
                         else (tokenizer_metadata, sentencepiece_metadata))
        vocab = first(mp, text_cfg.vocab_size, arch) or second(mp, text_cfg.vocab_size, arch)
        if vocab is not None:
            md.update(vocab)
        elif log:
            log(f"note: {mp} has neither a byte-level BPE tokenizer.json nor a SentencePiece tokenizer.model; "
                f"writing no vocabulary (no_vocab)")
    out = Path(output)
    write_gguf(out, md, outs, log, progress=progress)
    return out


def _transformers_config(mp: Path, raw_cfg: dict):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(mp))
    except Exception as e:
        raise ConfigError(f"{mp / 'config.json'}: cannot be read by transformers ({e})") from e
    if "scoring_func" in raw_cfg and not hasattr(config, "scoring_func"):
        config.scoring_func = raw_cfg["scoring_func"]
    return config
