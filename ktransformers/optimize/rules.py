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

from torch import nn

from ..errors import RuleError
from ..operators import compat
from ..operators.phases import PhaseError, decide_phases
from ..operators.registry import (check_class_path, registered_class, resolve_op, resolve_operator, rule_class,
                                  rule_module)
from . import safe_yaml

RULE_KEYS = ("match", "replace", "recursive")
MATCH_KEYS = ("name", "class")
REPLACE_KEYS = ("class", "device", "kwargs")
DEVICE_KWARGS = ("generate_device", "prefill_device", "out_device", "device")
#: device types a rule may name: the CPU kernels and CUDA (ROCm too) are what the operators run on;
#: ``meta`` would load nothing, ``mps`` / ``xla`` / ``hpu`` / ... have no operators here
RULE_DEVICE_TYPES = ("cpu", "cuda")
#: an integer kwarg is a count or a size (``prefill_threshold``, ``chunk_size``, ``block_size``)
MAX_INT_KWARG = 2**31 - 1


@dataclass
class Rule:
    """One validated rule."""

    index: int  # 0-based position in the file
    source: str  # file path or "<string>"
    line: int
    name_pattern: safe_yaml.BoundedPattern | None
    match_class: tuple[type, ...] | str | None  # classes (isinstance) or a bare class name
    match_class_text: str | None
    replace_text: str  # as written ("default" when absent)
    replace_class: type | None  # None: keep the module ("default")
    device: str | None
    kwargs: dict[str, Any]
    recursive: bool
    key_lines: dict[str, int] = field(default_factory=dict)
    #: reference-system names this rule used: (their name, ours, what it does)
    aliases: list[tuple[str, str, str]] = field(default_factory=list)

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
            elif not isinstance(module, self.match_class):  # a tuple of classes
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
    """Rules from a path, a YAML string, a list of dicts, or already-parsed rules: the one place the
    input forms are told apart (already-parsed rules are returned as they are, not parsed again)."""
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
    if not root.value:
        raise RuleError(f"{source}:{_line(root)}: the rule file has no rules (an empty list places nothing)")
    return [_parse_rule(node, i, source) for i, node in enumerate(root.value)]


def _line(node) -> int:
    return node.start_mark.line + 1


_construct = safe_yaml.construct


def _mapping(node, where: str) -> dict[str, tuple[Any, Any]]:
    """key -> (key_node, value_node) of a mapping node (duplicate keys were refused by safe_yaml)."""
    if not isinstance(node, yaml.MappingNode):
        raise RuleError(f"{where} must be a mapping (key: value)")
    return {str(_construct(k)): (k, v) for k, v in node.value}


def _unknown_key(source: str, node, key: str, allowed: tuple[str, ...], rule_index: int, parent: str) -> RuleError:
    near = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
    hint = f"; did you mean '{near[0]}'?" if near else f" (allowed: {', '.join(allowed)})"
    key = safe_yaml.printable(key)
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
        mclass_text, mclass, key_lines["match.class"] = _value(
            match["class"], "match.class", str, lambda v: "must be a class path string", resolve_match_class, err)

    # replace
    _, rnode = items["replace"]
    replace = _mapping(rnode, f"{source}:{_line(rnode)}: rule #{index} (replace)")
    for key, (kn, _) in replace.items():
        if key not in REPLACE_KEYS:
            raise _unknown_key(source, kn, key, REPLACE_KEYS, index, "replace")
    rtext = "default"
    rclass = None
    aliases: list[tuple[str, str, str]] = []
    if "class" in replace:
        rtext, resolved, key_lines["replace.class"] = _value(
            replace["class"], "replace.class", str, lambda v: "must be a class path string or 'default'",
            resolve_operator, err)
        rclass = resolved.cls
        if resolved.alias:
            aliases.append(resolved.alias)
    device = None
    if "device" in replace:
        _, vn = replace["device"]
        device = _construct(vn)
        _check_device(device, lambda m: err("replace.device", m, _line(vn)))
    kwargs: dict[str, Any] = {}
    if "kwargs" in replace:
        _, vn = replace["kwargs"]
        kwargs = _construct(vn)
        if kwargs is None:  # ``kwargs:`` with nothing after it
            kwargs = {}
        if not isinstance(kwargs, dict):
            raise err("replace.kwargs", f"must be a mapping (key: value), not {_shown(kwargs)}; leave 'kwargs' out "
                                        "for none", _line(vn))
        klines = {str(_construct(k)): _line(k) for k, _ in vn.value} if isinstance(vn, yaml.MappingNode) else {}
        kwargs, renamed = compat.normalize_kwargs(kwargs)
        for theirs, ours, what in renamed:
            klines.setdefault(ours, klines.get(theirs.partition(":")[0], 0))
            aliases.append((theirs, ours, what))
        _check_kwargs(rclass, rtext, kwargs, klines, source, index, device)
        aliases += _op_aliases(rclass, kwargs)
        key_lines.update({f"replace.kwargs.{k}": v for k, v in klines.items()})
    recursive = True
    if "recursive" in items:
        recursive = _value(items["recursive"], "recursive", bool, lambda v: f"must be true or false, not {v!r}",
                           lambda v: v, err)[0]
    return Rule(
        index=index, source=source, line=_line(node), name_pattern=pattern, match_class=mclass,
        match_class_text=mclass_text, replace_text=rtext, replace_class=rclass, device=device,
        kwargs=kwargs, recursive=recursive, key_lines=key_lines, aliases=aliases,
    )


def _value(pair, key: str, kind: type, wrong_kind, resolve, err):
    """(value, resolve(value), line) of a rule value; errors name the key and the value's line."""
    _, vn = pair
    value = _construct(vn)
    if not isinstance(value, kind):
        raise err(key, wrong_kind(value), _line(vn))
    try:
        return value, resolve(value), _line(vn)
    except RuleError as e:
        raise err(key, str(e), _line(vn)) from None


def resolve_match_class(text: str) -> tuple[type, ...] | str:
    """Classes for ``match.class``; a bare name is returned as a string and matched by class name."""
    check_class_path(text)
    if "." not in text:
        return text
    classes = compat.resolve_class_path(text)
    if classes is None:
        cls = registered_class(text) if text.startswith("ktransformers.") else rule_class(text)
        classes = (cls,) if cls is not None else ()
    if not classes:
        raise RuleError(f"class '{text}' cannot be imported{_did_you_mean_module(text)}")
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise RuleError(f"'{text}' is not a torch.nn.Module class")
    return classes


def _did_you_mean_module(text: str) -> str:
    mod_name, _, leaf = text.rpartition(".")
    mod_name = compat.MODULE_PATHS.get(mod_name, mod_name)
    if mod_name.startswith("ktransformers."):
        return " (not a registered operator; see docs/rules.md, Class paths)"
    mod = rule_module(mod_name)
    if mod is None:
        return f" ('{mod_name}' is not an importable module)"
    names = [n for n in dir(mod) if isinstance(getattr(mod, n, None), type)]
    near = difflib.get_close_matches(leaf, names, n=1, cutoff=0.5)
    return f"; did you mean '{text.rpartition('.')[0]}.{near[0]}'?" if near else f" (no class '{leaf}' in {mod_name})"


def _op_aliases(cls, kwargs: dict) -> list[tuple[str, str, str]]:
    out = []
    if getattr(cls, "OPS", None) is None:
        return out
    for key in ("generate_op", "prefill_op"):
        name = kwargs.get(key)
        if name:
            alias = resolve_op(cls, name)[1]
            if alias is not None and alias not in out:
                out.append(alias)
    return out


def _check_device(value, fail) -> None:
    if not isinstance(value, str):
        raise fail(f"a device is a string such as 'cpu' or 'cuda:0', not {_shown(value)}")
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        raise fail(f"{_short(value)!r} is not a device (use 'cpu', 'cuda', 'cuda:1', ...)") from None
    if dev.type not in RULE_DEVICE_TYPES:
        raise fail(f"'{value}' is not a device rules can place modules on (use 'cpu', 'cuda', 'cuda:1', ...)")


def _shown(value) -> str:
    return "an empty string" if value == "" else repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "..."


def _short(text: str) -> str:
    return text if len(text) <= 40 else text[:40] + "..."


def _check_kwargs(cls, rtext: str, kwargs: dict, klines: dict[str, int], source: str, index: int,
                  device: str | None = None) -> None:
    def fail(key: str, msg: str) -> RuleError:
        return RuleError(f"{source}:{klines.get(key, 0)}: rule #{index} (replace.kwargs.{safe_yaml.printable(str(key))}): "
                         f"{msg}")

    if cls is None:
        allowed = {"generate_device": (str,), "prefill_device": (str,), "device": (str,)}
        for key, value in kwargs.items():
            if key not in allowed:
                raise fail(key, f"'default' keeps the module as it is and takes only devices "
                                f"({', '.join(allowed)})")
            _check_device(value, lambda m: fail(key, m))
        _check_phases(None, kwargs, device, fail)
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
        if ((value is None and type(None) not in types) or (value is not None and not isinstance(value, types))
                or (isinstance(value, bool) and bool not in types)):  # YAML's true is an int to Python
            names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise fail(key, f"must be {names}, not {_shown(value)}")
        _check_kwarg_value(key, value, lambda m: fail(key, m))
    _check_phases(cls, kwargs, device, fail)


def _check_phases(cls, kwargs: dict, device: str | None, fail) -> None:
    """The phase decision a rule's devices and kwargs lead to (``operators/phases.py``): the ops
    exist, each accepts its device (``Op.check_device``) and its kwargs."""
    try:
        decide_phases(cls, kwargs, device)
    except PhaseError as e:
        raise fail(e.key, str(e)) from None


def check_rule_phases(rule: Rule) -> None:
    """The parser's phase check again, for a rule whose devices changed after parsing (a device map):
    an op the new device cannot run is refused as it would be had the file named that device."""
    cls = rule.replace_class
    if not rule.kwargs or (cls is not None and (cls.accepted_kwargs() if hasattr(cls, "accepted_kwargs")
                                                 else None) is None):
        return  # the parser decides phases only for a rule with kwargs of an operator that declares them

    def fail(key: str, msg: str) -> RuleError:
        return RuleError(f"{rule.source}:{rule.key_lines.get(f'replace.kwargs.{key}', 0)}: rule #{rule.index} "
                         f"(replace.kwargs.{safe_yaml.printable(str(key))}): {msg}")

    _check_phases(cls, rule.kwargs, rule.device, fail)


def _check_kwarg_value(key: str, value, fail) -> None:
    """Values of the right type that still cannot be meant: an empty name, a count out of range,
    a device rules cannot place on (a ``transfer_map``'s too)."""
    if value == "":
        raise fail("the value is an empty string; leave the key out for its default")
    if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= MAX_INT_KWARG:
        raise fail(f"{_shown(value)} is out of range (a count or size: 0 to {MAX_INT_KWARG})")
    if key in DEVICE_KWARGS and value is not None:
        _check_device(value, fail)
    if key == "transfer_map" and isinstance(value, dict):
        for layer, dev in value.items():
            if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
                raise fail(f"keys are layer numbers (0, 1, ...), not {_shown(layer)}")
            _check_device(dev, lambda m, layer=layer: fail(f"layer {layer}: {m}"))
