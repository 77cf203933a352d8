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

import io

import pytest
import torch
from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

from ktransformers import load_model
from ktransformers.generation.engine import Generator
from ktransformers.generation.sampling import SamplingParams
from ktransformers.multimodal.chat import image_support
from ktransformers.multimodal.processor import image_prompt, load_processor
from ktransformers.multimodal.prompt import ImagePrompt
from ktransformers.optimize_rules import RULES_DIR, default_rule_file

from .conftest import photo_like

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
    cfg = AutoConfig.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    processor = load_processor(folder, cfg, tok)
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    model = load_model(folder, model_path=folder, allow_unmatched=False)
    return arch, folder, cfg, tok, processor, hf, model


def _inputs(tok, processor, question="What is in the picture?", images=1):
    content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return image_prompt(processor, text, [photo_like(seed=i) for i in range(images)])


def _rel(got, ref) -> float:
    return (got - ref).abs().max().item() / ref.abs().max().item()


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
    inputs = _inputs(tok, processor, images=images)
    merge = hf.config.vision_config.spatial_merge_size ** 2
    assert int(inputs["mm_token_type_ids"].sum()) == int(inputs["image_grid_thw"].prod(-1).sum()) // merge
    with torch.no_grad():
        ref = hf(**inputs).logits
        got = model(**inputs).logits
        blank = hf(**dict(inputs, pixel_values=torch.zeros_like(inputs["pixel_values"]))).logits
    assert _rel(got, ref) < TOL
    assert _rel(blank, ref) > 10 * TOL  # the image is read, not ignored


def test_generator_greedy_tokens_equal_generate(family):
    _, _, _, tok, processor, hf, model = family
    inputs = _inputs(tok, processor)
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, n:].tolist()
    gen = Generator(model, tok)
    _, ids, finish = gen.generate(ImagePrompt.from_processor(inputs), SamplingParams(max_new_tokens=12))
    assert ids == ref and finish == "length"
    assert gen.last_stats.prompt_tokens == n


def test_generator_text_only_prompt_on_the_vision_model(family):
    _, _, _, tok, _, hf, model = family
    text = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    with torch.no_grad():
        ref_logits = hf(torch.tensor([ids])).logits
        got_logits = model(torch.tensor([ids])).logits
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None)[0, len(ids):]
    assert _rel(got_logits, ref_logits) < TOL
    _, got, _ = Generator(model, tok).generate(ids, SamplingParams(max_new_tokens=8))
    assert got == ref.tolist()


def test_gpu_rule_file_mapped_to_cpu_matches_transformers(family):
    """The GPU file's placements (experts out to cuda:0, the vision tower on cuda:0) read on a machine
    without CUDA through ``--device_map cuda=cpu``: the same logits."""
    arch, folder, _, tok, processor, hf, _ = family
    model = load_model(folder, model_path=folder, rules=RULES_DIR / f"{FAMILIES[arch][0]}.yaml",
                       device_map="cuda=cpu", allow_unmatched=False)
    inputs = _inputs(tok, processor)
    with torch.no_grad():
        assert _rel(model(**inputs).logits, hf(**inputs).logits) < TOL


def test_local_chat_image_command(family, tmp_path):
    """``/image PATH`` then a question: the answer and prompt length of transformers' generate() on
    the picture's markup, a newline and the question."""
    from test_local_chat import STATS_RE, _spawn

    _, folder, cfg, tok, _, hf, _ = family
    question = "What is in the picture?"
    support = image_support(cfg, tok, folder)
    text = tok.apply_chat_template([{"role": "user", "content": f"{support.markup}\n{question}"}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = support.prompt(text, [photo_like()])
    with torch.no_grad():
        out = hf.generate(torch.tensor([list(prompt)]), **prompt.vision.inputs, max_new_tokens=6, do_sample=False,
                          eos_token_id=None)
    answer = tok.decode(out[0, len(prompt):], skip_special_tokens=True)
    pic = tmp_path / "pic.png"
    buf = io.BytesIO()
    photo_like().save(buf, format="PNG")
    pic.write_bytes(buf.getvalue())
    pexpect, child = _spawn("--model_path", folder, "--max_new_tokens", 6, "--cpu_infer", 1)
    try:
        child.expect_exact("Chat: ")
        child.sendline(f"/image {pic}")
        child.expect_exact("pic.png: 90x60 attached to your next message (1 waiting)")
        child.expect_exact("Chat: ")
        child.sendline(question)
        child.expect_exact(answer)
        child.expect(STATS_RE)
        assert int(child.match.group(1)) == len(prompt)
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def test_batching_engine_pictures_beside_text(family):
    """The batching engine (the server's default): a prompt with a picture read whole in a step of its
    own, then decoded in one batch with a text request; each answer is generate()'s for it alone."""
    from .test_batch_images import _engine, _prompt, _reference, _serve

    _, folder, cfg, tok, _, hf, model = family
    support = image_support(cfg, tok, folder)
    prompts = [_prompt(tok, support, "What is in the picture?", [photo_like()]), _prompt(tok, support, "Hello there", [])]
    results = _serve(_engine(model, tok, support), prompts)
    assert [toks for toks, _ in results] == [_reference(hf, p) for p in prompts]
