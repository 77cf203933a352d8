"""Reasoning switched on and off per request (OpenAI ``reasoning_effort`` / ``chat_template_kwargs``,
Responses ``reasoning.effort``, Ollama ``think``) and ``--force_think``: what the prompt becomes,
and where the reasoning lands in each API's answer."""

from __future__ import annotations

import jinja2
import pytest

from ktransformers.server.errors import APIError
from ktransformers.server.prompting import chat_prompt, think_setting

QWEN3 = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
         "<think>\n\n</think>\n\n{% endif %}")
R1 = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|Assistant|><think>\n"
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
HARMONY = ("{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
           "<|message|>{{ m.content }}<|end|>{% endfor %}"
           "<|start|>assistant{# reasoning: {{ reasoning_effort }} #}")


class TemplateEngine:
    """The part of the server Engine that chat_prompt uses; one id per character."""

    template_supports_tools = False

    def __init__(self, template):
        self.chat_template = template
        self.seen_kwargs: dict = {}

    def apply_chat_template(self, messages, tools=None, template_kwargs=None):
        self.seen_kwargs = dict(template_kwargs or {})
        return self.encode(jinja2.Template(self.chat_template).render(messages=messages, **self.seen_kwargs))

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(map(chr, ids))


MSGS = [{"role": "user", "content": "2+2?"}]


def _text(engine, **kw):
    p = chat_prompt(engine, MSGS, None, **kw)
    return engine.decode(p.ids), p


def test_think_setting_sources():
    assert think_setting() is None
    assert think_setting(effort="none") is False and think_setting(effort="low") is True
    assert think_setting(think=False) is False and think_setting(think="high") is True
    assert think_setting(effort="high", template_kwargs={"enable_thinking": False}) is False
    with pytest.raises(APIError, match="reasoning effort 'lots'"):
        think_setting(effort="lots")
    with pytest.raises(APIError, match="'think' must be"):
        think_setting(think="maybe")


def test_qwen3_template_is_told():
    e = TemplateEngine(QWEN3)
    text, p = _text(e, think=False)
    assert e.seen_kwargs == {"enable_thinking": False, "thinking": False}
    assert text.endswith("<think>\n\n</think>\n\n") and not p.inside_think
    text, p = _text(e, think=True)  # the template leaves the tag to the model: opened for it
    assert text.endswith("<|im_start|>assistant\n<think>\n") and p.inside_think
    text, p = _text(e)  # the model's default: untouched
    assert text.endswith("<|im_start|>assistant\n") and not p.inside_think and e.seen_kwargs == {}


def test_forced_think_template_closed_when_off():
    e = TemplateEngine(R1)
    text, p = _text(e)
    assert text.endswith("<think>") and p.inside_think
    text, p = _text(e, think=False)
    assert text.endswith("<think>\n\n</think>\n\n") and not p.inside_think
    reasoning, answer, _ = p.parser(False).parse("4")
    assert (reasoning, answer) == (None, "4")


def test_force_think_and_plain_templates():
    e = TemplateEngine(PLAIN)
    text, p = _text(e, think=True)  # no think tags in the template: nothing to open
    assert text.endswith("<assistant>") and not p.inside_think
    text, p = _text(e, force_think=True)
    assert text.endswith("<assistant><think>\n") and p.inside_think
    assert p.parser(False).parse("plan</think>4") == ("plan", "4", [])


def test_harmony_effort_goes_to_the_template():
    e = TemplateEngine(HARMONY)
    _, p = _text(e, think=True, effort="high", force_think=True)
    assert p.harmony and not p.inside_think and e.seen_kwargs["reasoning_effort"] == "high"
    out = "<|channel|>analysis<|message|>2+2=4<|end|><|start|>assistant<|channel|>final<|message|>4"
    assert p.parser(False).parse(out) == ("2+2=4", "4", [])


# ---- through the APIs, scripted model output ----------------------------------------------

openai = pytest.importorskip("openai")


@pytest.fixture
def scripted(live_app, make_engine, tiny):
    from ktransformers.generation import Generator

    from .test_openai import ScriptedGenerator

    def make(replies, **settings):
        model, tok = tiny
        gen = ScriptedGenerator(Generator(model, tok), replies)
        return live_app(make_engine(gen), **settings), gen

    return make


def test_force_think_on_every_route(scripted):
    import httpx

    from .conftest import MODEL_NAME

    app, gen = scripted(["plan A</think>Hi!"] * 4, force_think=True)
    with app as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        m = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}]).choices[0]
        assert (m.message.reasoning_content, m.message.content) == ("plan A", "Hi!")
        r = c.responses.create(model=MODEL_NAME, input="Hi")
        assert [o.type for o in r.output] == ["reasoning", "message"] and r.output_text == "Hi!"
        j = httpx.post(srv.url + "/api/chat", json={"model": MODEL_NAME, "stream": False,
                                                    "messages": [{"role": "user", "content": "Hi"}]}).json()
        assert j["message"]["thinking"] == "plan A" and j["message"]["content"] == "Hi!"
        lines = httpx.post(srv.url + "/api/generate", json={"model": MODEL_NAME, "prompt": "Hi"}).text.splitlines()
        import json

        parts = [json.loads(x) for x in lines]
        assert "".join(p.get("thinking", "") for p in parts) == "plan A"
        assert "".join(p["response"] for p in parts) == "Hi!"
    assert all(p.rstrip().endswith("<think>") for p in gen.prompts)


def test_per_request_switch_reaches_the_template(scripted):
    from .conftest import MODEL_NAME

    app, gen = scripted(["4", "4"])
    with app as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        kw = dict(model=MODEL_NAME, messages=MSGS)
        assert c.chat.completions.create(reasoning_effort="low", **kw).choices[0].message.content == "4"
        with pytest.raises(openai.BadRequestError):
            c.chat.completions.create(extra_body={"reasoning_effort": "lots"}, **kw)
        c.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kw)
    assert len(gen.prompts) == 2


def test_app_keeps_the_parsed_markers_in_the_stream(make_engine, tmp_path):
    from ktransformers.generation.text import token_ids_of
    from ktransformers.server import Settings, create_app
    from ktransformers.server.prompting import output_markers

    engine = make_engine()
    create_app(engine, Settings(data_dir=str(tmp_path)))
    tok = engine.generator.tokenizer
    assert engine.generator.keep_special_ids == token_ids_of(tok, output_markers())
    assert tok.convert_tokens_to_ids("<think>") in engine.generator.keep_special_ids


def test_json_output_formats_are_refused_not_ignored(scripted):
    from .conftest import MODEL_NAME

    app, gen = scripted(["plain", "plain"])
    with app as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}):
            with pytest.raises(openai.BadRequestError, match="response_format type"):
                c.chat.completions.create(model=MODEL_NAME, messages=MSGS, response_format=fmt)
        with pytest.raises(openai.BadRequestError, match="text.format type 'json_object'"):
            c.responses.create(model=MODEL_NAME, input="Hi", text={"format": {"type": "json_object"}})
        ok = c.chat.completions.create(model=MODEL_NAME, messages=MSGS, response_format={"type": "text"})
        assert ok.choices[0].message.content == "plain"
        assert c.responses.create(model=MODEL_NAME, input="Hi", text={"format": {"type": "text"}}).output_text == "plain"
