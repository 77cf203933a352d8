"""From API requests to prompts, and from model text back to API objects.

* chat messages (OpenAI / Ollama / Assistants shapes) → the plain dicts chat templates expect;
* tools: passed to the chat template when it knows about tools, else described in a
  Hermes-style system prompt (the calls in the output are read by :mod:`.tool_calls`);
* reasoning: ``<think>…</think>`` split from the answer (:class:`ThinkStream`);
* fill-in-the-middle prompts from the tokenizer's FIM tokens (:func:`fim_prompt`);
* the small subset of Ollama's Go templates that ``/api/generate`` accepts in ``template``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from . import harmony, tool_calls
from .errors import APIError
from .harmony import HarmonyStream, is_harmony_template
from .tool_calls import ToolCallStream, held_back

# ---------------------------------------------------------------------------------------------
# messages


#: content parts that carry an image (``image`` with base64 ``data``: Ollama's ``images``, as read here)
IMAGE_PART_KINDS = ("image_url", "input_image", "image")


def content_text(content: Any, param: str = "messages", images=None) -> str:
    """OpenAI content (str, list of parts, None) → text.  Image parts go to ``images`` (a
    ``multimodal.chat.ImageCollector``: decoded, each replaced by the model's image markup) when the
    model takes images; otherwise, and for bad images, a 400."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                out.append(part)
                continue
            p = part if isinstance(part, dict) else part.model_dump()
            kind = p.get("type", "text")
            if kind in ("text", "input_text", "output_text"):
                t = p.get("text")
                where = f"{param}[{j}].text"
                if isinstance(t, dict):  # Assistants shape {"text": {"value": ...}}
                    t = t.get("value", "")
                    where += ".value"
                if t is not None and not isinstance(t, str):
                    raise APIError(400, f"'{where}' must be a string, not {type(t).__name__}", param=param)
                out.append(t or "")
            elif kind in IMAGE_PART_KINDS and images is not None:
                from ..multimodal.images import ImageError

                try:
                    out.append(images.add_part(p, f"{param}[{j}]"))
                except ImageError as e:
                    raise APIError(400, str(e), param=param) from None
            elif kind == "image_file" and images is not None:
                raise APIError(400, f"'{param}[{j}]': content part type 'image_file' is not supported: this server "
                                    f"stores no files; send an image_url part with a data: URL", param=param)
            elif kind in ("image_url", "image_file", "input_image", "input_audio", "image"):
                raise APIError(400, f"content part type '{kind}' is not supported: this model takes text only",
                               param=param)
            elif not isinstance(kind, str):
                raise APIError(400, f"'{param}[{j}].type' must be a string, not {type(kind).__name__}", param=param)
            else:
                raise APIError(400, f"unknown content part type '{kind}'", param=param)
        return "\n".join(out)
    raise APIError(400, "message content must be a string or a list of content parts", param=param)


def _arguments_obj(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return args
    return args if args is not None else {}


def template_messages(messages: list[dict], native_tools: bool, images=None) -> list[dict]:
    """Normalise messages for ``apply_chat_template``.

    With ``native_tools`` the template renders assistant ``tool_calls`` and ``tool`` messages
    itself; otherwise they become Hermes-style ``<tool_call>`` / ``<tool_response>`` text.
    ``images``: where image parts go (see :func:`content_text`).
    """
    out: list[dict] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role == "function":
            role = "tool"
        text = content_text(m.get("content"), f"messages[{i}].content", images)
        calls = m.get("tool_calls") or []
        if role == "assistant" and calls:
            norm = []
            for c in calls:
                fn = c.get("function") or {}
                norm.append({"name": fn.get("name", ""), "arguments": _arguments_obj(fn.get("arguments"))})
            if native_tools:
                out.append({"role": "assistant", "content": text,
                            "tool_calls": [{"type": "function", "function": n} for n in norm]})
            else:
                blocks = "".join(f"\n<tool_call>\n{json.dumps(n, ensure_ascii=False)}\n</tool_call>" for n in norm)
                out.append({"role": "assistant", "content": (text + blocks).lstrip("\n")})
            continue
        if role == "tool" and not native_tools:
            out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
            continue
        msg = {"role": role, "content": text}
        if role == "tool" and m.get("tool_call_id"):
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("name") and role != "tool":
            msg["name"] = m["name"]
        out.append(msg)
    return out


def tools_system_prompt(tools: list[dict], tool_choice: Any = None) -> str:
    """Hermes-style tool description for templates that do not render ``tools`` themselves."""
    lines = [json.dumps(t.get("function", t), ensure_ascii=False) for t in tools]
    text = ("# Tools\n\nYou can call functions to help answer. Their signatures, one JSON object per line:\n"
            "<tools>\n" + "\n".join(lines) + "\n</tools>\n\n"
            "To call a function, answer with one block per call:\n"
            "<tool_call>\n{\"name\": \"<function name>\", \"arguments\": {<arguments as JSON>}}\n</tool_call>")
    forced = forced_tool_name(tool_choice)
    if forced:
        text += f"\n\nYou must call the function '{forced}'."
    elif tool_choice == "required":
        text += "\n\nYou must call at least one function."
    return text


def forced_tool_name(tool_choice: Any) -> str | None:
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function") or {}
        return fn.get("name") or tool_choice.get("name")
    return None


def add_tool_prompt(messages: list[dict], tools: list[dict], tool_choice: Any) -> list[dict]:
    prompt = tools_system_prompt(tools, tool_choice)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = (first["content"] + "\n\n" + prompt) if first["content"] else prompt
        return [first] + messages[1:]
    return [{"role": "system", "content": prompt}] + messages


# ---------------------------------------------------------------------------------------------
# reasoning in model output

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def prompt_opens_think(prompt_tail: str) -> bool:
    """Templates of reasoning models (DeepSeek-R1, Qwen3 …) and ``--force_think`` may end the prompt
    with ``<think>``: the answer then starts inside the reasoning."""
    return prompt_tail.rstrip().endswith(THINK_OPEN)


class ThinkStream:
    """Splits ``<think>…</think>`` reasoning from the answer, whole or while streaming.

    ``feed(text)`` returns ``("reasoning", str)`` / ``("text", str)`` items.  Reasoning is only
    recognised at the start of the answer (or from the first token when ``inside``); whitespace
    around the reasoning is dropped, and text that may still become a tag is held back.
    """

    def __init__(self, inside: bool = False):
        self.state = "reasoning_start" if inside else "start"
        self.buf = ""
        self.saw_reasoning = inside

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(THINK_OPEN):
                    self.buf, self.state, self.saw_reasoning = s[len(THINK_OPEN):], "reasoning_start", True
                    continue
                if THINK_OPEN.startswith(s):
                    return out  # still undecided
                self.state = "text"
            elif self.state in ("reasoning_start", "answer_start"):
                self.buf = self.buf.lstrip()
                if not self.buf:
                    return out
                self.state = "reasoning" if self.state == "reasoning_start" else "text"
            elif self.state == "reasoning":
                j = self.buf.find(THINK_CLOSE)
                if j >= 0:
                    if self.buf[:j].rstrip():
                        out.append(("reasoning", self.buf[:j].rstrip()))
                    self.buf, self.state = self.buf[j + len(THINK_CLOSE):], "answer_start"
                    continue
                tag = held_back(self.buf, (THINK_CLOSE,))
                rest = self.buf[:len(self.buf) - tag]
                keep = tag + len(rest) - len(rest.rstrip())  # whitespace waits: it may precede </think>
                emit = self.buf[:len(self.buf) - keep]
                if emit:
                    out.append(("reasoning", emit))
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            else:  # text
                if self.buf:
                    out.append(("text", self.buf))
                self.buf = ""
                return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.state in ("start", "text") and self.buf:
            out.append(("text", self.buf))
        elif self.state == "reasoning" and self.buf.rstrip():
            out.append(("reasoning", self.buf.rstrip()))
        self.buf = ""
        return out


def output_markers() -> tuple[str, ...]:
    """Marker strings the output parsers read: a tokenizer's special tokens among them must stay in
    the streamed text (Kimi-K2's tool-call section, gpt-oss's channels are special tokens)."""
    return (THINK_OPEN, THINK_CLOSE, *tool_calls.ALL_MARKERS, *harmony.MARKERS)


class OutputParser:
    """Model output → ``("reasoning" | "text" | "call", value)`` items, whole or streamed:
    :class:`ThinkStream` first, then (with ``tools``) :class:`ToolCallStream` on the answer; or,
    for harmony models (gpt-oss), :class:`~.harmony.HarmonyStream`."""

    def __init__(self, tools: bool, inside_think: bool = False, harmony: bool = False):
        self.harmony = HarmonyStream(tools) if harmony else None
        self.think = ThinkStream(inside_think)
        self.calls = ToolCallStream() if tools else None

    def _answer(self, items) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for kind, val in items:
            out += self.calls.feed(val) if (kind == "text" and self.calls) else [(kind, val)]
        return out

    @property
    def thinking(self) -> bool:
        if self.harmony is not None:
            return self.harmony.thinking
        return self.think.state.startswith("reasoning")

    def feed(self, text: str) -> list[tuple[str, Any]]:
        if self.harmony is not None:
            return self.harmony.feed(text)
        return self._answer(self.think.feed(text))

    def finish(self) -> list[tuple[str, Any]]:
        if self.harmony is not None:
            return self.harmony.finish()
        return self._answer(self.think.finish()) + (self.calls.finish() if self.calls else [])

    def parse(self, text: str) -> tuple[str | None, str, list[dict]]:
        """(reasoning or None, answer, tool calls) of a whole output."""
        items = self.feed(text) + self.finish()
        calls = [v for k, v in items if k == "call"]
        reasoning = "".join(v for k, v in items if k == "reasoning")
        answer = "".join(v for k, v in items if k == "text")
        saw = self.think.saw_reasoning or any(k == "reasoning" for k, _ in items)
        return (reasoning if saw else None), (answer.strip() if calls else answer), calls


# ---------------------------------------------------------------------------------------------
# chat prompts, with the reasoning switched on or off per request

#: OpenAI ``reasoning_effort`` / Responses ``reasoning.effort`` values; "none" switches it off
EFFORTS = ("none", "minimal", "low", "medium", "high")


def think_setting(effort: Any = None, think: Any = None, template_kwargs: dict | None = None) -> bool | None:
    """Whether the request wants the model to reason: None = the model's default.

    ``effort`` is OpenAI's level ("none" = off), ``think`` Ollama's flag (True/False or a level),
    and ``enable_thinking`` / ``thinking`` in ``chat_template_kwargs`` (vLLM's spelling) win."""
    want: bool | None = None
    if isinstance(effort, str):
        if effort not in EFFORTS:
            raise APIError(400, f"reasoning effort '{effort}' is not one of {', '.join(EFFORTS)}",
                           param="reasoning_effort")
        want = effort != "none"
    if isinstance(think, bool):
        want = think
    elif isinstance(think, str):
        if think not in EFFORTS[2:]:
            raise APIError(400, f"'think' must be true, false, low, medium or high (got '{think}')", param="think")
        want = True
    for key in ("enable_thinking", "thinking"):
        v = (template_kwargs or {}).get(key)
        if isinstance(v, bool):
            want = v
    return want


THINK_PREFIX, THINK_SKIP = "<think>\n", "\n\n</think>\n\n"


@dataclass
class ChatPrompt:
    """A chat request's prompt ids and how to read the model's answer to it."""

    ids: list[int]
    inside_think: bool = False  # the prompt opened <think>: the answer starts in the reasoning
    harmony: bool = False       # gpt-oss channels

    def parser(self, tools: bool) -> OutputParser:
        return OutputParser(tools, self.inside_think, self.harmony)


def chat_prompt(engine, messages: list[dict], tools: list[dict] | None, tool_choice: Any = None, *,
                think: bool | None = None, effort: str | None = None, template_kwargs: dict | None = None,
                force_think: bool = False) -> ChatPrompt:
    """Prompt ids of a chat through the model's template, tools and reasoning settings applied.

    The template is told ``enable_thinking`` / ``thinking`` (Qwen3, GLM, DeepSeek-V3.1) and
    ``reasoning_effort`` (gpt-oss); a prompt the template leaves inside ``<think>`` is closed when
    the request turns reasoning off, and one that does not open it gets ``<think>`` when the
    request asks for reasoning on a think-tag model, or always with ``--force_think``."""
    native = engine.template_supports_tools
    support = getattr(engine, "images", None)  # a vision-language model's ImageSupport
    images = support.collector() if support is not None else None
    msgs = template_messages(messages, native, images)
    if tools and not native:
        msgs = add_tool_prompt(msgs, tools, tool_choice)
        tools = None
    kw: dict = {}
    if think is not None:
        kw.update(enable_thinking=think, thinking=think)
    if effort and effort != "none":
        kw["reasoning_effort"] = effort
    kw.update(template_kwargs or {})
    ids = engine.apply_chat_template(msgs, tools=tools if native else None, template_kwargs=kw or None)
    template = engine.chat_template or ""
    if is_harmony_template(template):
        return ChatPrompt(with_images(engine, ids, images), harmony=True)
    inside = prompt_opens_think(engine.decode(ids[-8:]))
    if inside and think is False:
        ids, inside = ids + engine.encode(THINK_SKIP, add_special_tokens=False), False
    elif not inside and (force_think or (think and THINK_OPEN in template)):
        ids, inside = ids + engine.encode(THINK_PREFIX, add_special_tokens=False), True
    return ChatPrompt(with_images(engine, ids, images), inside)


def with_images(engine, ids: list[int], images) -> list[int]:
    """The rendered prompt ``ids`` with the request's images: the processor reads the prompt's text
    (special tokens kept) and expands each image placeholder (a ``multimodal.prompt.ImagePrompt``)."""
    if images is None or not images.images:
        return ids
    from ..multimodal.images import ImageError

    try:
        return engine.images.prompt(engine.decode(ids), images.images)
    except ImageError as e:
        raise APIError(400, str(e), param="messages") from None


# ---------------------------------------------------------------------------------------------
# fill in the middle

# (prefix token, suffix token, middle token, order) — PSM: prefix, suffix, middle; SPM: suffix first
FIM_STYLES = [
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "psm"),   # Qwen2.5/3-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "psm"),         # StarCoder, Granite
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", "psm"),       # DeepSeek(-Coder) V2/V3
    ("[PREFIX]", "[SUFFIX]", "[MIDDLE]", "spm"),                       # Codestral
    ("<PRE>", "<SUF>", "<MID>", "codellama"),                          # CodeLlama
]


def fim_tokens(tokenizer) -> tuple[str, str, str, str] | None:
    try:
        vocab = tokenizer.get_vocab()
    except Exception:
        return None
    for style in FIM_STYLES:
        if all(t in vocab for t in style[:3]):
            return style
    return None


def fim_prompt(tokenizer, prefix: str, suffix: str) -> tuple[str, bool]:
    """(prompt, used_fim).  Without FIM tokens the fallback is the prefix alone (plain continuation)."""
    style = fim_tokens(tokenizer)
    if style is None:
        return prefix, False
    pre, suf, mid, order = style
    if order == "spm":
        return f"{suf}{suffix}{pre}{prefix}", True
    if order == "codellama":
        return f"{pre} {prefix} {suf}{suffix} {mid}", True
    return f"{pre}{prefix}{suf}{suffix}{mid}", True


# ---------------------------------------------------------------------------------------------
# Ollama Go templates (subset)

_GO = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
_VARS = ("System", "Prompt", "Suffix", "Response")


def render_go_template(template: str, values: dict[str, str]) -> str:
    """Render ``{{ .System }}``, ``{{ .Prompt }}``, ``{{ .Suffix }}``, ``{{ .Response }}`` and
    ``{{ if .X }}…{{ else }}…{{ end }}`` (nestable, with ``{{-``/``-}}`` trimming).  Anything
    else (``range .Messages``, functions, …) is refused with a 400 naming it."""
    parts: list[tuple[str, str]] = []  # ("text", s) / ("tag", expr)
    pos = 0
    trim_next = False
    for m in _GO.finditer(template):
        text = template[pos:m.start()]
        if trim_next:
            text = text.lstrip()
        if m.group(1):
            text = text.rstrip()
        parts.append(("text", text))
        parts.append(("tag", m.group(2)))
        trim_next = bool(m.group(3))
        pos = m.end()
    tail = template[pos:]
    parts.append(("text", tail.lstrip() if trim_next else tail))

    out: list[str] = []
    stack: list[tuple[bool, bool]] = []  # (branch active, any branch taken)

    def active() -> bool:
        return all(a for a, _ in stack)

    def var(expr: str) -> str:
        name = expr[1:] if expr.startswith(".") else None
        if name not in _VARS:
            raise APIError(400, f"template: '{{{{ {expr} }}}}' is not supported (supported: "
                                f"{', '.join('.' + v for v in _VARS)}, if/else/end)", param="template")
        return values.get(name, "") or ""

    for kind, val in parts:
        if kind == "text":
            if active():
                out.append(val)
            continue
        words = val.split()
        if words and words[0] == "if" and len(words) == 2:
            cond = bool(var(words[1])) if active() else False
            stack.append((cond, cond))
        elif words and words[0] == "else" and stack:
            if len(words) == 3 and words[1] == "if":
                _, taken = stack.pop()
                cond = (not taken) and bool(var(words[2]))
                stack.append((cond, taken or cond))
            elif len(words) == 1:
                _, taken = stack.pop()
                stack.append((not taken, True))
            else:
                var(val)
        elif val == "end" and stack:
            stack.pop()
        elif active():
            out.append(var(val))
        else:
            var(val)  # still validate
    if stack:
        raise APIError(400, "template: an '{{ if }}' has no matching '{{ end }}'", param="template")
    return "".join(out)
