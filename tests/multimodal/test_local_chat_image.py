"""local_chat's ``/image PATH`` on the tiny Qwen3-VL-MoE: a bad file is refused in one line, a
picture goes with the next message, the prompt counts its tokens and the answer is transformers'
greedy answer to the same prompt; /undo forgets the turn's picture with it."""

from __future__ import annotations

import pytest

from test_local_chat import STATS_RE, chat_session

from .vl_checks import ask_about_picture, chat_answer, png, reference


@pytest.fixture(scope="module")
def expected(tiny_vl):
    """(prompt tokens, greedy text) of transformers for the picture's markup, a newline and the question."""
    from ktransformers.multimodal.chat import image_support

    cfg, tok, _, hf = reference(tiny_vl)
    return chat_answer(image_support(cfg, tok, tiny_vl), tok, hf)


def test_image_command(tiny_vl, tmp_path, expected):
    n_prompt, answer = expected
    pic, bad = tmp_path / "pic.png", tmp_path / "bad.png"
    pic.write_bytes(png())
    bad.write_bytes(png()[:100])
    with chat_session("--model_path", tiny_vl, "--max_new_tokens", 6, "--cpu_infer", 1) as child:
        child.sendline(f"/image {tmp_path / 'missing.png'}")
        child.expect_exact("missing.png: cannot read")
        child.sendline(f"/image {bad}")
        child.expect_exact("bad.png: corrupt or truncated image data")
        ask_about_picture(child, pic, n_prompt, answer)
        child.expect_exact("Chat: ")
        child.sendline("/undo")  # the picture goes with its turn: the next prompt holds no image
        child.expect_exact("turn(s) left]")
        child.sendline("hi")
        child.expect(STATS_RE)
        assert int(child.match.group(1)) < 40


def test_image_command_on_a_text_model(tiny_model_dir):
    with chat_session("--model_path", tiny_model_dir("llama"), "--max_new_tokens", 2, "--cpu_infer", 1) as child:
        child.sendline("/image x.png")
        child.expect_exact("[/image needs a vision-language model; this one takes text only]")
