"""Tool-call parsing, FIM prompts and Ollama template rendering (no model needed)."""

from __future__ import annotations

import json

import pytest

from ktransformers.server.errors import APIError
from ktransformers.server.prompting import fim_prompt, render_go_template, template_messages
from ktransformers.server.tool_calls import ToolCallStream, parse_tool_calls


def test_parse_tool_calls():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"name": "g", ' \
           '"arguments": "{\\"y\\": 2}"}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Sure."
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert json.loads(calls[1]["function"]["arguments"]) == {"y": 2}
    assert parse_tool_calls("no calls <tool_call>not json</tool_call>") == \
        ("no calls <tool_call>not json</tool_call>", [])
    # an unterminated final block (the model stopped at EOS) still counts
    _, calls = parse_tool_calls('<tool_call>{"name": "h", "arguments": {}}')
    assert calls[0]["function"]["name"] == "h"


@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_tool_call_stream_any_split(step):
    text = 'Hi <tool_c and <tool_call>{"name": "f", "arguments": {"a": "<"}}</tool_call> bye'
    p = ToolCallStream()
    items = []
    for i in range(0, len(text), step):
        items += p.feed(text[i:i + step])
    items += p.finish()
    out = "".join(v for k, v in items if k == "text")
    calls = [v for k, v in items if k == "call"]
    assert out == "Hi <tool_c and  bye"
    assert len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]) == {"a": "<"}


def test_template_messages_without_native_tools():
    msgs = [{"role": "developer", "content": [{"type": "text", "text": "be nice"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    out = template_messages(msgs, native_tools=False)
    assert out[0] == {"role": "system", "content": "be nice"}
    assert out[1]["content"].startswith("<tool_call>") and '"x": 1' in out[1]["content"]
    assert out[2] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    native = template_messages(msgs, native_tools=True)
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    with pytest.raises(APIError):
        template_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], False)


class _Tok:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return {t: i for i, t in enumerate(self.vocab)}


def test_fim_prompt_styles():
    q = _Tok(["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"])
    assert fim_prompt(q, "a", "b") == ("<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>", True)
    ds = _Tok(["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"])
    assert fim_prompt(ds, "a", "b") == ("<｜fim▁begin｜>a<｜fim▁hole｜>b<｜fim▁end｜>", True)
    assert fim_prompt(_Tok(["x"]), "a", "b") == ("a", False)  # documented fallback: prefix only


def test_go_template_subset():
    v = {"System": "S", "Prompt": "P", "Suffix": ""}
    assert render_go_template("{{ .Prompt }}", v) == "P"
    t = "{{ if .System }}<sys>{{ .System }}</sys>\n{{- end }}{{ if .Suffix }}F{{ else }}[{{ .Prompt }}]{{ end }}"
    assert render_go_template(t, v) == "<sys>S</sys>[P]"
    assert render_go_template(t, dict(v, Suffix="x", System="")) == "F"
    for bad in ("{{ range .Messages }}x{{ end }}", "{{ if .Prompt }}x", "{{ .Tools }}"):
        with pytest.raises(APIError):
            render_go_template(bad, v)
