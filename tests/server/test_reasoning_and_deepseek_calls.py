"""<think> splitting and DeepSeek's tool-call tokens (no model needed)."""

from __future__ import annotations

import json

import pytest

from ktransformers.server.prompting import OutputParser, ThinkStream, prompt_opens_think
from ktransformers.server.tool_calls import (DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP,
                                             ToolCallStream, parse_tool_calls)


def split_reasoning(text, inside=False):
    return OutputParser(False, inside).parse(text)[:2]

V3 = (f"Checking.{DS_CALLS_BEGIN}{DS_CALL_BEGIN}function{DS_SEP}get_weather\n```json\n{{\"city\": \"Paris\"}}\n```"
      f"{DS_CALL_END}{DS_CALL_BEGIN}function{DS_SEP}get_time\n```json\n{{}}\n```{DS_CALL_END}{DS_CALLS_END}")
V31 = f"{DS_CALLS_BEGIN}{DS_CALL_BEGIN}get_weather{DS_SEP}{{\"city\": \"Oslo\"}}{DS_CALL_END}{DS_CALLS_END}"


def _run(parser, text, step):
    items = []
    for i in range(0, len(text), step):
        items += parser.feed(text[i:i + step])
    return items + parser.finish()


def test_deepseek_v3_calls_whole():
    content, calls = parse_tool_calls(V3)
    assert content == "Checking."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert json.loads(calls[1]["function"]["arguments"]) == {}


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_deepseek_calls_any_split(step):
    items = _run(ToolCallStream(), V31, step)
    calls = [v for k, v in items if k == "call"]
    assert "".join(v for k, v in items if k == "text") == ""
    assert len(calls) == 1 and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}


def test_malformed_deepseek_call_stays_text():
    bad = f"{DS_CALL_BEGIN}get_weather{DS_SEP}{{not json{DS_CALL_END}"
    assert parse_tool_calls(bad) == (bad, [])
    bad2 = f"{DS_CALL_BEGIN}no separator{DS_CALL_END}"
    assert parse_tool_calls(bad2) == (bad2, [])


def test_mixed_hermes_and_deepseek():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call> and ' + V31
    content, calls = parse_tool_calls(text)
    assert content == "and" and [c["function"]["name"] for c in calls] == ["a", "get_weather"]


THOUGHT = "<think>\nLet me think: 2 + 2 < 5.\n</think>\n\nThe answer is 4."


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_think_split_any_split(step):
    items = _run(ThinkStream(), THOUGHT, step)
    assert "".join(v for k, v in items if k == "reasoning") == "Let me think: 2 + 2 < 5."
    assert "".join(v for k, v in items if k == "text") == "The answer is 4."


def test_split_reasoning_cases():
    assert split_reasoning(THOUGHT) == ("Let me think: 2 + 2 < 5.", "The answer is 4.")
    assert split_reasoning("no thinking here") == (None, "no thinking here")
    assert split_reasoning(" <thin") == (None, " <thin")  # never became a tag
    # the prompt opened the reasoning (R1 templates, --force_think): no <think> in the output
    assert split_reasoning("hmm</think>Yes.", inside=True) == ("hmm", "Yes.")
    # cut off while thinking: all of it is reasoning, no answer
    assert split_reasoning("<think>still going") == ("still going", "")
    # a <think> later in the answer is text
    assert split_reasoning("Use <think> tags.") == (None, "Use <think> tags.")
    assert prompt_opens_think("<|Assistant|><think>\n") and not prompt_opens_think("<|Assistant|>")
