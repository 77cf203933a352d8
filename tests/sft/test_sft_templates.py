"""Prompt templates: the loss sees the assistant's tokens (and its end-of-turn token) only."""

from __future__ import annotations

import pytest

from ktransformers.errors import ConfigError
from ktransformers.sft.templates import IGNORE_INDEX, TEMPLATES, check_template, encode
from ktransformers.util.tiny_models import make_tiny_tokenizer

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Capital of Peru?"}, {"role": "assistant", "content": "Lima"},
        {"role": "user", "content": "And Chile?"}, {"role": "assistant", "content": "Santiago"}]


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def _spans(ids, labels, tok):
    """Decoded runs of labelled tokens."""
    out, cur = [], []
    for i, lab in zip(ids, labels):
        if lab == IGNORE_INDEX:
            if cur:
                out.append(tok.decode(cur))
                cur = []
        else:
            assert lab == i
            cur.append(i)
    if cur:
        out.append(tok.decode(cur))
    return out


@pytest.mark.parametrize("template", [None, "chatml", "qwen3"])
def test_only_assistant_turns_are_labelled(tok, template):
    ids, labels = encode(CONV, tok, template, cutoff_len=1000)
    assert _spans(ids, labels, tok) == ["Lima<|im_end|>\n", "Santiago<|im_end|>\n"]
    # everything else is the prompt, exactly as the tokenizer's own chat template renders it
    assert tok.decode(ids) == tok.apply_chat_template(CONV, tokenize=False)


def test_named_chatml_equals_the_tokenizers_template(tok):
    assert encode(CONV, tok, "chatml", 1000) == encode(CONV, tok, None, 1000)


def test_alpaca_and_default_templates_end_turns_with_eos(tok):
    for name in ("alpaca", "default"):
        ids, labels = encode(CONV[:3], tok, name, 1000)
        spans = _spans(ids, labels, tok)
        assert len(spans) == 1 and spans[0].startswith("Lima" + tok.eos_token), (name, spans)
        assert "Capital of Peru?" in tok.decode(ids) and "Be brief." in tok.decode(ids)
    ids, _ = encode(CONV[1:3], tok, "alpaca", 1000)
    assert tok.decode(ids).startswith(TEMPLATES["alpaca"].default_system)


def test_cutoff_len_cuts_the_sequence(tok):
    ids, labels = encode(CONV, tok, "chatml", cutoff_len=40)
    assert len(ids) == len(labels) == 40
    full_ids, full_labels = encode(CONV, tok, "chatml", 1000)
    assert ids == full_ids[:40] and labels == full_labels[:40]


def test_template_checks(tok):
    check_template("chatml", tok)
    with pytest.raises(ConfigError, match="unknown template 'chatm'; did you mean 'chatml'"):
        check_template("chatm", tok)
    with pytest.raises(ConfigError, match="'llama3' ends turns with '<\\|eot_id\\|>', which is not a single token"):
        check_template("llama3", tok)
    bare = make_tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ConfigError, match="the tokenizer has no chat template"):
        check_template(None, bare)
