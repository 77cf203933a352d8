"""Special tokens that carry structure (a tool-call section marker, a harmony channel) stay in the
streamed text when asked for; the other special tokens (end of turn) are still left out."""

from __future__ import annotations

from transformers import AutoTokenizer

from ktransformers.generation.text import IncrementalDetokenizer, special_ids, token_ids_of


def test_kept_special_tokens_survive_and_others_do_not(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir("qwen3_moe"))
    tok.add_special_tokens({"additional_special_tokens": ["<|channel|>", "<|tool_call_begin|>"]})
    channel, call = tok.convert_tokens_to_ids(["<|channel|>", "<|tool_call_begin|>"])
    eos = tok.eos_token_id
    assert {channel, call, eos} <= special_ids(tok)
    ids = tok.encode("Hi", add_special_tokens=False) + [channel] + tok.encode("final", add_special_tokens=False) \
        + [call, eos]

    def stream(**kw):
        d = IncrementalDetokenizer(tok, **kw)
        return "".join(d.add(i) for i in ids) + d.flush()

    assert stream() == tok.decode(ids, skip_special_tokens=True)  # default: unchanged
    keep = token_ids_of(tok, ["<|channel|>", "<|tool_call_begin|>", "<not a token>"])
    assert keep == {channel, call}
    text = stream(keep_ids=keep)
    assert "<|channel|>" in text and "<|tool_call_begin|>" in text and tok.decode([eos]) not in text
    assert text.replace("<|channel|>", "").replace("<|tool_call_begin|>", "") == stream()
