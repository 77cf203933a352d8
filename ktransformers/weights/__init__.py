"""Weight sources: safetensors directories and GGUF files behind one protocol (see source.py)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError, KTError, WeightError
from .source import EXPERT_PROJS, RawTensor, WeightSource

__all__ = ["EXPERT_PROJS", "RawTensor", "WeightSource", "mmproj_without_gguf", "open_weights", "open_weights_arg"]


def open_weights(path: str | os.PathLike, mmproj: str | os.PathLike | None = None) -> WeightSource:
    """Open a weight file or directory: ``*.gguf`` (split shards merged) or ``*.safetensors``.

    A directory holding both kinds is ambiguous and is refused with a message that says so.
    ``mmproj``: llama.cpp's vision-tower GGUF beside a vision-language model's language-model GGUF
    (read as one image-text model: :mod:`.mmproj`).
    """
    p = Path(path)
    if not p.exists():
        raise WeightError(f"{p}: no such file or directory")
    if mmproj is not None:
        from .mmproj import NO_MMPROJ, GGUFWithMmproj, no_mmproj_format

        model_type = _model_type(p)
        if model_type in NO_MMPROJ:
            raise no_mmproj_format(NO_MMPROJ[model_type], f"--mmproj {mmproj} with {p} ('{model_type}')")
        if not (p.suffix == ".gguf" or p.is_dir() and any(p.glob("*.gguf"))):
            raise WeightError(f"--mmproj {mmproj}: an mmproj goes with a GGUF language model, and {p} is not one")
        return GGUFWithMmproj(p, mmproj)
    if p.is_file():
        if p.suffix == ".gguf":
            from .gguf_source import GGUFSource

            return GGUFSource(p)
        if p.suffix == ".safetensors":
            return _safetensors(p)
        raise WeightError(f"{p}: not a .gguf or .safetensors file")
    ggufs = sorted(p.glob("*.gguf"))
    sts = sorted(p.glob("*.safetensors"))
    if ggufs and sts:
        raise WeightError(
            f"{p}: holds both .gguf and .safetensors files; pass the file (or a folder of one kind) you mean"
        )
    if ggufs:
        from .gguf_source import GGUFSource

        return GGUFSource(p)
    if sts:
        return _safetensors(p)
    raise WeightError(f"{p}: no .gguf or .safetensors files in this directory")


def mmproj_without_gguf(mmproj, model_path) -> KTError:
    """The one-line refusal of ``--mmproj`` given without ``--gguf_path``.  Where ``--model_path``'s
    config is a family llama.cpp has no mmproj format for, that is the error (no GGUF would help);
    otherwise the flag wants the language model's GGUF beside it."""
    model_type = _model_type(Path(model_path)) if model_path else None
    from .mmproj import NO_MMPROJ, no_mmproj_format

    if model_type in NO_MMPROJ:
        return no_mmproj_format(NO_MMPROJ[model_type],
                                f"--mmproj {mmproj} with --model_path {model_path} ('{model_type}')")
    return ConfigError(f"--mmproj {mmproj}: goes with --gguf_path, the language model's GGUF")


def _model_type(p: Path):
    """``model_type`` of a folder's config.json, or None."""
    import json

    try:
        return json.loads((p / "config.json").read_text()).get("model_type") if p.is_dir() else None
    except (OSError, ValueError, AttributeError):
        return None


def _safetensors(p: Path) -> WeightSource:
    """A safetensors source; FP8 block-quantized checkpoints (``*_scale_inv`` tensors, as
    DeepSeek-V3 publishes them) are served dequantized; ``raw()`` gives ops that keep FP8 the weight
    with its scales.  gpt-oss's and DeepSeek-V4's MXFP4 experts are served as ggml MXFP4 (``mxfp4.py``)."""
    from .fp8 import SCALE_SUFFIX, FP8DequantSource
    from .mxfp4 import Mxfp4ExpertsSource, is_mxfp4_checkpoint
    from .safetensors_source import SafetensorsSource

    src = SafetensorsSource(p)
    mxfp4 = is_mxfp4_checkpoint(src)
    if any(n.endswith(SCALE_SUFFIX) for n in src.names()):
        src = FP8DequantSource(src)
    if mxfp4:  # gpt-oss, DeepSeek-V4 as published: MXFP4 experts, served as ggml MXFP4 blocks
        src = Mxfp4ExpertsSource(src)
    return src


def open_weights_arg(weights, mmproj=None):
    """What local_chat and the server load: the ``--gguf_path`` / ``--model_path`` weights as a path,
    or, with ``--mmproj``, the language model and its vision tower opened as one source."""
    return weights if mmproj is None else open_weights(weights, mmproj=mmproj)
