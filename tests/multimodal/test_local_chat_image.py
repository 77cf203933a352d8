"""local_chat's ``/image PATH`` on the tiny Qwen3-VL-MoE: a bad file is refused in one line, a
picture goes with the next message, the prompt counts its tokens and the answer is transformers'
greedy answer to the same prompt; /undo forgets the turn's picture with it."""

from __future__ import annotations

import io

import pytest
import torch

from test_local_chat import STATS_RE, _spawn

from .conftest import photo_like

QUESTION = "What is in the picture?"


@pytest.fixture(scope="module")
def expected(tiny_vl):
    """(prompt tokens, greedy text) of transformers for the picture's markup, a newline and QUESTION."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    from ktransformers.multimodal.chat import image_support

    tok = AutoTokenizer.from_pretrained(tiny_vl)
    support = image_support(AutoConfig.from_pretrained(tiny_vl), tok, tiny_vl)
    text = tok.apply_chat_template([{"role": "user", "content": f"{support.markup}\n{QUESTION}"}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = support.prompt(text, [photo_like()])
    hf = AutoModelForImageTextToText.from_pretrained(tiny_vl, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([list(prompt)]), **prompt.vision.inputs, max_new_tokens=6, do_sample=False,
                          eos_token_id=None)
    return len(prompt), tok.decode(out[0, len(prompt):], skip_special_tokens=True)


def test_image_command(tiny_vl, tmp_path, expected):
    n_prompt, answer = expected
    pic, bad = tmp_path / "pic.png", tmp_path / "bad.png"
    buf = io.BytesIO()
    photo_like().save(buf, format="PNG")
    pic.write_bytes(buf.getvalue())
    bad.write_bytes(buf.getvalue()[:100])
    pexpect, child = _spawn("--model_path", tiny_vl, "--max_new_tokens", 6, "--cpu_infer", 1)
    try:
        child.expect_exact("Chat: ")
        child.sendline(f"/image {tmp_path / 'missing.png'}")
        child.expect_exact("missing.png: cannot read")
        child.sendline(f"/image {bad}")
        child.expect_exact("bad.png: corrupt or truncated image data")
        child.sendline(f"/image {pic}")
        child.expect_exact("pic.png: 90x60 attached to your next message (1 waiting)")
        child.expect_exact("Chat: ")
        child.sendline(QUESTION)
        child.expect_exact(answer)
        child.expect(STATS_RE)
        assert int(child.match.group(1)) == n_prompt
        child.expect_exact("Chat: ")
        child.sendline("/undo")  # the picture goes with its turn: the next prompt holds no image
        child.expect_exact("turn(s) left]")
        child.sendline("hi")
        child.expect(STATS_RE)
        assert int(child.match.group(1)) < 40
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0, child.before


def test_image_command_on_a_text_model(tiny_model_dir):
    pexpect, child = _spawn("--model_path", tiny_model_dir("llama"), "--max_new_tokens", 2, "--cpu_infer", 1)
    try:
        child.expect_exact("Chat: ")
        child.sendline("/image x.png")
        child.expect_exact("[/image needs a vision-language model; this one takes text only]")
        child.sendeof()
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0
