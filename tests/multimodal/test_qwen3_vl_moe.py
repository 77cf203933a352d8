"""Qwen3-VL-MoE through the shipped rules: the text model's routed experts on the CPU kernels, the
vision tower on its transformers forward; the model's own processor (resize, patches, image token
count, ``mm_token_type_ids``) and M-RoPE positions (its ``get_rope_index``).

Tolerance: fp32 logits within 1e-4 of max |logit| (measured 5.8e-7 with one picture, 3.9e-7 with two); greedy tokens
through the Generator identical to transformers' generate() on the unmodified model.
"""

from __future__ import annotations

import pytest
import torch

from ktransformers import load_model
from ktransformers.multimodal.processor import image_prompt
from ktransformers.optimize_rules import RULES_DIR, default_rule_file

from .vl_checks import (chat_inputs, check_greedy_tokens_equal_generate, check_logits_on_pictures,
                        check_text_only_greedy, reference, rel)

TOL = 1e-4


@pytest.fixture(scope="module")
def loaded(tiny_vl):
    return (*reference(tiny_vl), load_model(tiny_vl, model_path=tiny_vl, allow_unmatched=False))


def test_rules_place_experts_on_cpu_kernels_and_vision_tower(loaded):
    cfg, _, _, _, model = loaded
    assert default_rule_file(cfg, cuda=False) == RULES_DIR / "Qwen3VLMoe-cpu.yaml"
    assert default_rule_file(cfg, cuda=True) == RULES_DIR / "Qwen3VLMoe.yaml"
    for layer in model.model.language_model.layers:
        assert type(layer.mlp).__name__ == "KMoEBlock"
        assert type(layer.mlp.experts).__name__ == "KTransformersExperts"
        assert layer.mlp.experts.generate_op.name == "KExpertsCPU"
        assert layer.self_attn.q_proj.generate_op.name == "KLinearCPU"
    assert type(model.model.visual).__name__ == "Qwen3VLMoeVisionModel"
    assert all(p.device.type == "cpu" for p in model.model.visual.parameters())


@pytest.mark.parametrize("images", [1, 2])
def test_logits_match_transformers_on_image_and_text(loaded, images):
    _, tok, processor, hf, model = loaded
    assert hf.config.vision_config.spatial_merge_size == 2  # four patches to an image token
    check_logits_on_pictures(model, hf, tok, processor, images, TOL, blank_factor=100)


def test_generator_greedy_tokens_equal_generate(loaded):
    _, tok, processor, hf, model = loaded
    check_greedy_tokens_equal_generate(model, tok, processor, hf)


def test_generator_text_only_prompt_on_the_vision_model(loaded):
    _, tok, _, hf, model = loaded
    check_text_only_greedy(model, tok, hf)


def test_gpu_rule_file_mapped_to_cpu_matches_transformers(loaded, tiny_vl):
    """The GPU file's placements (experts out to cuda:0, the vision tower on cuda:0) read on a machine
    without CUDA through ``--device_map cuda=cpu``: the same logits."""
    _, tok, processor, hf, _ = loaded
    model = load_model(tiny_vl, model_path=tiny_vl, rules=RULES_DIR / "Qwen3VLMoe.yaml", device_map="cuda=cpu",
                       allow_unmatched=False)
    inputs = chat_inputs(tok, processor)
    with torch.no_grad():
        assert rel(model(**inputs).logits, hf(**inputs).logits) < TOL


def test_processor_refusals_are_image_errors(loaded):
    from PIL import Image

    from ktransformers.multimodal.images import ImageError

    _, tok, processor, _, _ = loaded
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
    with pytest.raises(ImageError, match=r"images \(1000x1\): the model's processor refused them: .*aspect ratio"):
        image_prompt(processor, text, [Image.new("RGB", (1000, 1))])
    with pytest.raises(ImageError, match=r"the prompt holds 1 image placeholders .* for 2 images"):
        image_prompt(processor, text, [Image.new("RGB", (64, 64))] * 2)


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402


@fuzz_settings(60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(width=st.integers(1, 3000), height=st.integers(1, 3000))
def test_fuzz_picture_sizes_through_the_processor(loaded, width, height):
    """Any picture size that decodes: model inputs whose image tokens fill the placeholder, or a refusal."""
    from PIL import Image

    from ktransformers.multimodal.images import ImageError
    from ktransformers.multimodal.prompt import ImagePrompt

    _, tok, processor, _, _ = loaded
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False)
    try:
        prompt = ImagePrompt.from_processor(image_prompt(processor, text, [Image.new("RGB", (width, height))]))
    except ImageError as e:
        assert "\n" not in str(e) and "aspect ratio" in str(e)
    else:
        assert prompt.vision.image_tokens == int(prompt.vision.inputs["image_grid_thw"].prod()) // 4
