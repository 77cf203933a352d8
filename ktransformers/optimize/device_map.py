"""``--device_map cuda=cpu``: run a rule file written for other devices (e.g. a GPU file on a CPU-only
machine) by rewriting every device its parsed rules name.

A map is ``FROM=TO[,FROM=TO...]``.  ``FROM`` without an index (``cuda``) stands for every device of
that type (``cuda``, ``cuda:0``, ``cuda:1`` ...); with one (``cuda:1``) only that device, and an
indexed entry wins over a bare one.  :func:`map_rules` takes the :class:`~.rules.Rule` objects the
file was parsed into and gives new ones with their devices rewritten in ``replace.device``, the
device kwargs (``device``, ``generate_device``, ``prefill_device``, ``out_device``) and
``transfer_map`` values; the rules keep their file, lines and keys, so every later check and error
still names the file's own lines, and the phase check the parser made is made again on the new
devices (an op the new device cannot run is refused by its line).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import ConfigError
from .rules import RULE_DEVICE_TYPES, Rule, check_rule_phases, load_rules

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


def map_rules(rules: list[Rule], device_map: dict[str, str] | str | None) -> list[Rule]:
    """``rules`` with their devices rewritten by ``device_map`` (new :class:`Rule` objects where a device
    changed, the same objects elsewhere; the input is not modified)."""
    if isinstance(device_map, str):
        device_map = parse_device_map(device_map)
    if not device_map:
        return list(rules)
    out = []
    for rule in rules:
        kwargs = {k: _map_kwarg(k, v, device_map) for k, v in rule.kwargs.items()}
        device = map_device(rule.device, device_map)
        if device == rule.device and kwargs == rule.kwargs:
            out.append(rule)
            continue
        mapped = replace(rule, device=device, kwargs=kwargs, key_lines=dict(rule.key_lines),
                         aliases=list(rule.aliases))
        check_rule_phases(mapped)
        out.append(mapped)
    return out


def _map_kwarg(key: str, value, device_map: dict[str, str]):
    if key in DEVICE_KEYS:
        return map_device(value, device_map)
    if key == "transfer_map" and isinstance(value, dict):
        return {layer: map_device(dev, device_map) for layer, dev in value.items()}
    return value


def load_rules_mapped(rules, device_map: dict[str, str] | str | None = None) -> list[Rule]:
    """Parsed, validated rules (any input :func:`~.rules.load_rules` takes, parsed once) after the device map."""
    return map_rules(load_rules(rules), device_map)
