"""Rule files as plain data, checked before any value is built from them.

A rule file is text someone edited or downloaded, so the loader trusts nothing in it:

* UTF-8 text, at most ``MAX_BYTES``; a bad byte is named by line and column;
* plain YAML only: no tags beyond the standard scalars, sequences and mappings (no
  ``!!python/...``), string keys (integers too inside a kwarg's value, as ``transfer_map``'s), no alias that refers to a node containing itself, at
  most ``MAX_DEPTH`` levels of nesting and ``MAX_NODES`` nodes once aliases are expanded
  (the depth is checked on the parser's events, before the recursive composer runs);
* a scalar with an explicit tag must be a valid value of it (``!!bool maybe`` is an error);
* ``match.name`` regular expressions are compiled by the ``regex`` engine and every search
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


def _check_events(text: str, source: str) -> None:
    depth = 0
    nodes = 0
    open_anchors: list[tuple[str | None, int]] = []  # per open collection: (anchor, nodes before it)
    sizes: dict[str, int] = {}
    for ev in yaml.parse(text, Loader=yaml.SafeLoader):
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
                    for k, v in n.value:
                        if not (isinstance(k, yaml.ScalarNode) and k.tag in key_tags):
                            kinds = "strings or integers" if len(key_tags) > 1 else "strings"
                            raise RuleError(f"{source}:{k.start_mark.line + 1}: rule #{index} ({path or 'rule'}): "
                                            f"keys must be {kinds}, not {_describe(k)}")
                        stack.append((v, f"{path}.{k.value}" if path else k.value))
                elif isinstance(n, yaml.SequenceNode):
                    stack.extend((v, f"{path}[{i}]") for i, v in enumerate(n.value))
                elif n.tag in SCALAR_TAGS and n.tag != _STD + "str":
                    try:
                        constructor.construct_object(n)
                    except (yaml.YAMLError, ValueError, KeyError, TypeError, OverflowError):
                        raise RuleError(f"{source}:{n.start_mark.line + 1}: rule #{index} ({path or 'rule'}): "
                                        f"{_short(n.value)!r} is not a valid {_tag_text(n.tag)}") from None
    finally:
        constructor.dispose()


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
        try:
            self._re = regex.compile(text)
        except (regex.error, OverflowError, RecursionError, ValueError) as e:
            raise RuleError(f"{where}: regular expression '{text}' does not compile: {e}") from None

    def search(self, name: str):
        try:
            return self._re.search(name, timeout=MATCH_TIMEOUT_S)
        except TimeoutError:
            raise RuleError(f"{self.where}: regular expression '{self.pattern}' took more than "
                            f"{MATCH_TIMEOUT_S} s on module '{name}' (catastrophic backtracking: simplify it, "
                            "e.g. no nested repeats like '([\\w.]+)+')") from None

    def __repr__(self) -> str:
        return f"BoundedPattern({self.pattern!r})"


def _short(text: str, n: int = 40) -> str:
    return text if len(text) <= n else text[:n] + "..."
