"""Qwen3-VL-MoE from llama.cpp's two GGUFs: the language model (``qwen3vlmoe``) and its ``mmproj``
(the vision tower), read as one image-text model (``weights/mmproj.py``).

The files are written from the tiny Qwen3-VL-MoE with llama.cpp's names and transforms
(``vl_gguf.py``; the mmproj matches llama.cpp's own converter's output key for key and tensor for
tensor, checked below where llama.cpp's sources are at hand).  References: the same folder loaded
from safetensors through the same rules (F32 files: logits bitwise equal), transformers' unmodified
model (F16 / Q8_0 mmproj: logits within the stated tolerances of max |logit|; greedy tokens equal).
"""

from __future__ import annotations

import pytest
import torch

from ktransformers import load_model
from ktransformers.errors import WeightError
from ktransformers.weights import open_weights

from test_local_chat import chat_session

from .mmproj_checks import (TOL, check_config_is_the_folders, check_fuzzed_metadata, check_llama_cpp_converter,
                            check_processor_from_the_mmproj, check_quantized_logits, check_server_engine_images,
                            check_vision_tensors_bitwise, metadata_keys, needs_llama_cpp)
from .mmproj_checks import one_line as _one_line
from .test_local_chat_image import expected  # noqa: F401 - the fixture, for local_chat's answer
from .vl_checks import ask_about_picture, chat_inputs, check_greedy_tokens_equal_generate, png, reference, rel
from .vl_gguf import write_lm_gguf, write_mmproj


@pytest.fixture(scope="module")
def files(tiny_vl, tmp_path_factory):
    d = tmp_path_factory.mktemp("vl-gguf")
    out = {"lm": write_lm_gguf(tiny_vl, d / "lm.gguf")}
    for q in TOL:
        out[q] = write_mmproj(tiny_vl, d / f"mmproj-{q}.gguf", q)
    out["dir"] = d
    return out


@pytest.fixture(scope="module")
def ref(tiny_vl):
    return reference(tiny_vl)[1:]


def _load(files, q="f32", **kw):
    return load_model(files["lm"], mmproj=files[q], allow_unmatched=False, **kw)


def test_config_is_the_folders(files, tiny_vl):
    """The Qwen3VLMoeConfig built from the two files' metadata is the folder's config.json."""
    check_config_is_the_folders(files["lm"], files["f32"], tiny_vl)


def test_vision_tensors_are_the_folders_bitwise(files, tiny_vl):
    check_vision_tensors_bitwise(files["lm"], files["f32"], tiny_vl)


def test_image_processor_from_the_mmproj(files, ref):
    tok, processor, _ = ref
    check_processor_from_the_mmproj(files["lm"], files["f32"], tok, processor)


def test_f32_logits_bitwise_equal_the_safetensors_load(files, ref, tiny_vl):
    tok, processor, hf = ref
    inputs = chat_inputs(tok, processor, images=2)
    model = _load(files)
    st = load_model(tiny_vl, model_path=tiny_vl, allow_unmatched=False)
    with torch.no_grad():
        got, same, want = model(**inputs).logits, st(**inputs).logits, hf(**inputs).logits
    assert torch.equal(got, same)
    assert rel(got, want) < TOL["f32"]


@pytest.mark.parametrize("q", ["f16", "q8_0"])
def test_quantized_mmproj_logits_within_tolerance(files, ref, q):
    check_quantized_logits(files["lm"], files[q], q, *ref)


def test_generator_greedy_tokens_equal_generate(files, ref):
    tok, processor, hf = ref
    check_greedy_tokens_equal_generate(_load(files), tok, processor, hf)


def test_split_qkv_reads_as_the_fused(files, tiny_vl):
    split = write_mmproj(tiny_vl, files["dir"] / "mmproj-split.gguf", split_qkv=True)
    a = open_weights(files["lm"], mmproj=files["f32"])
    b = open_weights(files["lm"], mmproj=split)
    for n in a.names():
        if ".attn.qkv." in n:
            assert torch.equal(a.tensor(n), b.tensor(n)), n


def test_language_model_alone_is_a_text_model(files, ref):
    """The ``qwen3vlmoe`` file without its mmproj: Qwen3-MoE's text model (plain RoPE equals M-RoPE on
    text, whose three position axes are equal): the image-text model's logits on a text prompt."""
    tok, _, hf = ref
    src = open_weights(files["lm"])
    assert type(src.config()).__name__ == "Qwen3MoeConfig"
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        got = load_model(src, allow_unmatched=True)(input_ids=ids).logits
        want = hf(input_ids=ids).logits
    assert rel(got, want) < TOL["f32"]


# ---- bad input ---------------------------------------------------------------------------------

def test_text_only_model_refuses_an_mmproj(files, tiny_vl):
    text = write_lm_gguf(tiny_vl, files["dir"] / "text.gguf", arch="qwen3moe")
    with pytest.raises(WeightError) as e:
        open_weights(text, mmproj=files["f32"])
    assert "text-only 'qwen3moe' model" in _one_line(e)


def test_mmproj_with_safetensors_weights_is_refused(files, tiny_vl):
    with pytest.raises(WeightError, match="goes with a GGUF language model") as e:
        open_weights(tiny_vl, mmproj=files["f32"])
    _one_line(e)


def test_language_model_given_as_mmproj_is_refused(files):
    with pytest.raises(WeightError, match=r"not an mmproj file \(general.architecture is 'qwen3vlmoe'") as e:
        open_weights(files["lm"], mmproj=files["lm"])
    _one_line(e)


@pytest.mark.parametrize("meta, match", [
    ({"clip.projector_type": ("str", "gemma3")}, r"projector type 'gemma3' is not read here"),
    ({"clip.vision.projection_dim": ("u32", 128)},
     r"projects to width 128 \(clip.vision.projection_dim\) but the language model .* is 64 wide"),
    ({"clip.vision.is_deepstack_layers": ("boolarr", [True, True])},
     r"has 2 DeepStack layers .* takes 1 \(qwen3vlmoe.n_deepstack_layers\)"),
    ({"clip.vision.patch_size": ("u32", 32)}, r"'v.patch_embd.weight' is \[32, 3, 16, 16\]; the metadata says"),
    ({"clip.vision.image_size": ("u32", 64)}, r"'v.position_embd.weight' is \[64, 32\]; image_size 64"),
    ({"clip.vision.block_count": None}, r"lacks 'clip.vision.block_count'"),
    ({"clip.vision.block_count": ("u32", 3)}, r"'clip.vision.is_deepstack_layers' must be 3 booleans"),
    ({"clip.vision.attention.head_count": ("u32", 3)}, r"'clip.vision.attention.head_count' is 3; it must divide"),
    ({"clip.vision.image_std": ("f32arr", [0.5, 0.0, 0.5])}, r"'clip.vision.image_std' is .*expected finite positive"),
    ({"clip.has_vision_encoder": ("bool", False)}, r"has no vision encoder"),
    ({"clip.vision.spatial_merge_size": ("u32", 1)},
     r"'mm.0.weight' is \[128, 128\]; embedding_length 32 and spatial_merge_size 1 give 32 inputs"),
])
def test_bad_metadata_is_one_line(files, tiny_vl, meta, match):
    bad = write_mmproj(tiny_vl, files["dir"] / "bad.gguf", meta=meta)
    with pytest.raises(WeightError, match=match) as e:
        open_weights(files["lm"], mmproj=bad)
    _one_line(e)


@pytest.mark.parametrize("drop", ["mm.2.weight", "v.patch_embd.weight.1", "v.deepstack.0.fc1.bias",
                                  "v.blk.1.attn_qkv.weight"])
def test_missing_tensor_is_named(files, tiny_vl, drop):
    bad = write_mmproj(tiny_vl, files["dir"] / "bad.gguf", drop=(drop,))
    with pytest.raises(WeightError) as e:
        src = open_weights(files["lm"], mmproj=bad)
        src.validate()  # a tower that lost its time half reads as a 2D patch: the model's shape differs
    assert drop.removesuffix(".1") in _one_line(e)


def test_missing_file_is_one_line(files):
    with pytest.raises(WeightError, match=r"--mmproj .*nowhere.gguf: no such file") as e:
        open_weights(files["lm"], mmproj=files["dir"] / "nowhere.gguf")
    _one_line(e)


# ---- local_chat and the server -----------------------------------------------------------------

def test_local_chat_gguf_with_mmproj(files, tmp_path, expected):
    """``--gguf_path lm.gguf --mmproj mmproj.gguf``, no folder: config, tokenizer, chat template and
    image processor from the two files; ``/image`` gives transformers' greedy answer."""
    n_prompt, answer = expected
    pic = tmp_path / "pic.png"
    pic.write_bytes(png())
    with chat_session("--gguf_path", files["lm"], "--mmproj", files["f32"], "--max_new_tokens", 6,
                    "--cpu_infer", 1) as child:
        ask_about_picture(child, pic, n_prompt, answer)
        child.expect_exact("Chat: ")


def test_local_chat_mmproj_refusals(files, tiny_vl):
    from test_local_chat import _one_error_line, run_chat

    text = write_lm_gguf(tiny_vl, files["dir"] / "text.gguf", arch="qwen3moe")
    line = _one_error_line(run_chat("--gguf_path", text, "--mmproj", files["f32"], "--prompt", "hi"))
    assert "text-only 'qwen3moe' model" in line
    line = _one_error_line(run_chat("--model_path", tiny_vl, "--mmproj", files["f32"], "--prompt", "hi"))
    assert "--mmproj" in line and "goes with --gguf_path" in line


def test_server_settings_mmproj(files, tmp_path):
    from ktransformers.errors import ConfigError
    from ktransformers.server.settings import Settings

    Settings(gguf_path=str(files["lm"]), mmproj=str(files["f32"])).validate_paths()
    with pytest.raises(ConfigError, match="goes with --gguf_path"):
        Settings(model_path=str(files["dir"]), mmproj=str(files["f32"])).validate_paths()
    with pytest.raises(ConfigError, match="no such file"):
        Settings(gguf_path=str(files["lm"]), mmproj=str(tmp_path / "x.gguf")).validate_paths()


def test_server_engine_gguf_with_mmproj(files, ref):
    tok, processor, _ = ref
    check_server_engine_images(files["lm"], files["f32"], "<|vision_start|><|image_pad|><|vision_end|>", tok, processor)


# ---- llama.cpp's own converter -----------------------------------------------------------------

@needs_llama_cpp
@pytest.mark.parametrize("q", ["f32", "f16", "q8_0"])
def test_llama_cpp_converter_mmproj(files, ref, tiny_vl, q):
    """``convert_hf_to_gguf.py --mmproj`` on the tiny folder: the same tensors and keys as ``vl_gguf``
    writes (bar the pixel bounds the release's files lack), and the same logits."""
    tok, processor, _ = ref
    check_llama_cpp_converter(tiny_vl, files["lm"], files[q], files["dir"] / f"mmproj-llama-{q}.gguf", q,
                              chat_inputs(tok, processor))


# ---- fuzz ---------------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402

_KEYS = metadata_keys(["qwen3vl_merger", "qwen2vl_merger", "", "gemma3"], {
    "clip.vision.image_std": ("f32arr", st.lists(st.floats(allow_nan=True, width=32), max_size=4)),
    "clip.vision.is_deepstack_layers": ("boolarr", st.lists(st.booleans(), max_size=4)),
})


@fuzz_settings(40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_mmproj_metadata(files, tiny_vl, data):
    """Random values (or no value) for the keys the reader uses: the tower is read, its config and
    processor build and it validates, or a one-line WeightError names the file."""
    check_fuzzed_metadata(data, _KEYS, lambda meta: write_mmproj(tiny_vl, files["dir"] / "fuzz.gguf", meta=meta),
                          files["lm"])
