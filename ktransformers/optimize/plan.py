"""Match rules against a model's module tree and compute the placement of every module.

The plan is the one source of truth: ``explain`` prints it, ``inject`` applies it and the
loader reads devices from it.

Placement rules:
* a module matched by a rule gets that rule's operator, devices and ops; devices the rule
  does not state are inherited from the parent;
* a module no rule matches keeps its class and inherits the placement (generate device) of
  its nearest matched ancestor; the root's default is ``default_device``;
* below a rule with ``recursive: false`` no rule is tried; modules there inherit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import RuleError
from .rules import Rule, load_rules


@dataclass
class Placement:
    name: str
    module_class: str
    rule: Rule | None  # the rule that matched this module; None when inherited
    operator: type | None  # injected class; None keeps the module
    generate_device: torch.device
    prefill_device: torch.device
    generate_op: str | None = None
    prefill_op: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    from_ancestor: str | None = None  # name of the matched ancestor whose placement applies

    @property
    def operator_name(self) -> str:
        return self.operator.__name__ if self.operator is not None else "default"

    def phase_ops(self) -> tuple[str, str]:
        gen = self.generate_op or self.operator_name
        pre = self.prefill_op or gen
        return pre, gen


@dataclass
class Plan:
    placements: dict[str, Placement]
    rules: list[Rule]
    matches: dict[int, list[str]]  # rule index -> module names it matched
    default_device: torch.device

    def unmatched_rules(self) -> list[Rule]:
        return [r for r in self.rules if not self.matches.get(r.index)]

    def injected(self) -> list[Placement]:
        return [p for p in self.placements.values() if p.operator is not None]

    def devices(self) -> list[torch.device]:
        seen: dict[str, torch.device] = {}
        for p in self.placements.values():
            for d in (p.generate_device, p.prefill_device):
                seen.setdefault(str(d), d)
        return list(seen.values())


def plan_model(model: nn.Module, rules, default_device: str | torch.device = "cpu") -> Plan:
    rules = load_rules(rules)
    default_device = torch.device(default_device)
    placements: dict[str, Placement] = {}
    matches: dict[int, list[str]] = {r.index: [] for r in rules}
    root = Placement("", type(model).__name__, None, None, default_device, default_device)

    def visit(name: str, module: nn.Module, parent: Placement, active: bool) -> None:
        rule = next((r for r in rules if r.matches(name, module)), None) if active else None
        if rule is not None:
            place = _from_rule(name, module, rule, parent)
            matches[rule.index].append(name)
        else:
            anc = parent.name if (parent.rule is not None) else parent.from_ancestor
            dev = parent.generate_device
            place = Placement(name, type(module).__name__, None, None, dev, dev, from_ancestor=anc)
        placements[name] = place
        child_active = active and (rule is None or rule.recursive)
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, place, child_active)

    visit("", model, root, True)
    return Plan(placements, rules, matches, default_device)


def _from_rule(name: str, module: nn.Module, rule: Rule, parent: Placement) -> Placement:
    kw = dict(rule.kwargs)
    dev = kw.pop("device", None) or rule.device
    gen = kw.pop("generate_device", None) or dev
    pre = kw.pop("prefill_device", None) or dev
    if gen is None and pre is None:
        gen_d = parent.generate_device
        pre_d = parent.prefill_device if parent.operator is not None else gen_d
    else:
        gen_d = torch.device(gen or pre)
        pre_d = torch.device(pre or gen)
    cls = rule.replace_class
    gen_op = pre_op = None
    ops = getattr(cls, "OPS", None) if cls is not None else None
    if ops is not None:
        gen_op = kw.get("generate_op") or cls.DEFAULT_OP
        if "prefill_op" in kw and kw["prefill_op"] is None:
            pre_op = None
        else:
            pre_op = kw.get("prefill_op") or gen_op
    elif cls is not None and gen_d != pre_d:
        raise RuleError(
            f"{rule.where('replace.kwargs')}: {cls.__name__} keeps its weights on one device, but "
            f"prefill_device {pre_d} differs from generate_device {gen_d} (matched '{name}')"
        )
    elif cls is None and gen_d != pre_d:
        raise RuleError(
            f"{rule.where('replace.kwargs')}: 'default' keeps the module on one device, but prefill_device "
            f"{pre_d} differs from generate_device {gen_d} (matched '{name}')"
        )
    if cls is not None:
        # keep the kwargs the operator's constructor gets: devices are passed separately
        kw = {k: v for k, v in rule.kwargs.items() if k not in ("device", "generate_device", "prefill_device")}
    return Placement(
        name=name, module_class=type(module).__name__, rule=rule, operator=cls,
        generate_device=gen_d, prefill_device=pre_d, generate_op=gen_op, prefill_op=pre_op, kwargs=kw,
    )


def check_devices_available(plan: Plan) -> None:
    """Refuse a plan that names devices this machine lacks, naming the rule that did it."""
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for p in plan.placements.values():
        for dev in (p.generate_device, p.prefill_device):
            if dev.type == "cuda" and (n_cuda == 0 or (dev.index or 0) >= n_cuda):
                rule = p.rule or (plan.placements.get(p.from_ancestor or "", None) or p).rule
                where = rule.where() if rule else "default device"
                have = f"{n_cuda} CUDA device(s)" if n_cuda else "no CUDA device"
                raise RuleError(
                    f"{where}: places '{p.name or '<model>'}' on {dev}, but this machine has {have}; "
                    f"use a -cpu rule file or change the device"
                )
            if dev.type not in ("cpu", "cuda", "meta"):
                raise RuleError(f"'{p.name}': device type {dev.type} is not supported")
