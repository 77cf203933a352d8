"""Every tool-call syntax of the shipped families, whole and streamed in pieces of every size, and
gpt-oss harmony channels (no model needed)."""

from __future__ import annotations

import json

import pytest

from ktransformers.server.harmony import HarmonyStream, is_harmony_template
from ktransformers.server.tool_calls import ToolCallStream, parse_tool_calls

GLM = ("Let me look.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
       "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>")
QWEN_XML = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n</function>\n</tool_call>")
KIMI = ("Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 3}<|tool_call_end|><|tool_calls_section_end|>')
MINIMAX = ('Let me look.<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
           '<parameter name="days">3</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>')
WANT = ("get_weather", {"city": "Paris", "days": 3})


def _calls(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _stream(parser, text, step):
    items = []
    for i in range(0, len(text), step):
        items += parser.feed(text[i:i + step])
    return items + parser.finish()


@pytest.mark.parametrize("text,content,calls", [
    (GLM, "Let me look.", [WANT]),
    (QWEN_XML, "", [WANT]),
    (KIMI, "Let me look.", [WANT]),
    (MINIMAX, "Let me look.", [WANT, ("get_time", {})]),
    ("<tool_call>get_time</tool_call>", "", [("get_time", {})]),  # GLM, no arguments
])
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_each_call_syntax_whole_and_streamed(text, content, calls, step):
    got, parsed = parse_tool_calls(text)
    assert (got, _calls(parsed)) == (content, calls)
    items = _stream(ToolCallStream(), text, step)
    assert "".join(v for k, v in items if k == "text").strip() == content
    assert _calls([v for k, v in items if k == "call"]) == calls


@pytest.mark.parametrize("bad", [
    "<tool_call>{\"name\": broken</tool_call>",                      # neither JSON nor a name
    "<tool_call>two words</tool_call>",
    "<|tool_call_begin|>functions.f:0 no args marker<|tool_call_end|>",
    '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{not json<|tool_call_end|>',
    "<minimax:tool_call>no invoke here</minimax:tool_call>",
])
def test_malformed_calls_stay_text(bad):
    assert parse_tool_calls(bad) == (bad, [])


HARMONY = ("<|channel|>analysis<|message|>User wants weather. Call tool.<|end|>"
           "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
           '{"city": "Paris", "days": 3}<|call|>')
HARMONY_ANSWER = ("<|channel|>analysis<|message|>Easy: 4.<|end|><|start|>assistant<|channel|>final<|message|>"
                  "The answer is 4.<|return|>")


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_harmony_channels(step):
    items = _stream(HarmonyStream(tools=True), HARMONY, step)
    assert "".join(v for k, v in items if k == "reasoning") == "User wants weather. Call tool."
    assert _calls([v for k, v in items if k == "call"]) == [WANT]
    assert not [v for k, v in items if k == "text"]
    items = _stream(HarmonyStream(tools=False), HARMONY_ANSWER, step)
    assert "".join(v for k, v in items if k == "reasoning") == "Easy: 4."
    assert "".join(v for k, v in items if k == "text") == "The answer is 4."


def test_harmony_edge_cases():
    # no end marker (the stop token was not detokenized): the open call is read at the end
    items = _stream(HarmonyStream(), HARMONY[:-len("<|call|>")], 4)
    assert _calls([v for k, v in items if k == "call"]) == [WANT]
    # without tools a call is text; bad JSON is text; output that is not harmony is plain text
    kinds = [k for k, _ in _stream(HarmonyStream(tools=False), HARMONY, 5)]
    assert set(kinds[:-1]) == {"reasoning"} and kinds[-1] == "text"
    bad = "<|channel|>commentary to=functions.f<|message|>{oops<|call|>"
    assert _stream(HarmonyStream(), bad, 3) == [("text", "{oops")]
    plain = _stream(HarmonyStream(), "Just text.", 2)
    assert plain[0] == ("text", "Ju") and "".join(v for _, v in plain) == "Just text."  # not held back
    assert is_harmony_template("{{ '<|start|>' + role + '<|channel|>' }}") and not is_harmony_template("<think>")
