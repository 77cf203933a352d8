"""Match rules against a model's module tree and compute the placement of every module.

The plan is the one source of truth: ``explain`` prints it, ``inject`` applies it and the
loader reads devices from it.  With the weights it also holds the format of every weight
(``Plan.decide_formats``; ``operators/formats.py``): each op's, which the operators receive and
load by, and the float copies of plain modules' tensors, which the loader makes.

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
from ..operators.base import BaseInjectedModule
from ..operators.formats import WeightFormat, float_format
from ..operators.kinds import describe, kinds_of
from ..operators.phases import PhaseError, Phases, decide_phases
from .rules import Rule, load_rules

#: rule kwargs the phase decision consumes (the operator gets the decision, not these)
PHASE_KWARGS = ("device", "generate_device", "prefill_device", "generate_op", "prefill_op")


@dataclass
class Placement:
    name: str
    module_class: str
    rule: Rule | None  # the rule that matched this module; None when inherited
    operator: type | None  # injected class; None keeps the module
    phases: Phases  # devices and ops of both phases, decided once
    kwargs: dict[str, Any] = field(default_factory=dict)  # the operator's constructor kwargs
    from_ancestor: str | None = None  # name of the matched ancestor whose placement applies
    #: phase ("generate", and "prefill" where a second op holds its own copy) -> weight name -> its
    #: format, from ``Plan.decide_formats``; empty until the weights are known.  A module without ops
    #: (a plain one, or an operator that keeps the module's own tensors): its own tensors, "generate"
    formats: dict[str, dict[str, WeightFormat]] = field(default_factory=dict)

    @property
    def operator_name(self) -> str:
        return self.operator.__name__ if self.operator is not None else "default"

    @property
    def generate_device(self) -> torch.device:
        return self.phases.generate_device

    @property
    def prefill_device(self) -> torch.device:
        return self.phases.prefill_device

    @property
    def generate_op(self) -> str | None:
        return self.phases.generate_op.name if self.phases.generate_op is not None else None

    @property
    def prefill_op(self) -> str | None:
        return self.phases.prefill_op.name if self.phases.prefill_op is not None else None


@dataclass
class Plan:
    placements: dict[str, Placement]
    rules: list[Rule]
    matches: dict[int, list[str]]  # rule index -> module names it matched
    default_device: torch.device
    #: rules that match nothing only because this configuration lacks a layer kind of its own family
    #: (e.g. a dense-MLP rule for a Qwen3-MoE whose every layer is sparse): noted, never an error
    absent_kind: dict[int, str] = field(default_factory=dict)

    #: the weight source the formats were decided from (None: not yet)
    formats_source: Any = field(default=None, repr=False, compare=False)

    def decide_formats(self, model: nn.Module, weights) -> None:
        """Decide how every weight is held, once per weight source: each op of each placement is asked
        for each of its weights (``Op.decide_format``: from the stored type in ``weights``' header and
        the rule's kwargs); a module without ops holds its own tensors as float copies in their dtype
        in the model (what the loader reads them as).  ``weights``: a source, or
        ``inject.ModelWeights`` over one (tied weights resolved).  Reads no tensor data."""
        source = getattr(weights, "source", weights)
        if self.formats_source is source:
            return
        modules = dict(model.named_modules())
        for p in self.placements.values():
            ph = p.phases
            if p.operator is None or not ph.has_ops:
                # the loader reads the module's own tensors: a plain module's, or those an operator
                # without ops keeps under their names (a third-party class holds what it registers)
                keeps = p.operator is None or issubclass(p.operator, BaseInjectedModule)
                own = plain_formats(modules[p.name], p.name, weights) if keeps and p.name in modules else {}
                p.formats = {"generate": own} if own else {}
                continue
            dtype = module_dtype(modules[p.name])
            ops = {"generate": ph.generate_op} if ph.shared else {"generate": ph.generate_op, "prefill": ph.prefill_op}
            p.formats = {}
            for phase, op in ops.items():
                own = {k: v for k, v in p.kwargs.items() if k in op.extra_kwargs}
                p.formats[phase] = {n: op.decide_format(weights, n, dtype, own)
                                    for n in op.weight_names(p.name) if weights.has(n)}
        self.formats_source = source

    def unmatched_rules(self) -> list[Rule]:
        """Rules that match nothing (a likely typo): an error unless the caller allows it."""
        return [r for r in self.rules if not self.matches.get(r.index) and r.index not in self.absent_kind]

    def absent_kind_notes(self) -> list[str]:
        return [f"{r.where()}: matches nothing: {self.absent_kind[r.index]}" for r in self.rules
                if r.index in self.absent_kind]

    def injected(self) -> list[Placement]:
        return [p for p in self.placements.values() if p.operator is not None]

    def devices(self) -> list[torch.device]:
        seen: dict[str, torch.device] = {}
        for p in self.placements.values():
            for d in (p.generate_device, p.prefill_device):
                seen.setdefault(str(d), d)
        return list(seen.values())


def plain_formats(module: nn.Module, name: str, weights) -> dict[str, WeightFormat]:
    """The formats of a plain module's own float tensors that ``weights`` hold: a float copy in the
    tensor's dtype in the model (the loader's ``load_weights`` reads them by these)."""
    own = list(module.named_parameters(recurse=False))
    own += [(n, b) for n, b in module.named_buffers(recurse=False) if n not in module._non_persistent_buffers_set]
    out = {}
    for leaf, t in own:
        full = f"{name}.{leaf}" if name else leaf
        if t.is_floating_point() and weights.has(full):
            try:
                out[full] = float_format(t.dtype)
            except ValueError:  # a float dtype no weight format names (float64): read as it is
                continue
    return out


def module_dtype(module: nn.Module) -> torch.dtype:
    """The float dtype of a module's weights as the model was built (an operator: its original's)."""
    orig = getattr(module, "orig_module", None) or module
    for t in list(orig.parameters(recurse=False)) + list(orig.parameters()):
        if t.is_floating_point():
            return t.dtype
    return torch.float32


def plan_model(model: nn.Module, rules, default_device: str | torch.device = "cpu", weights=None) -> Plan:
    """The placement of every module of ``model`` under ``rules``; with ``weights``, each op's weight
    formats too (else ``Plan.decide_formats`` once the weights are open)."""
    rules = load_rules(rules)
    default_device = torch.device(default_device)
    placements: dict[str, Placement] = {}
    matches: dict[int, list[str]] = {r.index: [] for r in rules}
    root = Placement("", type(model).__name__, None, None, Phases(default_device, default_device))

    def visit(name: str, module: nn.Module, parent: Placement, active: bool) -> None:
        rule = next((r for r in rules if r.matches(name, module)), None) if active else None
        if rule is not None:
            place = _from_rule(name, module, rule, parent)
            matches[rule.index].append(name)
        else:
            anc = parent.name if (parent.rule is not None) else parent.from_ancestor
            dev = parent.generate_device
            place = Placement(name, type(module).__name__, None, None, Phases(dev, dev), from_ancestor=anc)
        placements[name] = place
        child_active = active and (rule is None or rule.recursive)
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child, place, child_active)

    visit("", model, root, True)
    plan = Plan(placements, rules, matches, default_device, _absent_kinds(model, rules, matches))
    if weights is not None:
        plan.decide_formats(model, weights)
    return plan


def _absent_kinds(model: nn.Module, rules: list[Rule], matches: dict[int, list[str]]) -> dict[int, str]:
    """Unmatched rules whose class is one of the model's own modeling classes (its family has such
    layers, this configuration has none): rule files for a family — the reference system's too —
    carry rules for every variant of it."""
    family = type(model).__module__
    present = {type(m) for m in model.modules()}
    out = {}
    for r in rules:
        if matches.get(r.index) or not isinstance(r.match_class, tuple):
            continue
        own = [c for c in r.match_class if c.__module__ == family]
        if own and not any(issubclass(t, tuple(own)) for t in present):  # else the name part missed them
            out[r.index] = f"this {type(model).__name__} has no {own[0].__name__} module"
    return out


def _from_rule(name: str, module: nn.Module, rule: Rule, parent: Placement) -> Placement:
    cls = rule.replace_class
    if cls is not None and hasattr(cls, "can_replace") and not cls.can_replace(module):
        raise RuleError(
            f"{rule.where('replace.class')}: {cls.__name__} replaces a {describe(cls.REPLACES)}, but '{name}' is "
            f"a {type(module).__name__} ({describe(kinds_of(module))})"
        )
    inherited = (parent.generate_device,
                 parent.prefill_device if parent.operator is not None else parent.generate_device)
    try:
        phases = decide_phases(cls, rule.kwargs, rule.device, inherited)
    except PhaseError as e:
        raise RuleError(f"{rule.where('replace.kwargs')}: {e} (matched '{name}')") from None
    # the operator's constructor gets the rest: devices and ops are in ``phases``
    kw = {k: v for k, v in rule.kwargs.items() if k not in PHASE_KWARGS}
    return Placement(name=name, module_class=type(module).__name__, rule=rule, operator=cls, phases=phases,
                     kwargs=kw)


def check_devices_available(plan: Plan) -> None:
    """Refuse a plan that names devices this machine lacks, naming the rule that did it."""
    n_cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for p in plan.placements.values():
        for dev in (p.generate_device, p.prefill_device):
            if dev.type == "cuda" and (n_cuda == 0 or (dev.index or 0) >= n_cuda):
                rule = p.rule or (plan.placements.get(p.from_ancestor or "", None) or p).rule
                where = rule.where() if rule else "default device"
                have = f"{n_cuda} CUDA device(s)" if n_cuda else "no CUDA device"
                remap = "cuda=cpu" if n_cuda == 0 else f"{dev}=cuda:0"
                raise RuleError(
                    f"{where}: places '{p.name or '<model>'}' on {dev}, but this machine has {have}; "
                    f"run the rule file with --device_map {remap} (device_map='{remap}' in Python), "
                    f"use a -cpu rule file, or change the device"
                )
            if dev.type not in ("cpu", "cuda", "meta"):
                raise RuleError(f"'{p.name}': device type {dev.type} is not supported")
