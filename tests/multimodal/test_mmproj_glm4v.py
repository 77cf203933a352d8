"""GLM-4.5V / GLM-4.6V (``glm4v_moe``) from llama.cpp's two GGUFs: the language model (``glm4moe``
with M-RoPE sections) and its ``mmproj`` (projector ``glm4v``), read as one image-text model; and
ERNIE-4.5-VL, for which llama.cpp has no mmproj format, refused in one line.

The files are written from the tiny GLM-4.5V with llama.cpp's names (``glm4v_gguf.py``; compared
with llama.cpp's own converter's output where its sources are at hand).  References: the same folder
loaded from safetensors through the same rules (F32 files: vision tower output and logits bitwise
equal), transformers' unmodified model (F32: within 1e-4 of max |logit|; F16 mmproj: within 2e-3,
the bounds mmproj_checks.TOL states).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from ktransformers import load_model
from ktransformers.errors import WeightError
from ktransformers.weights import open_weights

from .glm4v_gguf import write_glm4v_lm_gguf, write_glm4v_mmproj
from .mmproj_checks import (TOL, check_config_is_the_folders, check_fuzzed_metadata, check_llama_cpp_converter,
                            check_processor_from_the_mmproj, check_quantized_logits, check_server_engine_images,
                            check_vision_tensors_bitwise, metadata_keys, needs_llama_cpp)
from .mmproj_checks import one_line as _one_line
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


def test_config_is_the_folders(files, folder):
    """The Glm4vMoeConfig built from the two files is the folder's config.json (epsilons as F32)."""
    check_config_is_the_folders(files["lm"], files["f32"], folder)


def test_vision_tensors_are_the_folders_bitwise(files, folder):
    check_vision_tensors_bitwise(files["lm"], files["f32"], folder)


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
    tok, processor, _ = ref
    check_processor_from_the_mmproj(files["lm"], files["f32"], tok, processor)


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
    check_quantized_logits(files["lm"], files["f16"], "f16", *ref)


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
    tok, processor, _ = ref
    check_server_engine_images(files["lm"], files["f32"], "<|begin_of_image|><|image|><|end_of_image|>", tok, processor)


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

@needs_llama_cpp
@pytest.mark.parametrize("q", ["f32", "f16"])
def test_llama_cpp_converter_mmproj(files, folder, ref, q):
    """``convert_hf_to_gguf.py --mmproj`` on the tiny folder: the same tensors and keys as
    ``glm4v_gguf`` writes (bar the pixel bounds the converter does not write), and the same logits."""
    tok, processor, _ = ref
    check_llama_cpp_converter(folder, files["lm"], files[q], files["dir"] / f"mmproj-llama-{q}.gguf", q,
                              chat_inputs(tok, processor))


# ---- fuzz ---------------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402

_KEYS = metadata_keys(["glm4v", "glm5v", "qwen3vl_merger", ""], {
    "clip.vision.attention.layer_norm_epsilon": ("f32", st.floats(allow_nan=True, width=32)),
    "clip.use_silu": ("bool", st.booleans()),
})


@fuzz_settings(30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_glm4v_mmproj_metadata(files, folder, data):
    """Random values (or no value) for the keys the reader uses: the tower is read, its config and
    processor build and it validates, or a one-line WeightError names a file."""
    check_fuzzed_metadata(data, _KEYS, lambda meta: write_glm4v_mmproj(folder, files["dir"] / "fuzz.gguf", meta=meta),
                          files["lm"])
