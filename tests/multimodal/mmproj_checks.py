"""What the mmproj GGUF tests share (test_mmproj.py: Qwen3-VL's ``qwen3vl_merger``,
test_mmproj_glm4v.py: GLM-4.5V's ``glm4v``): the logit bounds, the two files read against the
folder they were written from (config, vision tensors, image processor, logits with a rounded
tower, the server's load),
llama.cpp's own converter run on the tiny folder and compared with the test's writer, and the
metadata fuzz harness, each file passing its projector type's keys."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ktransformers import load_model
from ktransformers.errors import WeightError
from ktransformers.multimodal.processor import load_processor
from ktransformers.weights import open_weights
from ktransformers.weights.gguf_source import GGUFSource

from .vl_checks import chat_inputs, rel

#: logits vs transformers', relative to max |logit| (measured on Qwen3-VL, one picture / two): F32
#: files 5.8e-7 / 3.9e-7 (the safetensors load's own figures: the same bits), F16 mmproj 3.5e-4 /
#: 3.3e-4, Q8_0 mmproj 7.8e-3 / 8.3e-3 (the vision tower's weights rounded; a blank picture moves them by 0.7)
TOL = {"f32": 1e-4, "f16": 2e-3, "q8_0": 2e-2}
#: llama.cpp's sources (``KT_LLAMA_CPP``, else the tree vendored by llama-cpp-python where one is found)
LLAMA_CPP = Path(os.environ.get("KT_LLAMA_CPP") or next(
    (p for p in ("/root/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp",
                 "/root/peers/llama_cpp_python-0.3.36/vendor/llama.cpp") if Path(p).is_dir()), "llama.cpp"))
needs_llama_cpp = pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                                     reason="llama.cpp's sources not found")
#: keys llama.cpp's converter does not write (the releases' files lack them; the readers fall back)
PIXEL_BOUNDS = ("clip.vision.image_min_pixels", "clip.vision.image_max_pixels")

_CONVERT = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[1]); sys.path.insert(1, sys.argv[1] + "/gguf-py")
import gguf, torch
import convert_hf_to_gguf as conv
from conversion import ModelBase, ModelType
d = Path(sys.argv[2])
cls = conv.get_model_class(conv.get_model_architecture(ModelBase.load_hparams(d, False), ModelType.MMPROJ), mmproj=True)
with torch.inference_mode():
    cls(d, {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[sys.argv[4]], Path(sys.argv[3])).write()
"""


def one_line(excinfo) -> str:
    """The message of ``pytest.raises``' exception, checked to be one line."""
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def check_config_is_the_folders(lm: Path, mmproj: Path, folder: Path) -> None:
    """The config built from the two files' metadata is ``folder``'s config.json, key for key (floats
    within 1e-6: the epsilons are stored as F32)."""
    from transformers import AutoConfig

    got = open_weights(lm, mmproj=mmproj).config().to_dict()
    want = AutoConfig.from_pretrained(folder).to_dict()
    for part in ("vision_config", "text_config"):
        for k, v in want[part].items():
            if k in ("dtype", "transformers_version"):
                continue
            assert got[part][k] == pytest.approx(v, rel=1e-6) if isinstance(v, float) else got[part][k] == v, (part, k)
    for k, v in want.items():
        if k not in ("vision_config", "text_config", "dtype", "transformers_version", "_name_or_path"):
            assert got[k] == v, k


def check_quantized_logits(lm: Path, mmproj: Path, q: str, tok, processor, hf) -> None:
    """The logits with a ``q`` mmproj within ``TOL[q]`` of transformers' (max |logit|), a tolerance far
    below what a blank picture moves them by (the picture is read, not ignored)."""
    inputs = chat_inputs(tok, processor)
    with torch.no_grad():
        got = load_model(lm, mmproj=mmproj, allow_unmatched=False)(**inputs).logits
        want = hf(**inputs).logits
        blank = hf(**dict(inputs, pixel_values=torch.zeros_like(inputs["pixel_values"]))).logits
    assert rel(got, want) < TOL[q]
    assert rel(blank, want) > 10 * TOL[q]


def check_vision_tensors_bitwise(lm: Path, mmproj: Path, folder: Path) -> None:
    """Every ``model.visual.*`` tensor of the two files is ``folder``'s bit for bit (the patch
    convolution put back together from its two halves), none more or fewer, and the source validates."""
    from safetensors.torch import load_file

    src = open_weights(lm, mmproj=mmproj)
    sd = load_file(next(Path(folder).glob("*.safetensors")))
    visual = {k: v for k, v in sd.items() if k.startswith("model.visual.")}
    assert sorted(n for n in src.names() if n.startswith("model.visual.")) == sorted(visual)
    for k, v in visual.items():
        assert torch.equal(src.tensor(k), v), k
    src.validate()


def check_same_inputs(tok, processor, other) -> None:
    """``other`` processor gives ``processor``'s model inputs (pixels, grid, tokens) bit for bit."""
    a, b = chat_inputs(tok, processor), chat_inputs(tok, other)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def check_processor_from_the_mmproj(lm: Path, mmproj: Path, tok, processor) -> None:
    """Without a folder, the processor the mmproj describes gives the folder's pixels and tokens."""
    src = open_weights(lm, mmproj=mmproj)
    check_same_inputs(tok, processor, load_processor(None, src.config(), tok, src))


def check_server_engine_images(lm: Path, mmproj: Path, markup: str, tok, processor) -> None:
    """The server's load (``build_engine``) of the two files, no folder, takes pictures: ``markup``
    the picture's text, the folder's processor inputs."""
    from ktransformers.server.main import build_engine, parse_settings

    engine = build_engine(parse_settings(["--gguf_path", str(lm), "--mmproj", str(mmproj),
                                          "--backend_type", "ktransformers", "--cpu_infer", "1"]))
    support = engine.images
    assert support is not None and support.markup == markup
    check_same_inputs(tok, processor, support.processor)


def check_llama_cpp_converter(folder: Path, lm: Path, mine: Path, out: Path, q: str, inputs) -> None:
    """``convert_hf_to_gguf.py --mmproj`` on ``folder`` as ``q``, written to ``out``: the same tensors
    (names, shapes, types) and keys (bar ``general.*`` and the pixel bounds) as the test's writer's
    ``mine``, and with the language model ``lm`` the same logits on ``inputs``."""
    r = subprocess.run([sys.executable, "-c", _CONVERT, str(LLAMA_CPP), str(folder), str(out), q],
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        pytest.skip(f"llama.cpp's converter did not run here: {r.stderr.strip().splitlines()[-1:]}")
    theirs, ours = GGUFSource(out), GGUFSource(mine)
    assert {n: (t.shape, t.type.name) for n, t in theirs._tensors.items()} == \
        {n: (t.shape, t.type.name) for n, t in ours._tensors.items()}
    for k in set(ours.metadata) | set(theirs.metadata):
        if not k.startswith("general.") and k not in PIXEL_BOUNDS:
            assert theirs.metadata.get(k) == ours.metadata.get(k), k
    with torch.no_grad():
        a = load_model(open_weights(lm, mmproj=out), allow_unmatched=False)(**inputs).logits
        b = load_model(lm, mmproj=mine, allow_unmatched=False)(**inputs).logits
    assert torch.equal(a, b)


def metadata_keys(projector_types: list[str], extra: dict) -> dict:
    """The fuzzed keys, ``{key: (GGUF kind, hypothesis strategy)}``: the projector type drawn from
    ``projector_types``, the sizes and image statistics every reader uses, and ``extra``, the
    projector type's own."""
    from hypothesis import strategies as st

    return {
        "clip.projector_type": ("str", st.sampled_from(projector_types)),
        "clip.vision.projection_dim": ("u32", st.integers(0, 200)),
        "clip.vision.image_size": ("u32", st.integers(0, 300)),
        "clip.vision.patch_size": ("u32", st.integers(0, 40)),
        "clip.vision.embedding_length": ("u32", st.integers(0, 80)),
        "clip.vision.feed_forward_length": ("u32", st.integers(0, 80)),
        "clip.vision.block_count": ("u32", st.integers(0, 4)),
        "clip.vision.attention.head_count": ("u32", st.integers(0, 40)),
        "clip.vision.spatial_merge_size": ("u32", st.integers(0, 5)),
        "clip.vision.image_min_pixels": ("u32", st.integers(0, 1 << 20)),
        "clip.vision.image_max_pixels": ("u32", st.integers(0, 1 << 20)),
        "clip.vision.image_mean": ("f32arr", st.lists(st.floats(allow_nan=True, width=32), max_size=4)),
        **extra,
    }


def check_fuzzed_metadata(data, keys: dict, write, lm: Path) -> None:
    """Random values (or no value) for one to three of ``keys``, the mmproj written by ``write(meta)``:
    with the language model ``lm`` the tower is read, its config and processor build and it validates,
    or a one-line WeightError names a file."""
    from hypothesis import strategies as st

    names = data.draw(st.lists(st.sampled_from(sorted(keys)), min_size=1, max_size=3, unique=True))
    meta = {}
    for k in names:
        kind, strat = keys[k]
        v = data.draw(st.none() | strat)
        meta[k] = None if v is None or (kind.endswith("arr") and not v) else (kind, v)
    bad = write(meta)
    try:
        src = open_weights(lm, mmproj=bad)
        src.config()
        src.image_processor()
        src.validate()
    except WeightError as e:
        msg = str(e)
        assert "\n" not in msg and (str(bad) in msg or "--mmproj" in msg), msg
