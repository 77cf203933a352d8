"""Rule files as plain data, checked before any value is built from them.

A rule file is text someone edited or downloaded, so the loader trusts nothing in it:

* UTF-8 text, at most ``MAX_BYTES``; a bad byte is named by line and column;
* plain YAML only: no tags beyond the standard scalars, sequences and mappings (no
  ``!!python/...``), string keys (integers too inside a kwarg's value, as ``transfer_map``'s), no alias that refers to a node containing itself, at
  most ``MAX_DEPTH`` levels of nesting and ``MAX_NODES`` nodes once aliases are expanded
  (the depth is checked on the parser's events, before the recursive composer runs);
* a scalar with an explicit tag must be a valid value of it (``!!bool maybe`` is an error);
* no key twice in one mapping (YAML would keep the last one silently);
* no YAML 1.1 base-60 number (``1:30`` reads as 90): quoted, it is the string it looks like;
* a character escape beyond U+10FFFF (``"\\UFFFFFFFF"``) is an error with its line, not the
  scanner's exception;
* ``match.name`` regular expressions are bounded before they are compiled (at most
  ``MAX_PATTERN_CHARS`` characters, repetition counts of at most ``MAX_REPEAT``, nested
  repetitions expanding to at most ``MAX_EXPANSION`` items: the engine's compile time grows with
  the expansion, ``a{2147483648}`` never ends), compiled by the ``regex`` engine, and every search
  runs under a time limit, so a pattern with catastrophic backtracking ends in an error that
  names the rule instead of hanging.

Every error is a one-line :class:`RuleError` in the project's ``file:line: rule #i (key): ...``
style.
"""

from __future__ import annotations

from pathlib import Path

import regex
import yaml

from ..errors import RuleError

MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_NODES = 100_000
#: seconds one ``match.name`` search may take (module names are short; real patterns need microseconds)
MATCH_TIMEOUT_S = 0.25
#: bounds of a ``match.name`` pattern, checked before the engine compiles it (module names are
#: a few dozen characters: real patterns stay far below these)
MAX_PATTERN_CHARS = 1000
MAX_REPEAT = 1000
MAX_EXPANSION = 10_000

_STD = "tag:yaml.org,2002:"
SCALAR_TAGS = {_STD + t for t in ("str", "int", "float", "bool", "null")}
COLLECTION_TAGS = {_STD + "seq", _STD + "map"}


def _tag_text(tag: str) -> str:
    return "!!" + tag[len(_STD):] if tag.startswith(_STD) else tag


def read_text(path: str | Path) -> str:
    """The file's text; RuleError naming the file (and line/column of a byte that is not UTF-8)."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            data = fh.read(MAX_BYTES + 1)
    except OSError as e:
        raise RuleError(f"{p}: cannot read the rule file ({e.strerror})") from None
    if len(data) > MAX_BYTES:
        raise RuleError(f"{p}: the rule file is larger than {MAX_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise RuleError(f"{p}:{line}: not UTF-8 text: byte 0x{data[e.start]:02x} at column {col} "
                        "(save the file as UTF-8)") from None


def compose(text: str, source: str):
    """The YAML node tree of a rule file (None when empty), after the checks above."""
    if len(text) > MAX_BYTES:
        raise RuleError(f"{source}: the rule file is larger than {MAX_BYTES} characters")
    try:
        _check_events(text, source)
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        line = mark.line + 1 if mark else 0
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RuleError(f"{source}:{line}: not valid YAML: {problem}") from None
    if root is not None:
        _check_tree(root, source)
    return root


def _events(text: str, source: str):
    """The parser's events; a number or escape the scanner cannot convert is a RuleError at its line.

    The scanner turns ``"\\UFFFFFFFF"`` into ``chr(0xFFFFFFFF)`` (OverflowError) and a directive's
    5000-digit version into ``int`` (ValueError) without a YAML error of its own."""
    loader = yaml.SafeLoader(text)
    try:
        while True:
            try:
                if not loader.check_event():
                    return
                ev = loader.get_event()
            except (OverflowError, ValueError) as e:
                raise RuleError(f"{source}:{loader.line + 1}: not valid YAML: a character escape or number "
                                f"out of range near column {loader.column + 1} ({e})") from None
            yield ev
    finally:
        loader.dispose()


def _check_events(text: str, source: str) -> None:
    depth = 0
    nodes = 0
    open_anchors: list[tuple[str | None, int]] = []  # per open collection: (anchor, nodes before it)
    sizes: dict[str, int] = {}
    for ev in _events(text, source):
        line = ev.start_mark.line + 1
        if isinstance(ev, yaml.AliasEvent):
            if any(a == ev.anchor for a, _ in open_anchors):
                raise RuleError(f"{source}:{line}: alias '*{ev.anchor}' refers to the node that contains it "
                                "(a recursive alias)")
            nodes += sizes.get(ev.anchor, 1)
        elif isinstance(ev, (yaml.ScalarEvent, yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            nodes += 1
            tag = ev.tag
            allowed = SCALAR_TAGS if isinstance(ev, yaml.ScalarEvent) else COLLECTION_TAGS
            if tag not in (None, "!") and tag not in allowed:
                raise RuleError(f"{source}:{line}: tag '{_tag_text(tag)}' is not allowed: a rule file is plain "
                                "YAML (strings, numbers, booleans, null, lists, mappings)")
            if isinstance(ev, yaml.ScalarEvent):
                if ev.anchor:
                    sizes[ev.anchor] = 1
            else:
                depth += 1
                if depth > MAX_DEPTH:
                    raise RuleError(f"{source}:{line}: nested more than {MAX_DEPTH} levels deep")
                open_anchors.append((ev.anchor, nodes - 1))
        elif isinstance(ev, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            depth -= 1
            anchor, before = open_anchors.pop()
            if anchor:
                sizes[anchor] = nodes - before
        if nodes > MAX_NODES:
            raise RuleError(f"{source}:{line}: more than {MAX_NODES} values once aliases are expanded")


def _describe(node) -> str:
    if isinstance(node, yaml.ScalarNode):
        kind = _tag_text(node.tag).lstrip("!")
        return f"{_short(node.value)!r} ({kind})"
    return "a list" if isinstance(node, yaml.SequenceNode) else "a mapping"


def _check_tree(root, source: str) -> None:
    """String keys everywhere; explicitly tagged scalars valid for their tag (rule by rule)."""
    if not isinstance(root, yaml.SequenceNode):
        return  # the caller says what a rule file is
    constructor = yaml.SafeLoader("")
    seen: set[int] = set()
    try:
        for index, node in enumerate(root.value):
            stack = [(node, "")]
            while stack:
                n, path = stack.pop()
                if id(n) in seen:  # an alias: checked where its anchor was
                    continue
                seen.add(id(n))
                if isinstance(n, yaml.MappingNode):
                    # integer keys only inside a kwarg's value (transfer_map's layer numbers)
                    key_tags = {_STD + "str", _STD + "int"} if path.startswith("replace.kwargs.") else {_STD + "str"}
                    keys: dict = {}
                    for k, v in n.value:
                        here = f"{source}:{k.start_mark.line + 1}: rule #{index} ({path or 'rule'})"
                        if not (isinstance(k, yaml.ScalarNode) and k.tag in key_tags):
                            kinds = "strings or integers" if len(key_tags) > 1 else "strings"
                            raise RuleError(f"{here}: keys must be {kinds}, not {_describe(k)}")
                        key = _scalar_value(constructor, k, here)
                        if key in keys:
                            raise RuleError(f"{here}: key {_short(str(key))!r} given twice (first on line {keys[key]}); "
                                            "YAML would keep the last one silently")
                        keys[key] = k.start_mark.line + 1
                        stack.append((v, f"{path}.{printable(k.value)}" if path else printable(k.value)))
                elif isinstance(n, yaml.SequenceNode):
                    stack.extend((v, f"{path}[{i}]") for i, v in enumerate(n.value))
                else:
                    _scalar_value(constructor, n, f"{source}:{n.start_mark.line + 1}: rule #{index} ({path or 'rule'})")
    finally:
        constructor.dispose()


def _scalar_value(constructor, node, where: str):
    """A scalar's value, checked: valid for its tag, and not a YAML 1.1 base-60 number."""
    if node.tag == _STD + "str":
        return node.value
    if node.tag in (_STD + "int", _STD + "float") and ":" in node.value:
        raise RuleError(f"{where}: {_short(node.value)!r} reads as a base-60 number in YAML 1.1 "
                        f"({_short(node.value)} = {_short(str(_sexagesimal(constructor, node)))}); quote it for the "
                        "text, or write the number in decimal")
    if node.tag not in SCALAR_TAGS:
        return node.value
    try:
        return constructor.construct_object(node)
    except (yaml.YAMLError, ValueError, KeyError, TypeError, OverflowError):
        raise RuleError(f"{where}: {_short(node.value)!r} is not a valid {_tag_text(node.tag)}") from None


def _sexagesimal(constructor, node):
    try:
        return constructor.construct_object(node)
    except (yaml.YAMLError, ValueError, OverflowError):
        return "?"


def construct(node):
    """The Python value of a checked node (plain dicts, lists and scalars)."""
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_object(node, deep=True)
    finally:
        loader.dispose()


class BoundedPattern:
    """A ``match.name`` regular expression whose searches end within ``MATCH_TIMEOUT_S``."""

    def __init__(self, text: str, where: str):
        self.pattern = text
        self.where = where
        _check_pattern_size(text, where)
        try:
            self._re = regex.compile(text)
        except (regex.error, OverflowError, RecursionError, ValueError) as e:
            raise RuleError(f"{where}: regular expression {_short(text)!r} does not compile: {e}") from None

    def search(self, name: str):
        try:
            return self._re.search(name, timeout=MATCH_TIMEOUT_S)
        except TimeoutError:
            raise RuleError(f"{self.where}: regular expression {_short(self.pattern)!r} took more than "
                            f"{MATCH_TIMEOUT_S} s on module {name!r} (catastrophic backtracking: simplify it, "
                            "e.g. no nested repeats like '([\\w.]+)+')") from None

    def __repr__(self) -> str:
        return f"BoundedPattern({self.pattern!r})"


_BRACE = regex.compile(r"\{([^{}]{0,40})\}")
_NUMBER = regex.compile(r"\d+")


def _check_pattern_size(text: str, where: str) -> None:
    """RuleError when ``text`` is longer than ``MAX_PATTERN_CHARS``, repeats anything more than
    ``MAX_REPEAT`` times, or its nested repetitions expand to more than ``MAX_EXPANSION`` items.

    A light scan, not a parser: escapes and character sets are skipped, groups nest, and a brace
    right after an atom counts as a repetition by the largest number in it (``{n}``, ``{n,m}``,
    the engine's fuzzy ``{e<=n}``).  It overestimates at worst, which only refuses nonsense."""
    if len(text) > MAX_PATTERN_CHARS:
        raise RuleError(f"{where}: regular expression {_short(text)!r} is {len(text)} characters long "
                        f"(at most {MAX_PATTERN_CHARS}; module names are short)")
    frames = [0]  # per open group: the expanded size of its content so far
    last = 0  # expanded size of the last atom (0: none to repeat)
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            last, i = 1, i + 2
        elif ch == "[":
            j = i + 1 + (text[i + 1:i + 2] == "^")
            j += text[j:j + 1] == "]"
            while j < len(text) and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            last, i = 1, j + 1
        elif ch == "(":
            frames.append(0)
            last, i = 0, i + 1
            continue
        elif ch in "?*+|":  # quantifiers and alternation add nothing to repeat
            i += 1
            continue
        elif ch == ")" and len(frames) > 1:
            last, i = max(frames.pop(), 1), i + 1
        elif ch == "{" and last and (m := _BRACE.match(text, i)) and (nums := _NUMBER.findall(m.group(1))):
            count = max(int(n) for n in nums)
            if count > MAX_REPEAT:
                raise RuleError(f"{where}: regular expression {_short(text)!r} repeats {count} times "
                                f"(at most {MAX_REPEAT}; module names are short)")
            frames[-1] -= last
            last *= max(count, 1)
            i = m.end()
        else:
            last, i = 1, i + 1
        frames[-1] += last
        if sum(frames) > MAX_EXPANSION:
            raise RuleError(f"{where}: regular expression {_short(text)!r} has nested repetitions that expand to "
                            f"more than {MAX_EXPANSION} items (module names are short)")


def _short(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[:n] + "..."


def printable(text: str) -> str:
    """``text`` as one line of an error: newlines and other control characters escaped."""
    return text if text.isprintable() else repr(text)[1:-1]
