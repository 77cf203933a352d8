"""What the image-text model tests share (test_qwen3_vl_moe.py, test_vl_families.py, test_mmproj.py,
test_local_chat_image.py, test_server_images.py): the unmodified transformers reference, the
processor's inputs for a picture and a question, greedy decoding against generate(), and
local_chat's ``/image`` turn (sessions: test_local_chat.chat_session)."""

from __future__ import annotations

import io

import torch

from ktransformers.generation.engine import Generator
from ktransformers.generation.sampling import SamplingParams
from ktransformers.multimodal.processor import image_prompt, load_processor
from ktransformers.multimodal.prompt import ImagePrompt

from test_local_chat import STATS_RE

from .conftest import photo_like

QUESTION = "What is in the picture?"


def reference(folder):
    """(config, tokenizer, the model's processor, transformers' unmodified model in fp32) of ``folder``."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    cfg = AutoConfig.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    processor = load_processor(folder, cfg, tok)
    hf = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return cfg, tok, processor, hf


def chat_inputs(tok, processor, question=QUESTION, images=1):
    """The processor's model inputs for one user turn: ``images`` photo-like pictures, then ``question``."""
    content = [{"type": "image"}] * images + [{"type": "text", "text": question}]
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    return image_prompt(processor, text, [photo_like(seed=i) for i in range(images)])


def rel(got, ref) -> float:
    """max |got - ref| relative to max |ref| (the tolerances' measure)."""
    return (got - ref).abs().max().item() / ref.abs().max().item()


def check_logits_on_pictures(model, hf, tok, processor, images: int, tol: float, blank_factor: float) -> None:
    """Logits for ``images`` pictures and the question within ``tol`` of max |logit| of transformers',
    the image tokens those the processor's grid gives, and a blank picture moving transformers' own
    logits by more than ``blank_factor`` x ``tol`` (the picture is read, not ignored)."""
    inputs = chat_inputs(tok, processor, images=images)
    merge = hf.config.vision_config.spatial_merge_size ** 2
    assert int(inputs["mm_token_type_ids"].sum()) == int(inputs["image_grid_thw"].prod(-1).sum()) // merge
    with torch.no_grad():
        ref = hf(**inputs).logits
        got = model(**inputs).logits
        blank = hf(**dict(inputs, pixel_values=torch.zeros_like(inputs["pixel_values"]))).logits
    assert rel(got, ref) < tol
    assert rel(blank, ref) > blank_factor * tol


def check_greedy_tokens_equal_generate(model, tok, processor, hf, new: int = 12) -> None:
    """The Generator's greedy tokens for a picture and QUESTION: generate()'s on the unmodified model,
    cut at ``new`` tokens, the prompt counted whole."""
    inputs = chat_inputs(tok, processor)
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=new, do_sample=False, eos_token_id=None)[0, n:].tolist()
    gen = Generator(model, tok)
    _, ids, finish = gen.generate(ImagePrompt.from_processor(inputs), SamplingParams(max_new_tokens=new))
    assert ids == ref and finish == "length"
    assert gen.last_stats.prompt_tokens == n


def text_prompt_ids(tok) -> list[int]:
    """A text-only chat turn's prompt tokens."""
    text = tok.apply_chat_template([{"role": "user", "content": "Hello there"}], tokenize=False,
                                   add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def check_text_only_greedy(model, tok, hf, new: int = 8) -> None:
    """The Generator's greedy tokens for a text-only prompt on the image-text model: generate()'s."""
    ids = text_prompt_ids(tok)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None)[0, len(ids):]
    _, got, _ = Generator(model, tok).generate(ids, SamplingParams(max_new_tokens=new))
    assert got == ref.tolist()


def chat_answer(support, tok, hf, question=QUESTION, new: int = 6) -> tuple[int, str]:
    """(prompt tokens, greedy text) of transformers for local_chat's ``/image`` turn: the picture's
    markup, a newline and ``question`` through the chat template."""
    text = tok.apply_chat_template([{"role": "user", "content": f"{support.markup}\n{question}"}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = support.prompt(text, [photo_like()])
    with torch.no_grad():
        out = hf.generate(torch.tensor([list(prompt)]), **prompt.vision.inputs, max_new_tokens=new, do_sample=False,
                          eos_token_id=None)
    return len(prompt), tok.decode(out[0, len(prompt):], skip_special_tokens=True)


def png(img=None) -> bytes:
    """``img`` (default: the photo-like picture) as PNG bytes."""
    buf = io.BytesIO()
    (photo_like() if img is None else img).save(buf, format="PNG")
    return buf.getvalue()


def ask_about_picture(child, pic, n_prompt: int, answer: str, question=QUESTION) -> None:
    """``/image pic`` then ``question`` at local_chat's prompt: the picture is attached, the answer
    is ``answer`` and the prompt counts ``n_prompt`` tokens."""
    child.sendline(f"/image {pic}")
    child.expect_exact(f"{pic.name}: 90x60 attached to your next message (1 waiting)")
    child.expect_exact("Chat: ")
    child.sendline(question)
    child.expect_exact(answer)
    child.expect(STATS_RE)
    assert int(child.match.group(1)) == n_prompt
