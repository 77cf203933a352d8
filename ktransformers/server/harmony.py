"""gpt-oss output in OpenAI's harmony format: channels to reasoning, answer and tool calls.

The generation prompt ends with ``<|start|>assistant``; the model then writes messages
``<|channel|>NAME[ to=RECIPIENT][ <|constrain|>json]<|message|>CONTENT`` each ended by
``<|end|>`` (more follow, each after ``<|start|>assistant``), ``<|call|>`` (a tool call) or
``<|return|>`` (the last).  The ``analysis`` channel is reasoning, ``final`` the answer,
``commentary`` addressed ``to=functions.NAME`` a call whose content is its JSON arguments
(unaddressed commentary is answer text).  Output that does not start like a harmony message is
plain text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .tool_calls import held_back, make_call

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")


def is_harmony_template(template: str | None) -> bool:
    """The chat template writes harmony messages (gpt-oss)."""
    return bool(template) and CHANNEL in template and "<|start|>" in template


class HarmonyStream:
    """``feed(text)`` → ``("reasoning" | "text" | "call", value)`` items, as the other output
    parsers; ``tools=False`` gives calls back as text."""

    def __init__(self, tools: bool = True):
        self.tools = tools
        self.buf = ""
        self.state = "header"  # header | content | plain
        self.kind = "text"     # the current message's kind: reasoning | text | call
        self.name = ""         # the function of a call
        self.calls: list[dict] = []

    @property
    def thinking(self) -> bool:
        return self.state == "content" and self.kind == "reasoning"

    def _header(self, head: str) -> None:
        m = _CHANNEL.search(head)
        channel = m.group(1) if m else "final"
        r = _RECIPIENT.search(head)
        recipient = r.group(1) if r else ""
        if recipient.startswith("functions."):
            self.kind, self.name = "call", recipient[len("functions."):]
        elif channel == "analysis":
            self.kind = "reasoning"
        else:
            self.kind = "text"

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.buf += text
        out: list[tuple[str, Any]] = []
        while True:
            if self.state == "plain":
                if self.buf:
                    out.append(("text", self.buf))
                self.buf = ""
                return out
            if self.state == "header":
                s = self.buf.lstrip()
                if not s:
                    return out
                if not (s.startswith((START, CHANNEL)) or START.startswith(s) or CHANNEL.startswith(s)):
                    self.state = "plain"
                    continue
                j = s.find(MESSAGE)
                if j < 0:
                    return out
                self._header(s[:j])
                self.buf, self.state = s[j + len(MESSAGE):], "content"
                continue
            hits = [(i, m) for m in ENDS if (i := self.buf.find(m)) >= 0]
            if hits:
                i, m = min(hits)
                out += self._content(self.buf[:i], final=True)
                self.buf, self.state = self.buf[i + len(m):], "header"
                continue
            if self.kind == "call":
                return out  # a call's arguments are given out whole
            keep = held_back(self.buf, ENDS)
            out += self._content(self.buf[:len(self.buf) - keep], final=False)
            self.buf = self.buf[len(self.buf) - keep:]
            return out

    def _content(self, text: str, final: bool) -> list[tuple[str, Any]]:
        if self.kind != "call":
            return [(self.kind, text)] if text else []
        if not final:
            return []
        try:
            args = json.loads(text.strip() or "{}")
        except json.JSONDecodeError:
            args = None
        call = make_call(self.name, args) if self.tools and isinstance(args, dict) else None
        if call is None:
            return [("text", text)] if text else []
        self.calls.append(call)
        return [("call", call)]

    def finish(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if self.state == "content":
            out = self._content(self.buf, final=True)
        elif self.state == "plain" and self.buf:
            out = [("text", self.buf)]
        self.buf, self.state = "", "header"
        return out
