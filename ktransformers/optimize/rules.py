"""Rule files: parse (safe YAML, with line numbers) and validate, before any model is touched.

A rule file is a YAML list; each rule::

    - match:                       # at least one of name / class; both must hold if both given
        name: "^model\\.layers\\..*\\.mlp\\.experts$"   # re.search on the dotted module name
        class: torch.nn.Linear     # dotted path or bare class name, isinstance / class-name match
      replace:
        class: KTransformersExperts   # short name, dotted path, or ``default`` (keep the module)
        device: cpu                   # both phases (kwargs generate_device / prefill_device override)
        kwargs: {generate_op: KExpertsCPU, backend: llamafile}
      recursive: false             # default true; false: children are not matched by any rule

The first rule in file order that matches a module wins.  Every error names the file, line,
rule index and key.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from ..errors import RuleError
from . import safe_yaml
from .registry import resolve_match_class, resolve_operator

RULE_KEYS = ("match", "replace", "recursive")
MATCH_KEYS = ("name", "class")
REPLACE_KEYS = ("class", "device", "kwargs")
DEVICE_KWARGS = ("generate_device", "prefill_device", "out_device", "device")


@dataclass
class Rule:
    """One validated rule."""

    index: int  # 0-based position in the file
    source: str  # file path or "<string>"
    line: int
    name_pattern: safe_yaml.BoundedPattern | None
    match_class: type | str | None
    match_class_text: str | None
    replace_text: str  # as written ("default" when absent)
    replace_class: type | None  # None: keep the module ("default")
    device: str | None
    kwargs: dict[str, Any]
    recursive: bool
    key_lines: dict[str, int] = field(default_factory=dict)

    def where(self, key: str | None = None) -> str:
        line = self.key_lines.get(key, self.line) if key else self.line
        s = f"{self.source}:{line}: rule #{self.index}"
        return f"{s} ({key})" if key else s

    def matches(self, name: str, module) -> bool:
        if self.name_pattern is not None and not self.name_pattern.search(name):
            return False
        if self.match_class is not None:
            if isinstance(self.match_class, str):
                if not any(c.__name__ == self.match_class for c in type(module).__mro__):
                    return False
            elif not isinstance(module, self.match_class):
                return False
        return True

    def describe_match(self) -> str:
        parts = []
        if self.name_pattern is not None:
            parts.append(f"name={self.name_pattern.pattern}")
        if self.match_class_text:
            parts.append(f"class={self.match_class_text}")
        return " ".join(parts)


def load_rules(rules) -> list[Rule]:
    """Rules from a path, a YAML string, a list of dicts, or already-parsed rules."""
    if isinstance(rules, (list, tuple)) and all(isinstance(r, Rule) for r in rules):
        return list(rules)
    if isinstance(rules, (list, tuple)):
        return parse_rules(yaml.safe_dump(list(rules), sort_keys=False), "<rules>")
    if isinstance(rules, (str, os.PathLike)) and (
        isinstance(rules, os.PathLike) or ("\n" not in rules and rules.strip().endswith((".yaml", ".yml")))
    ):
        path = Path(rules)
        if not path.is_file():
            raise RuleError(f"{path}: rule file not found")
        return parse_rules(safe_yaml.read_text(path), str(path))
    if isinstance(rules, str):
        return parse_rules(rules, "<string>")
    raise RuleError(f"rules must be a path, a YAML string or a list of rule dicts, not {type(rules).__name__}")


def parse_rules(text: str, source: str = "<string>") -> list[Rule]:
    root = safe_yaml.compose(text, source)
    if root is None:
        raise RuleError(f"{source}: the rule file is empty")
    if not isinstance(root, yaml.SequenceNode):
        raise RuleError(f"{source}:{_line(root)}: a rule file is a YAML list of rules (- match: ... replace: ...)")
    return [_parse_rule(node, i, source) for i, node in enumerate(root.value)]


def _line(node) -> int:
    return node.start_mark.line + 1


_construct = safe_yaml.construct


def _mapping(node, where: str) -> dict[str, tuple[Any, Any]]:
    """key -> (key_node, value_node) of a mapping node, with duplicate keys refused."""
    if not isinstance(node, yaml.MappingNode):
        raise RuleError(f"{where} must be a mapping (key: value)")
    out: dict[str, tuple[Any, Any]] = {}
    for k, v in node.value:
        key = _construct(k)
        if key in out:
            raise RuleError(f"{where.split(':')[0]}:{_line(k)}: {where.split(': ', 1)[-1]}: key '{key}' given twice")
        out[str(key)] = (k, v)
    return out


def _unknown_key(source: str, node, key: str, allowed: tuple[str, ...], rule_index: int, parent: str) -> RuleError:
    near = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    hint = f"; did you mean '{near[0]}'?" if near else f" (allowed: {', '.join(allowed)})"
    where = f"{parent}.{key}" if parent else key
    return RuleError(f"{source}:{_line(node)}: rule #{rule_index} ({where}): unknown key{hint}")


def _parse_rule(node, index: int, source: str) -> Rule:
    head = f"{source}:{_line(node)}: rule #{index}"
    if not isinstance(node, yaml.MappingNode):
        raise RuleError(f"{head}: a rule is a mapping with 'match' and 'replace'")
    items = _mapping(node, head)
    key_lines = {k: _line(kn) for k, (kn, _) in items.items()}
    for key, (kn, _) in items.items():
        if key not in RULE_KEYS:
            raise _unknown_key(source, kn, key, RULE_KEYS, index, "")
    for req in ("match", "replace"):
        if req not in items:
            raise RuleError(f"{head}: missing '{req}'")

    def err(key: str, msg: str, line: int | None = None) -> RuleError:
        return RuleError(f"{source}:{line or key_lines.get(key.split('.')[0], _line(node))}: rule #{index} ({key}): {msg}")

    # match
    _, mnode = items["match"]
    match = _mapping(mnode, f"{source}:{_line(mnode)}: rule #{index} (match)")
    for key, (kn, _) in match.items():
        if key not in MATCH_KEYS:
            raise _unknown_key(source, kn, key, MATCH_KEYS, index, "match")
    if not match:
        raise err("match", "needs at least one of 'name' or 'class'", _line(mnode))
    pattern = None
    if "name" in match:
        kn, vn = match["name"]
        text = _construct(vn)
        if not isinstance(text, str):
            raise err("match.name", f"must be a string (a regular expression), not {type(text).__name__}", _line(vn))
        pattern = safe_yaml.BoundedPattern(text, f"{source}:{_line(vn)}: rule #{index} (match.name)")
        key_lines["match.name"] = _line(vn)
    mclass, mclass_text = None, None
    if "class" in match:
        kn, vn = match["class"]
        mclass_text = _construct(vn)
        if not isinstance(mclass_text, str):
            raise err("match.class", "must be a class path string", _line(vn))
        try:
            mclass = resolve_match_class(mclass_text)
        except RuleError as e:
            raise err("match.class", str(e), _line(vn)) from None
        key_lines["match.class"] = _line(vn)

    # replace
    _, rnode = items["replace"]
    replace = _mapping(rnode, f"{source}:{_line(rnode)}: rule #{index} (replace)")
    for key, (kn, _) in replace.items():
        if key not in REPLACE_KEYS:
            raise _unknown_key(source, kn, key, REPLACE_KEYS, index, "replace")
    rtext = "default"
    rclass = None
    if "class" in replace:
        _, vn = replace["class"]
        rtext = _construct(vn)
        if not isinstance(rtext, str):
            raise err("replace.class", "must be a class path string or 'default'", _line(vn))
        try:
            rclass = resolve_operator(rtext)
        except RuleError as e:
            raise err("replace.class", str(e), _line(vn)) from None
    device = None
    if "device" in replace:
        _, vn = replace["device"]
        device = _construct(vn)
        _check_device(device, lambda m: err("replace.device", m, _line(vn)))
    kwargs: dict[str, Any] = {}
    if "kwargs" in replace:
        _, vn = replace["kwargs"]
        kwargs = _construct(vn) or {}
        if not isinstance(kwargs, dict):
            raise err("replace.kwargs", "must be a mapping", _line(vn))
        klines = {str(_construct(k)): _line(k) for k, _ in vn.value} if isinstance(vn, yaml.MappingNode) else {}
        _check_kwargs(rclass, rtext, kwargs, klines, source, index, device)
    recursive = True
    if "recursive" in items:
        _, vn = items["recursive"]
        recursive = _construct(vn)
        if not isinstance(recursive, bool):
            raise err("recursive", f"must be true or false, not {recursive!r}", _line(vn))
    return Rule(
        index=index, source=source, line=_line(node), name_pattern=pattern, match_class=mclass,
        match_class_text=mclass_text, replace_text=rtext, replace_class=rclass, device=device,
        kwargs=kwargs, recursive=recursive, key_lines=key_lines,
    )


def _check_device(value, fail) -> None:
    if not isinstance(value, str):
        raise fail(f"a device is a string such as 'cpu' or 'cuda:0', not {value!r}")
    try:
        torch.device(value)
    except (RuntimeError, ValueError):
        raise fail(f"'{value}' is not a device (use 'cpu', 'cuda', 'cuda:1', ...)") from None


def _check_kwargs(cls, rtext: str, kwargs: dict, klines: dict[str, int], source: str, index: int,
                  device: str | None = None) -> None:
    def fail(key: str, msg: str) -> RuleError:
        return RuleError(f"{source}:{klines.get(key, 0)}: rule #{index} (replace.kwargs.{key}): {msg}")

    if cls is None:
        allowed = {"generate_device": (str,), "prefill_device": (str,), "device": (str,)}
        for key, value in kwargs.items():
            if key not in allowed:
                raise fail(key, f"'default' keeps the module as it is and takes only devices "
                                f"({', '.join(allowed)})")
            _check_device(value, lambda m: fail(key, m))
        g, p = kwargs.get("generate_device"), kwargs.get("prefill_device")
        if g and p and torch.device(g) != torch.device(p):
            raise fail("prefill_device", f"'default' keeps the module on one device; prefill_device {p} "
                                         f"differs from generate_device {g} (use an operator to switch per phase)")
        return
    spec = cls.accepted_kwargs() if hasattr(cls, "accepted_kwargs") else None
    if spec is None:
        return
    for key, value in kwargs.items():
        if key not in spec:
            near = difflib.get_close_matches(key, list(spec), n=1, cutoff=0.6)
            hint = f"did you mean '{near[0]}'?" if near else f"accepted: {', '.join(sorted(spec))}"
            raise fail(key, f"{rtext} does not accept this kwarg; {hint}")
        types = spec[key].types
        if (value is None and type(None) not in types) or (value is not None and not isinstance(value, types)):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise fail(key, f"must be {names}, not {value!r}")
        if key in DEVICE_KWARGS and value is not None:
            _check_device(value, lambda m: fail(key, m))
    ops = getattr(cls, "OPS", None)
    if ops is not None:
        for key in ("generate_op", "prefill_op"):
            name = kwargs.get(key)
            if name is not None and name not in ops:
                from .registry import suggest_op

                raise fail(key, suggest_op(cls.__name__, name, sorted(ops)))
        chosen = {}
        for key in ("generate_op", "prefill_op"):
            if key == "prefill_op" and "prefill_op" in kwargs and kwargs["prefill_op"] is None:
                continue  # disabled: the generate op serves both phases
            name = kwargs.get(key) or (cls.DEFAULT_OP if key == "generate_op" else kwargs.get("generate_op")
                                       or cls.DEFAULT_OP)
            op = ops.get(name) if name else None
            if op is None:
                continue
            chosen[key] = op
            # the op must be able to run where this rule puts its phase
            phase_dev = kwargs.get(key.replace("_op", "_device")) or kwargs.get("device") or device
            if phase_dev is not None and hasattr(op, "check_device"):
                why = op.check_device(torch.device(phase_dev))
                if why:
                    raise fail(key, why)
            # an op may check its own kwargs' values: validate_kwargs(kwargs) -> (key, message) | None
            validate = getattr(op, "validate_kwargs", None)
            problem = validate(kwargs) if validate is not None else None
            if problem:
                raise fail(problem[0], problem[1])
        # a kwarg only some op understands must belong to an op this rule actually uses
        own = set(getattr(cls, "COMMON_KWARGS", {})) | set(getattr(cls, "KWARGS", {}))
        for key in kwargs:
            if key in own:
                continue
            if not any(key in op.extra_kwargs for op in chosen.values()):
                users = sorted(n for n, o in ops.items() if key in o.extra_kwargs)
                used = ", ".join(sorted({o.name for o in chosen.values()})) or "none"
                raise fail(key, f"only {', '.join(users)} take(s) '{key}', but this rule's ops are {used}")
