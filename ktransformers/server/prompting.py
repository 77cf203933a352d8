"""From API requests to prompts, and from model text back to API objects.

* chat messages (OpenAI / Ollama / Assistants shapes) → the plain dicts chat templates expect;
* tools: passed to the chat template when it knows about tools, else described in a
  Hermes-style system prompt; tool calls are parsed from ``<tool_call>{json}</tool_call>``
  blocks or DeepSeek's tool-call tokens in the output, whole (:func:`parse_tool_calls`) or
  while streaming (:class:`ToolCallStream`);
* reasoning: ``<think>…</think>`` split from the answer (:class:`ThinkStream`);
* fill-in-the-middle prompts from the tokenizer's FIM tokens (:func:`fim_prompt`);
* the small subset of Ollama's Go templates that ``/api/generate`` accepts in ``template``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from .errors import APIError

# ---------------------------------------------------------------------------------------------
# messages


def content_text(content: Any, param: str = "messages") -> str:
    """OpenAI content (str, list of parts, None) → text; images are refused with a 400."""
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
            elif kind in ("image_url", "image_file", "input_image", "input_audio"):
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


def template_messages(messages: list[dict], native_tools: bool) -> list[dict]:
    """Normalise messages for ``apply_chat_template``.

    With ``native_tools`` the template renders assistant ``tool_calls`` and ``tool`` messages
    itself; otherwise they become Hermes-style ``<tool_call>`` / ``<tool_response>`` text.
    """
    out: list[dict] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "developer":
            role = "system"
        if role == "function":
            role = "tool"
        text = content_text(m.get("content"), f"messages[{i}].content")
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
# tool calls in model output

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
# DeepSeek V3 / R1 / V3.1: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>…<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
#: opening marker of one call → its closing marker
CALL_MARKERS = {TOOL_OPEN: TOOL_CLOSE, DS_CALL_BEGIN: DS_CALL_END}
#: wrappers around a group of calls: removed from the text, nothing else
CALL_WRAPPERS = (DS_CALLS_BEGIN, DS_CALLS_END)
_MARKERS = (*CALL_MARKERS, *CALL_WRAPPERS)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _unfence(body: str) -> str:
    body = body.strip()
    if body.startswith("```"):
        body = body.strip("`").strip()
        body = body[4:] if body.startswith("json") else body
    return body.strip()


def _make_call(name: Any, args: Any) -> dict | None:
    if not isinstance(name, str) or not name.strip():
        return None
    if isinstance(args, str):
        try:
            json.loads(args)
            arg_text = args
        except json.JSONDecodeError:
            arg_text = json.dumps(args)
    else:
        arg_text = json.dumps(args, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name.strip(), "arguments": arg_text}}


def _parse_deepseek_call(body: str) -> dict | None:
    """V3 / R1: ``function<｜tool▁sep｜>NAME`` then the arguments in a json code fence;
    V3.1: ``NAME<｜tool▁sep｜>ARGS``."""
    head, sep, rest = body.partition(DS_SEP)
    if not sep:
        return None
    head = head.strip()
    if head == "function":
        name, _, rest = rest.strip().partition("\n")
    else:
        name = head
    try:
        args = json.loads(_unfence(rest) or "{}")
    except json.JSONDecodeError:
        return None
    return _make_call(name, args) if isinstance(args, dict) else None


def _parse_call(body: str, opener: str = TOOL_OPEN) -> dict | None:
    if opener == DS_CALL_BEGIN:
        return _parse_deepseek_call(body)
    try:
        obj = json.loads(_unfence(body))
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict):
        return None
    return _make_call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})))


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split model output into (content outside tool-call blocks, OpenAI ``tool_calls``).

    Blocks are Hermes/Qwen ``<tool_call>{json}</tool_call>`` or DeepSeek's tool-call tokens; a
    block that does not parse stays in the content as text."""
    p = ToolCallStream()
    items = p.feed(text) + p.finish()
    content = "".join(v for k, v in items if k == "text")
    return (content.strip() if p.calls else text), p.calls


def _held_back(buf: str, markers) -> int:
    """Length of the longest tail of ``buf`` that could still grow into one of ``markers``."""
    for k in range(min(max(map(len, markers)) - 1, len(buf)), 0, -1):
        tail = buf[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


class ToolCallStream:
    """Incremental version of :func:`parse_tool_calls` for streamed output.

    ``feed(text)`` returns a list of ``("text", str)`` and ``("call", tool_call)`` items;
    text that might be the start of a call marker is held back until it is decided.
    """

    def __init__(self):
        self.buf = ""
        self.opener: str | None = None  # the marker of the call being read
        self.calls: list[dict] = []

    @property
    def in_call(self) -> bool:
        return self.opener is not None

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if self.opener is None:
                hits = [(i, m) for m in _MARKERS if (i := self.buf.find(m)) >= 0]
                if hits:
                    i, m = min(hits)
                    if i:
                        out.append(("text", self.buf[:i]))
                    self.buf = self.buf[i + len(m):]
                    self.opener = m if m in CALL_MARKERS else None
                    continue
                keep = _held_back(self.buf, _MARKERS)
                emit = self.buf[:len(self.buf) - keep]
                if emit:
                    out.append(("text", emit))
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            close = CALL_MARKERS[self.opener]
            j = self.buf.find(close)
            if j < 0:
                return out
            body, self.buf = self.buf[:j], self.buf[j + len(close):]
            out.append(self._call(body, close))

    def _call(self, body: str, close: str) -> tuple[str, Any]:
        opener, self.opener = self.opener, None
        call = _parse_call(body, opener)
        if call is None:
            return "text", opener + body + close
        self.calls.append(call)
        return "call", call

    def finish(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if self.opener is not None:
            out.append(self._call(self.buf, ""))
        elif self.buf:
            out.append(("text", self.buf))
        self.buf = ""
        return out


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
                tag = _held_back(self.buf, (THINK_CLOSE,))
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


def split_reasoning(text: str, inside: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, answer) of a whole model output; see :class:`ThinkStream`."""
    p = ThinkStream(inside)
    items = p.feed(text) + p.finish()
    reasoning = "".join(v for k, v in items if k == "reasoning")
    answer = "".join(v for k, v in items if k == "text")
    return (reasoning if p.saw_reasoning else None), answer


class OutputParser:
    """Model output → ``("reasoning" | "text" | "call", value)`` items, whole or streamed:
    :class:`ThinkStream` first, then (with ``tools``) :class:`ToolCallStream` on the answer."""

    def __init__(self, tools: bool, inside_think: bool = False):
        self.think = ThinkStream(inside_think)
        self.calls = ToolCallStream() if tools else None

    def _answer(self, items) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for kind, val in items:
            out += self.calls.feed(val) if (kind == "text" and self.calls) else [(kind, val)]
        return out

    @property
    def thinking(self) -> bool:
        return self.think.state.startswith("reasoning")

    def feed(self, text: str) -> list[tuple[str, Any]]:
        return self._answer(self.think.feed(text))

    def finish(self) -> list[tuple[str, Any]]:
        return self._answer(self.think.finish()) + (self.calls.finish() if self.calls else [])


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
