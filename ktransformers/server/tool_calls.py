"""Tool calls in model output, for every call syntax of the families shipped here.

Each syntax is one row of :data:`FORMATS`: the marker that opens a call block, the marker that
closes it, and a parser from the block's body to OpenAI ``tool_calls`` (a block may hold several
calls: MiniMax-M2's ``<invoke>`` list).  Wrapper markers around a group of calls are dropped.

* Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>``;
  in the same block GLM-4.5/4.6's ``NAME<arg_key>k</arg_key><arg_value>v</arg_value>`` and
  Qwen3-Coder / Qwen3.5's ``<function=NAME><parameter=k>v</parameter></function>``;
* DeepSeek V3 / R1 / V3.1: ``<｜tool▁call▁begin｜>…<｜tool▁call▁end｜>`` (see :func:`_deepseek`);
* Kimi-K2: ``<|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{…}<|tool_call_end|>``;
* MiniMax-M2: ``<minimax:tool_call><invoke name="…"><parameter name="k">v</parameter></invoke>…``.

gpt-oss writes calls in its harmony channels; :mod:`.harmony` reads those.  A block that does not
parse is given back as text, never an error: a model's malformed call is its answer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Callable

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
KIMI_CALLS_BEGIN, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"
MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def make_call(name: Any, args: Any) -> dict | None:
    """An OpenAI tool call, or None when ``name`` is not a usable function name."""
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


def _unfence(body: str) -> str:
    body = body.strip()
    if body.startswith("```"):
        body = body.strip("`").strip()
        body = body[4:] if body.startswith("json") else body
    return body.strip()


def _json_object(text: str) -> dict | None:
    try:
        obj = json.loads(_unfence(text) or "{}")
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _value(text: str) -> Any:
    """A parameter value written as text: JSON when it is JSON (numbers, objects), else the string."""
    s = text.strip("\n")
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return s


_FUNCTION_NAME = re.compile(r"[A-Za-z_][\w.\-]*")
_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_XML_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_XML_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _tool_call_block(body: str) -> list[dict] | None:
    """``<tool_call>`` bodies: Hermes JSON, Qwen3-Coder XML functions, or GLM's key/value pairs."""
    obj = _json_object(body)
    if obj is not None:
        call = make_call(obj.get("name"), obj.get("arguments", obj.get("parameters", {})))
        return [call] if call else None
    fns = _XML_FUNCTION.findall(body)
    if fns:
        calls = [make_call(name, {k.strip(): _value(v) for k, v in _XML_PARAM.findall(inner)}) for name, inner in fns]
        return calls if all(calls) else None
    name, _, rest = body.strip().partition("<arg_key>")
    if _FUNCTION_NAME.fullmatch(name.strip()) and (not rest or _GLM_PAIR.search("<arg_key>" + rest)):
        args = {k.strip(): _value(v) for k, v in _GLM_PAIR.findall("<arg_key>" + rest)} if rest else {}
        call = make_call(name, args)
        return [call] if call else None
    return None


def _deepseek(body: str) -> list[dict] | None:
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
    args = _json_object(rest)
    call = make_call(name, args) if args is not None else None
    return [call] if call else None


def _kimi(body: str) -> list[dict] | None:
    """``functions.NAME:INDEX<|tool_call_argument_begin|>{json}``."""
    head, sep, rest = body.partition(KIMI_ARGS)
    if not sep:
        return None
    name = head.strip()
    name = name[len("functions."):] if name.startswith("functions.") else name
    name = re.sub(r":\d+$", "", name)
    args = _json_object(rest)
    call = make_call(name, args) if args is not None else None
    return [call] if call else None


_INVOKE = re.compile(r'<invoke\s+name="([^"]+)"\s*>(.*?)</invoke>', re.S)
_MINIMAX_PARAM = re.compile(r'<parameter\s+name="([^"]+)"\s*>(.*?)</parameter>', re.S)


def _minimax(body: str) -> list[dict] | None:
    invokes = _INVOKE.findall(body)
    if not invokes:
        return None
    calls = [make_call(name, {k: _value(v) for k, v in _MINIMAX_PARAM.findall(inner)}) for name, inner in invokes]
    return calls if all(calls) else None


@dataclass(frozen=True)
class CallFormat:
    open: str
    close: str
    parse: Callable[[str], list[dict] | None]
    wrappers: tuple[str, ...] = ()


FORMATS = (
    CallFormat(TOOL_OPEN, TOOL_CLOSE, _tool_call_block),
    CallFormat(DS_CALL_BEGIN, DS_CALL_END, _deepseek, (DS_CALLS_BEGIN, DS_CALLS_END)),
    CallFormat(KIMI_CALL_BEGIN, KIMI_CALL_END, _kimi, (KIMI_CALLS_BEGIN, KIMI_CALLS_END)),
    CallFormat(MINIMAX_OPEN, MINIMAX_CLOSE, _minimax),
)
_BY_OPEN = {f.open: f for f in FORMATS}
_WRAPPERS = tuple(w for f in FORMATS for w in f.wrappers)
_MARKERS = (*_BY_OPEN, *_WRAPPERS)
#: every marker string of every syntax (what the streamed text must not lose as a special token)
ALL_MARKERS = (*_MARKERS, *(f.close for f in FORMATS), DS_SEP, KIMI_ARGS)


def held_back(buf: str, markers) -> int:
    """Length of the longest tail of ``buf`` that could still grow into one of ``markers``."""
    for k in range(min(max(map(len, markers)) - 1, len(buf)), 0, -1):
        tail = buf[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


class ToolCallStream:
    """Tool calls out of streamed text.

    ``feed(text)`` returns ``("text", str)`` and ``("call", tool_call)`` items; text that might be
    the start of a marker is held back until it is decided, and a call is given out when its
    block is closed (or the stream ends).
    """

    def __init__(self):
        self.buf = ""
        self.fmt: CallFormat | None = None  # the format of the block being read
        self.calls: list[dict] = []

    @property
    def in_call(self) -> bool:
        return self.fmt is not None

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if self.fmt is None:
                hits = [(i, m) for m in _MARKERS if (i := self.buf.find(m)) >= 0]
                if hits:
                    i, m = min(hits)
                    if i:
                        out.append(("text", self.buf[:i]))
                    self.buf = self.buf[i + len(m):]
                    self.fmt = _BY_OPEN.get(m)  # None for a wrapper: dropped
                    continue
                keep = held_back(self.buf, _MARKERS)
                emit = self.buf[:len(self.buf) - keep]
                if emit:
                    out.append(("text", emit))
                self.buf = self.buf[len(self.buf) - keep:]
                return out
            j = self.buf.find(self.fmt.close)
            if j < 0:
                return out
            body, self.buf = self.buf[:j], self.buf[j + len(self.fmt.close):]
            out += self._block(body, self.fmt.close)

    def _block(self, body: str, close: str) -> list[tuple[str, Any]]:
        fmt, self.fmt = self.fmt, None
        calls = fmt.parse(body)
        if not calls:
            return [("text", fmt.open + body + close)]
        self.calls += calls
        return [("call", c) for c in calls]

    def finish(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if self.fmt is not None:
            out += self._block(self.buf, "")
        elif self.buf:
            out.append(("text", self.buf))
        self.buf = ""
        return out


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content outside the call blocks, OpenAI ``tool_calls``) of a whole model output."""
    p = ToolCallStream()
    items = p.feed(text) + p.finish()
    content = "".join(v for k, v in items if k == "text")
    return (content.strip() if p.calls else text), p.calls
