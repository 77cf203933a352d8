"""``--device_map cuda=cpu``: run a rule file written for other devices (e.g. a GPU file on a CPU-only
machine) by rewriting every device it names while the rules are parsed.

A map is ``FROM=TO[,FROM=TO...]``.  ``FROM`` without an index (``cuda``) stands for every device of
that type (``cuda``, ``cuda:0``, ``cuda:1`` ...); with one (``cuda:1``) only that device, and an
indexed entry wins over a bare one.  Devices are rewritten in ``replace.device``, the device kwargs
(``device``, ``generate_device``, ``prefill_device``, ``out_device``) and ``transfer_map`` values,
in the YAML text itself, so every later check and error still names the file's own lines.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import yaml

from ..errors import ConfigError, RuleError
from . import safe_yaml
from .rules import RULE_DEVICE_TYPES

DEVICE_KEYS = ("device", "generate_device", "prefill_device", "out_device")


def parse_device_map(text: str | None) -> dict[str, str]:
    """``"cuda=cpu,cuda:1=cuda:0"`` -> ``{"cuda": "cpu", "cuda:1": "cuda:0"}`` (one-line error if malformed)."""
    if not text:
        return {}
    out: dict[str, str] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        src, sep, dst = part.partition("=")
        src, dst = src.strip(), dst.strip()
        if not sep or not src or not dst:
            raise ConfigError(f"--device_map '{text}': each entry is FROM=TO (e.g. cuda=cpu), not '{part}'")
        for d in (src, dst):
            try:
                torch.device(d)
            except (RuntimeError, ValueError):
                raise ConfigError(f"--device_map '{text}': '{d}' is not a device (cpu, cuda, cuda:1, ...)") from None
        if torch.device(dst).type not in RULE_DEVICE_TYPES:
            raise ConfigError(f"--device_map '{text}': rules cannot place modules on '{dst}' (cpu, cuda, cuda:1, ...)")
        out[src] = dst
    return out


def map_device(value: str, device_map: dict[str, str]) -> str:
    """The device ``value`` becomes under ``device_map`` (unchanged when no entry applies)."""
    if not device_map or not isinstance(value, str):
        return value
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        return value  # not a device: left for the rule checks to report
    for key in (str(dev), f"{dev.type}:0" if dev.index is None else None, dev.type):
        if key is not None and key in device_map:
            return device_map[key]
    return value


def remap_rules_text(text: str, device_map: dict[str, str]) -> str:
    """The rule file's text with its devices rewritten; every line stays where it was."""
    if not device_map:
        return text
    try:
        root = safe_yaml.compose(text, "<device map>")
    except RuleError:
        return text  # the rule parser reports it with its file and line
    edits: list[tuple[int, int, str]] = []

    def scalar(node) -> None:
        if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:str":
            new = map_device(node.value, device_map)
            if new != node.value:
                edits.append((node.start_mark.index, node.end_mark.index, new))

    def walk(node, parent_key: str | None = None) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = k.value if isinstance(k, yaml.ScalarNode) else None
                if key in DEVICE_KEYS:
                    scalar(v)
                elif key == "transfer_map" and isinstance(v, yaml.MappingNode):
                    for _, dv in v.value:
                        scalar(dv)
                else:
                    walk(v, key)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                walk(item, parent_key)

    if root is not None:
        walk(root)
    for start, end, new in sorted(edits, reverse=True):
        quoted = text[start] in "'\""
        text = text[:start] + (f'"{new}"' if quoted else new) + text[end:]
    return text


def load_rules_mapped(rules, device_map: dict[str, str] | str | None = None):
    """Parsed, validated rules (as :func:`ktransformers.optimize.rules.load_rules`) after the device map."""
    from .rules import load_rules, parse_rules

    if isinstance(device_map, str):
        device_map = parse_device_map(device_map)
    if not device_map:
        return load_rules(rules)
    if isinstance(rules, (str, os.PathLike)) and (
        isinstance(rules, os.PathLike) or ("\n" not in rules and rules.strip().endswith((".yaml", ".yml")))
    ):
        path = Path(rules)
        if not path.is_file():
            raise RuleError(f"{path}: rule file not found")
        return parse_rules(remap_rules_text(safe_yaml.read_text(path), device_map), str(path))
    if isinstance(rules, str):
        return parse_rules(remap_rules_text(rules, device_map), "<string>")
    if isinstance(rules, (list, tuple)) and not any(hasattr(r, "key_lines") for r in rules):
        return parse_rules(remap_rules_text(yaml.safe_dump(list(rules), sort_keys=False), device_map), "<rules>")
    raise RuleError("a device map applies to a rule file, YAML text or rule dicts, not to parsed rules")
