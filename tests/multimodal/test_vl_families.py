"""The vision-language MoE families besides Qwen3-VL-MoE (tests/multimodal/test_qwen3_vl_moe.py),
each through its shipped rules on a tiny model: the text model's routed experts on the CPU kernels,
the vision tower on its transformers forward, the family's own processor and M-RoPE positions (the
model's ``get_rope_index``).

* GLM-4.5V (``glm4v_moe``): GLM-4-MoE's text model (sigmoid router on ``KMoEGate``, shared expert,
  dense first layer) behind a ViT with learned, interpolated positions.
* ERNIE-4.5-VL-MoE (``ernie4_5_vl_moe``): modality-isolated experts (text tokens to ``text_moe``'s,
  image tokens and their markers to ``vision_moe``'s, both sets on the CPU kernels; the processor's
  ``moe_mm_token_type_ids`` says which), read from the release layout ``save_pretrained`` writes
  (one list of 2E experts, transposed routers).

Tolerance: fp32 logits within 1e-4 of max |logit| of the unmodified transformers model (measured
below 6e-7 on each); greedy tokens through the Generator identical to transformers' generate(), on
a picture and on a text-only prompt; local_chat's ``/image`` answers as generate() does.
"""

from __future__ import annotations

import pytest
import torch

from ktransformers import load_model
from ktransformers.multimodal.chat import image_support
from ktransformers.optimize_rules import RULES_DIR, default_rule_file

from test_local_chat import chat_session

from .conftest import photo_like
from .vl_checks import (QUESTION, ask_about_picture, chat_answer, chat_inputs, check_greedy_tokens_equal_generate,
                        check_logits_on_pictures, check_text_only_greedy, png, reference, rel, text_prompt_ids)

TOL = 1e-4

# tiny model -> (shipped rule stem, {vision module: class}, the expert sets of a sparse layer, the
# routers' class after injection, image markup)
FAMILIES = {
    "glm4v_moe": ("Glm4vMoe", {"visual": "Glm4vMoeVisionModel"}, ("mlp.experts",), "KMoEGate",
                  "<|begin_of_image|><|image|><|end_of_image|>"),
    "ernie4_5_vl_moe": ("Ernie4_5_VLMoe", {"vision_tower": "Ernie4_5_VLMoeVisionTransformerPretrainedModel",
                                           "resampler_model": "Ernie4_5_VLMoeVariableResolutionResamplerModel"},
                        ("mlp.text_moe.experts", "mlp.vision_moe.experts"), "Ernie4_5_VLMoeMoeTopKRouter",
                        "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tiny_model_dir):
    arch = request.param
    folder = tiny_model_dir(arch)
    return (arch, folder, *reference(folder), load_model(folder, model_path=folder, allow_unmatched=False))


def test_rules_place_experts_on_cpu_kernels_and_vision_tower(family):
    arch, folder, cfg, tok, _, _, model = family
    stem, towers, sets, router, markup = FAMILIES[arch]
    assert default_rule_file(cfg, cuda=False) == RULES_DIR / f"{stem}-cpu.yaml"
    assert default_rule_file(cfg, cuda=True) == RULES_DIR / f"{stem}.yaml"
    text = cfg.get_text_config()
    dense = getattr(text, "first_k_dense_replace", None)
    sparse = range(1 if dense is None else dense, text.num_hidden_layers)  # the tiny models' first layer is dense
    layers = model.model.language_model.layers
    experts = {n: m for n, m in layers.named_modules() if n.endswith(".experts")}
    assert sorted(experts) == sorted(f"{i}.{s}" for i in sparse for s in sets)
    for m in experts.values():
        assert type(m).__name__ == "KTransformersExperts" and m.generate_op.name == "KExpertsCPU"
    routers = [m for n, m in layers.named_modules() if n.endswith(".gate")]
    assert len(routers) == len(experts) and all(type(m).__name__ == router for m in routers)
    for layer in layers:
        assert layer.self_attn.q_proj.generate_op.name == "KLinearCPU"
    for attr, cls in towers.items():
        assert type(getattr(model.model, attr)).__name__ == cls
        assert all(p.device.type == "cpu" for p in getattr(model.model, attr).parameters())
    assert image_support(cfg, tok, folder).markup == markup


@pytest.mark.parametrize("images", [1, 2])
def test_logits_match_transformers_on_image_and_text(family, images):
    _, _, _, tok, processor, hf, model = family
    check_logits_on_pictures(model, hf, tok, processor, images, TOL, blank_factor=10)


def test_generator_greedy_tokens_equal_generate(family):
    _, _, _, tok, processor, hf, model = family
    check_greedy_tokens_equal_generate(model, tok, processor, hf)


def test_generator_text_only_prompt_on_the_vision_model(family):
    _, _, _, tok, _, hf, model = family
    ids = torch.tensor([text_prompt_ids(tok)])
    with torch.no_grad():
        assert rel(model(ids).logits, hf(ids).logits) < TOL
    check_text_only_greedy(model, tok, hf)


def test_gpu_rule_file_mapped_to_cpu_matches_transformers(family):
    """The GPU file's placements (experts out to cuda:0, the vision tower on cuda:0) read on a machine
    without CUDA through ``--device_map cuda=cpu``: the same logits."""
    arch, folder, _, tok, processor, hf, _ = family
    model = load_model(folder, model_path=folder, rules=RULES_DIR / f"{FAMILIES[arch][0]}.yaml",
                       device_map="cuda=cpu", allow_unmatched=False)
    inputs = chat_inputs(tok, processor)
    with torch.no_grad():
        assert rel(model(**inputs).logits, hf(**inputs).logits) < TOL


def test_local_chat_image_command(family, tmp_path):
    """``/image PATH`` then a question: the answer and prompt length of transformers' generate() on
    the picture's markup, a newline and the question."""
    _, folder, cfg, tok, _, hf, _ = family
    n_prompt, answer = chat_answer(image_support(cfg, tok, folder), tok, hf)
    pic = tmp_path / "pic.png"
    pic.write_bytes(png())
    with chat_session("--model_path", folder, "--max_new_tokens", 6, "--cpu_infer", 1) as child:
        ask_about_picture(child, pic, n_prompt, answer)


def test_batching_engine_pictures_beside_text(family):
    """The batching engine (the server's default): a prompt with a picture read whole in a step of its
    own, then decoded in one batch with a text request; each answer is generate()'s for it alone."""
    from .test_batch_images import _engine, _prompt, _reference, _serve

    _, folder, cfg, tok, _, hf, model = family
    support = image_support(cfg, tok, folder)
    prompts = [_prompt(tok, support, QUESTION, [photo_like()]), _prompt(tok, support, "Hello there", [])]
    results = _serve(_engine(model, tok, support), prompts)
    assert [toks for toks, _ in results] == [_reference(hf, p) for p in prompts]
