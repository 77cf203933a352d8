"""GLM-4.5V / GLM-4.6V (``glm4v_moe``) from llama.cpp's two GGUFs: the language model (``glm4moe``
with M-RoPE sections) and its ``mmproj`` (projector ``glm4v``), read as one image-text model; and
ERNIE-4.5-VL, for which llama.cpp has no mmproj format, refused in one line.

The files are written from the tiny GLM-4.5V with llama.cpp's names (``glm4v_gguf.py``; compared
with llama.cpp's own converter's output where its sources are at hand).  References: the same folder
loaded from safetensors through the same rules (F32 files: vision tower output and logits bitwise
equal), transformers' unmodified model (F32: within 1e-4 of max |logit|; F16 mmproj: within 2e-3,
the bound the Qwen3-VL mmproj test states for F16).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from ktransformers import load_model
from ktransformers.errors import WeightError
from ktransformers.multimodal.processor import load_processor
from ktransformers.weights import open_weights

from .glm4v_gguf import write_glm4v_lm_gguf, write_glm4v_mmproj
from .test_mmproj import LLAMA_CPP, TOL  # llama.cpp's sources; the Qwen3-VL test's F32 / F16 bounds
from .vl_checks import chat_inputs, reference, rel
from .vl_gguf import write_lm_gguf, write_mmproj

QTYPES = ("f32", "f16")


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("glm4v_moe")


@pytest.fixture(scope="module")
def files(folder, tmp_path_factory):
    d = tmp_path_factory.mktemp("glm4v-gguf")
    out = {"lm": write_glm4v_lm_gguf(folder, d / "lm.gguf"), "dir": d}
    for q in QTYPES:
        out[q] = write_glm4v_mmproj(folder, d / f"mmproj-{q}.gguf", q)
    return out


@pytest.fixture(scope="module")
def ref(folder):
    return reference(folder)[1:]


@pytest.fixture(scope="module")
def models(files, folder):
    return (load_model(files["lm"], mmproj=files["f32"], allow_unmatched=False),
            load_model(folder, model_path=folder, allow_unmatched=False))


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_config_is_the_folders(files, folder):
    """The Glm4vMoeConfig built from the two files is the folder's config.json (epsilons as F32)."""
    got = open_weights(files["lm"], mmproj=files["f32"]).config().to_dict()
    want = AutoConfig.from_pretrained(folder).to_dict()
    for part in ("vision_config", "text_config"):
        for k, v in want[part].items():
            if k in ("dtype", "transformers_version"):
                continue
            assert got[part][k] == pytest.approx(v, rel=1e-6) if isinstance(v, float) else got[part][k] == v, (part, k)
    for k, v in want.items():
        if k not in ("vision_config", "text_config", "dtype", "transformers_version", "_name_or_path"):
            assert got[k] == v, k


def test_vision_tensors_are_the_folders_bitwise(files, folder):
    from safetensors.torch import load_file

    src = open_weights(files["lm"], mmproj=files["f32"])
    sd = load_file(next(Path(folder).glob("*.safetensors")))
    visual = {k: v for k, v in sd.items() if k.startswith("model.visual.")}
    assert sorted(n for n in src.names() if n.startswith("model.visual.")) == sorted(visual)
    for k, v in visual.items():
        assert torch.equal(src.tensor(k), v), k
    src.validate()


def test_vision_tower_output_bitwise_equal_the_safetensors_load(models, ref):
    tok, processor, hf = ref
    inputs = chat_inputs(tok, processor, images=2)
    gguf_model, st = models
    with torch.no_grad():
        a = gguf_model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        b = st.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
        c = hf.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
    a, b, c = (getattr(x, "pooler_output", x) for x in (a, b, c))
    assert torch.equal(a, b)
    assert rel(a, c) < TOL["f32"]


def test_image_processor_from_the_mmproj(files, ref):
    """Without a folder, the processor the mmproj describes gives the folder's pixels and tokens."""
    tok, processor, _ = ref
    src = open_weights(files["lm"], mmproj=files["f32"])
    mine = load_processor(None, src.config(), tok, src)
    a, b = chat_inputs(tok, processor), chat_inputs(tok, mine)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("images", [1, 2])
def test_f32_logits_bitwise_equal_the_safetensors_load(models, ref, images):
    tok, processor, hf = ref
    inputs = chat_inputs(tok, processor, images=images)
    gguf_model, st = models
    with torch.no_grad():
        got, same, want = gguf_model(**inputs).logits, st(**inputs).logits, hf(**inputs).logits
    assert torch.equal(got, same)
    assert rel(got, want) < TOL["f32"]


def test_f16_mmproj_logits_within_tolerance(files, ref):
    tok, processor, hf = ref
    inputs = chat_inputs(tok, processor)
    with torch.no_grad():
        got = load_model(files["lm"], mmproj=files["f16"], allow_unmatched=False)(**inputs).logits
        want = hf(**inputs).logits
        blank = hf(**dict(inputs, pixel_values=torch.zeros_like(inputs["pixel_values"]))).logits
    assert rel(got, want) < TOL["f16"]
    assert rel(blank, want) > 10 * TOL["f16"]  # the tolerance is far below what the picture changes


def test_mtp_block_of_the_language_model_is_left_out(files, ref):
    """A release's ``glm4moe`` file keeps the MTP block as one more ``blk.N`` (``nextn_predict_layers``
    1); the image-text model, which has none, reads the same logits without it."""
    import gguf
    import numpy as np

    from gguf_files import copy_gguf

    r = gguf.GGUFReader(files["lm"])
    add = {t.name.replace("blk.2.", "blk.3."): np.array(t.data) for t in r.tensors if t.name.startswith("blk.2.")}
    rng = np.random.default_rng(0)
    add.update({"blk.3.nextn.eh_proj.weight": rng.standard_normal((64, 128)).astype(np.float32),
                "blk.3.nextn.enorm.weight": np.ones(64, np.float32), "blk.3.nextn.hnorm.weight": np.ones(64, np.float32),
                "blk.3.nextn.shared_head_norm.weight": np.ones(64, np.float32)})
    mtp = copy_gguf(files["lm"], files["dir"] / "mtp.gguf",
                    keys={"glm4moe.block_count": 4, "glm4moe.nextn_predict_layers": 1}, add=add)
    tok, processor, _ = ref
    inputs = chat_inputs(tok, processor)
    with torch.no_grad():
        a = load_model(mtp, mmproj=files["f32"], allow_unmatched=False)(**inputs).logits
        b = load_model(files["lm"], mmproj=files["f32"], allow_unmatched=False)(**inputs).logits
    assert torch.equal(a, b)


def test_local_chat_gguf_with_mmproj(files, folder, ref, tmp_path):
    """``--gguf_path lm.gguf --mmproj mmproj.gguf``, no folder: config, tokenizer, chat template and
    image processor from the two files; ``/image`` gives transformers' greedy answer."""
    from ktransformers.multimodal.chat import image_support

    from test_local_chat import chat_session

    from .vl_checks import ask_about_picture, chat_answer, png

    tok, _, hf = ref
    n_prompt, answer = chat_answer(image_support(AutoConfig.from_pretrained(folder), tok, folder), tok, hf)
    pic = tmp_path / "pic.png"
    pic.write_bytes(png())
    with chat_session("--gguf_path", files["lm"], "--mmproj", files["f32"], "--max_new_tokens", 6,
                      "--cpu_infer", 1) as child:
        ask_about_picture(child, pic, n_prompt, answer)
        child.expect_exact("Chat: ")


def test_server_engine_gguf_with_mmproj(files, ref):
    """The server's load (``build_engine``) takes pictures with the GGUF and its mmproj, no folder."""
    from ktransformers.server.main import build_engine, parse_settings

    engine = build_engine(parse_settings(["--gguf_path", str(files["lm"]), "--mmproj", str(files["f32"]),
                                          "--backend_type", "ktransformers", "--cpu_infer", "1"]))
    support = engine.images
    assert support is not None and support.markup == "<|begin_of_image|><|image|><|end_of_image|>"
    tok, processor, _ = ref
    a, b = chat_inputs(tok, processor), chat_inputs(tok, support.processor)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- bad input ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen(tiny_vl, files):
    d = files["dir"]
    return {"lm": write_lm_gguf(tiny_vl, d / "qwen-lm.gguf"), "mmproj": write_mmproj(tiny_vl, d / "qwen-mmproj.gguf")}


def test_projector_of_another_family_names_both_files(files, qwen):
    with pytest.raises(WeightError) as e:
        open_weights(files["lm"], mmproj=qwen["mmproj"])
    msg = _one_line(e)
    assert str(qwen["mmproj"]) in msg and str(files["lm"]) in msg
    assert "'qwen3vl_merger' mmproj (Qwen3-VL's vision tower) pairs with a 'qwen3vlmoe' language model" in msg
    with pytest.raises(WeightError) as e:
        open_weights(qwen["lm"], mmproj=files["f32"])
    msg = _one_line(e)
    assert str(files["f32"]) in msg and str(qwen["lm"]) in msg and "'glm4v' mmproj" in msg


def test_text_only_glm4moe_refuses_an_mmproj(files, folder):
    text = write_glm4v_lm_gguf(folder, files["dir"] / "text.gguf", sections=False)
    with pytest.raises(WeightError) as e:
        open_weights(text, mmproj=files["f32"])
    assert "text-only 'glm4moe' model (no glm4moe.rope.dimension_sections" in _one_line(e)


@pytest.mark.parametrize("meta, match", [
    ({"clip.vision.projection_dim": ("u32", 128)},
     r"projects to width 128 \(clip.vision.projection_dim\) but the language model .* is 64 wide"),
    ({"clip.vision.spatial_merge_size": ("u32", 1)},
     r"'mm.patch_merger.weight' is \[64, 32, 2, 2\]; projection_dim, embedding_length and spatial_merge_size give"),
    ({"clip.vision.feed_forward_length": ("u32", 32)}, r"'mm.up.weight' is \[64, 64\]; feed_forward_length"),
    ({"clip.use_silu": None}, r"sets neither 'clip.use_silu' nor 'clip.use_gelu'"),
    ({"clip.vision.attention.layer_norm_epsilon": ("f32", 0.0)}, r"'clip.vision.attention.layer_norm_epsilon' is"),
    ({"clip.vision.image_size": ("u32", 28)}, r"'v.position_embd.weight' is \[16, 32\]; image_size 28"),
    ({"clip.vision.image_max_pixels": None}, r"lacks 'clip.vision.image_max_pixels'"),
])
def test_bad_metadata_is_one_line(files, folder, meta, match):
    bad = write_glm4v_mmproj(folder, files["dir"] / "bad.gguf", meta=meta)
    with pytest.raises(WeightError, match=match) as e:
        open_weights(files["lm"], mmproj=bad).config()
    assert str(bad) in _one_line(e)


@pytest.mark.parametrize("drop", ["mm.model.fc.weight", "v.norm_embd.weight", "v.patch_embd.bias",
                                  "v.blk.1.ffn_gate.weight"])
def test_missing_tensor_is_named(files, folder, drop):
    bad = write_glm4v_mmproj(folder, files["dir"] / "bad.gguf", drop=(drop,))
    with pytest.raises(WeightError) as e:
        open_weights(files["lm"], mmproj=bad).validate()
    assert drop in _one_line(e)


def test_ernie_vl_has_no_mmproj_format(files, tiny_model_dir):
    """llama.cpp defines no projector type or converter for ERNIE-4.5-VL: ``--mmproj`` with its folder
    or with an ERNIE GGUF is one line that says so."""
    import gguf

    from gguf_files import finish

    folder = tiny_model_dir("ernie4_5_vl_moe")
    with pytest.raises(WeightError) as e:
        open_weights(folder, mmproj=files["f32"])
    assert "llama.cpp has no mmproj format for ERNIE-4.5-VL-MoE" in _one_line(e)
    lm = files["dir"] / "ernie.gguf"
    w = gguf.GGUFWriter(str(lm), arch="ernie4_5-moe")
    finish(w)
    with pytest.raises(WeightError) as e:
        open_weights(lm, mmproj=files["f32"])
    msg = _one_line(e)
    assert "llama.cpp has no mmproj format for ERNIE-4.5-VL" in msg and str(lm) in msg


def test_local_chat_ernie_mmproj_refusal(files, tiny_model_dir):
    """``--mmproj`` with an ERNIE GGUF, or with only an ERNIE-4.5-VL folder: the line says llama.cpp
    has no mmproj format for it (not that the flag wants a GGUF: none would do), naming flag and file."""
    from test_local_chat import _one_error_line, run_chat

    import gguf
    from gguf_files import finish

    from ktransformers.errors import KTError
    from ktransformers.server.settings import Settings

    lm = files["dir"] / "ernie-chat.gguf"
    finish(gguf.GGUFWriter(str(lm), arch="ernie4_5-moe"))
    line = _one_error_line(run_chat("--gguf_path", lm, "--mmproj", files["f32"], "--prompt", "hi"))
    assert "llama.cpp has no mmproj format for ERNIE-4.5-VL" in line
    folder = tiny_model_dir("ernie4_5_vl_moe")
    line = _one_error_line(run_chat("--model_path", folder, "--mmproj", files["f32"], "--prompt", "hi"))
    assert "llama.cpp has no mmproj format for ERNIE-4.5-VL-MoE" in line and "goes with --gguf_path" not in line
    assert f"--mmproj {files['f32']}" in line and str(folder) in line
    with pytest.raises(KTError, match="llama.cpp has no mmproj format for ERNIE-4.5-VL-MoE") as e:
        Settings(model_path=str(folder), mmproj=str(files["f32"])).validate_paths()
    assert f"--mmproj {files['f32']}" in _one_line(e) and str(folder) in str(e.value)


# ---- llama.cpp's own converter -----------------------------------------------------------------

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
    cls(d, {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}[sys.argv[4]], Path(sys.argv[3])).write()
"""


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(), reason="llama.cpp's sources not found")
@pytest.mark.parametrize("q", ["f32", "f16"])
def test_llama_cpp_converter_mmproj(files, folder, ref, q):
    """``convert_hf_to_gguf.py --mmproj`` on the tiny folder: the same tensors and keys as
    ``glm4v_gguf`` writes (bar the pixel bounds the converter does not write), and the same logits."""
    out = files["dir"] / f"mmproj-llama-{q}.gguf"
    r = subprocess.run([sys.executable, "-c", _CONVERT, str(LLAMA_CPP), str(folder), str(out), q],
                       capture_output=True, text=True, timeout=300)
    if r.returncode:
        pytest.skip(f"llama.cpp's converter did not run here: {r.stderr.strip().splitlines()[-1:]}")
    from ktransformers.weights.gguf_source import GGUFSource

    theirs, mine = GGUFSource(out), GGUFSource(files[q])
    assert {n: (t.shape, t.type.name) for n, t in theirs._tensors.items()} == \
        {n: (t.shape, t.type.name) for n, t in mine._tensors.items()}
    bounds = ("clip.vision.image_min_pixels", "clip.vision.image_max_pixels")
    for k in set(mine.metadata) | set(theirs.metadata):
        if not k.startswith("general.") and k not in bounds:
            assert theirs.metadata.get(k) == mine.metadata.get(k), k
    tok, processor, _ = ref
    inputs = chat_inputs(tok, processor)
    with torch.no_grad():
        a = load_model(open_weights(files["lm"], mmproj=out), allow_unmatched=False)(**inputs).logits
        b = load_model(files["lm"], mmproj=files[q], allow_unmatched=False)(**inputs).logits
    assert torch.equal(a, b)


# ---- fuzz ---------------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402

_KEYS = {
    "clip.projector_type": ("str", st.sampled_from(["glm4v", "glm5v", "qwen3vl_merger", ""])),
    "clip.vision.projection_dim": ("u32", st.integers(0, 200)),
    "clip.vision.image_size": ("u32", st.integers(0, 300)),
    "clip.vision.patch_size": ("u32", st.integers(0, 40)),
    "clip.vision.embedding_length": ("u32", st.integers(0, 80)),
    "clip.vision.feed_forward_length": ("u32", st.integers(0, 80)),
    "clip.vision.block_count": ("u32", st.integers(0, 4)),
    "clip.vision.attention.head_count": ("u32", st.integers(0, 40)),
    "clip.vision.spatial_merge_size": ("u32", st.integers(0, 5)),
    "clip.vision.attention.layer_norm_epsilon": ("f32", st.floats(allow_nan=True, width=32)),
    "clip.use_silu": ("bool", st.booleans()),
    "clip.vision.image_min_pixels": ("u32", st.integers(0, 1 << 20)),
    "clip.vision.image_max_pixels": ("u32", st.integers(0, 1 << 20)),
    "clip.vision.image_mean": ("f32arr", st.lists(st.floats(allow_nan=True, width=32), max_size=4)),
}


@fuzz_settings(30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_glm4v_mmproj_metadata(files, folder, data):
    """Random values (or no value) for the keys the reader uses: the tower is read, its config and
    processor build and it validates, or a one-line WeightError names a file."""
    keys = data.draw(st.lists(st.sampled_from(sorted(_KEYS)), min_size=1, max_size=3, unique=True))
    meta = {}
    for k in keys:
        kind, strat = _KEYS[k]
        v = data.draw(st.none() | strat)
        meta[k] = None if v is None or (kind.endswith("arr") and not v) else (kind, v)
    bad = write_glm4v_mmproj(folder, files["dir"] / "fuzz.gguf", meta=meta)
    try:
        src = open_weights(files["lm"], mmproj=bad)
        src.config()
        src.image_processor()
        src.validate()
    except WeightError as e:
        msg = str(e)
        assert "\n" not in msg and (str(bad) in msg or "--mmproj" in msg), msg
