"""Per-phase decision of one module: device and op of prefill and generate, decided once.

:func:`decide_phases` is the only place that turns a rule's ``replace`` (operator, device,
kwargs) into a :class:`Phases`.  Rule validation calls it without a model (devices a rule
leaves open stay unknown), the plan with the parent's placement, operator construction
with the plan's answer, and ``explain`` prints it.

The semantics (docs/rules.md, "Phases"):

* devices: ``generate_device`` / ``prefill_device``, else ``device`` (kwarg or
  ``replace.device``) for both, else one stated phase's device for the other, else inherited;
* ops: ``generate_op`` or the operator's default; ``prefill_op`` or the generate op;
  ``prefill_op: null`` means no prefill op — the generate op serves every call;
* the same op on the same device for both phases is one op with one copy of the weights;
* an operator without ops (and ``default``) keeps its weights on one device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import RuleError
from .registry import resolve_op

DEVICE_KWARGS = ("generate_device", "prefill_device", "device")


class PhaseError(RuleError):
    """A rule's phases cannot be decided; ``key`` is the rule kwarg at fault."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class Phases:
    """Devices and op classes of both phases of one module (devices None: not known yet)."""

    generate_device: torch.device | None
    prefill_device: torch.device | None
    generate_op: type | None = None  # None: the operator has no ops
    prefill_op: type | None = None  # None with a generate op: the generate op serves every call

    @property
    def has_ops(self) -> bool:
        return self.generate_op is not None

    @property
    def prefill_disabled(self) -> bool:
        return self.has_ops and self.prefill_op is None

    @property
    def shared(self) -> bool:
        """One op (one copy of the weights) serves both phases."""
        return (not self.has_ops or self.prefill_op is None
                or (self.prefill_op is self.generate_op and self.prefill_device == self.generate_device))

    def weight_devices(self) -> list[torch.device]:
        """The devices that hold a copy of this module's weights."""
        devs = [self.generate_device]
        if not self.shared:
            devs.append(self.prefill_device)
        return devs

    def label(self, phase: str, fallback: str) -> str:
        """``device/op`` of a phase for tables (``fallback``: the name shown when there is no op)."""
        if phase == "prefill" and not self.prefill_disabled:
            op, dev = self.prefill_op, self.prefill_device
        else:  # generate, or a prefill the generate op serves
            op, dev = self.generate_op, self.generate_device
        return f"{dev}/{op.name if op is not None else fallback}"


def rule_devices(kwargs: dict, device: str | None) -> tuple[torch.device | None, torch.device | None]:
    """(generate, prefill) devices a rule states; None where it states neither."""
    dev = kwargs.get("device") or device
    gen = kwargs.get("generate_device") or dev
    pre = kwargs.get("prefill_device") or dev
    if gen is None and pre is None:
        return None, None
    return torch.device(gen or pre), torch.device(pre or gen)


def decide_phases(cls, kwargs: dict, device: str | None = None,
                  inherited: tuple[torch.device | None, torch.device | None] = (None, None)) -> Phases:
    """The :class:`Phases` of operator ``cls`` (None: ``default``) under a rule's kwargs.

    ``inherited`` gives the devices a rule that states none takes over.  Raises
    :class:`PhaseError` naming the kwarg at fault."""
    gen_d, pre_d = rule_devices(kwargs, device)
    if gen_d is None:
        gen_d, pre_d = inherited
    ops = getattr(cls, "OPS", None) if cls is not None else None
    if ops is None:
        if gen_d is not None and pre_d is not None and gen_d != pre_d:
            who = f"{cls.__name__} keeps its weights" if cls is not None else "'default' keeps the module"
            raise PhaseError("prefill_device", f"{who} on one device, but prefill_device {pre_d} differs from "
                                               f"generate_device {gen_d} (use an operator with ops to switch per phase)")
        return Phases(gen_d, pre_d)
    gen_name = kwargs.get("generate_op") or cls.DEFAULT_OP
    gen_op = _op(cls, "generate_op", gen_name)
    if "prefill_op" in kwargs and kwargs["prefill_op"] is None:
        pre_op = None
    else:
        pre_op = _op(cls, "prefill_op", kwargs.get("prefill_op") or gen_name)
    chosen = [("generate_op", gen_op, gen_d)] + ([("prefill_op", pre_op, pre_d)] if pre_op is not None else [])
    for key, op, dev in chosen:
        if dev is not None and dev.type != "meta":
            why = op.check_device(dev)
            if why:
                raise PhaseError(key, why)
        problem = op.validate_kwargs(kwargs)
        if problem:
            raise PhaseError(*problem)
    # a kwarg only some op understands must belong to an op this rule actually uses
    own = set(cls.COMMON_KWARGS) | set(cls.KWARGS) | set(DEVICE_KWARGS)
    for key in kwargs:
        if key not in own and not any(key in op.extra_kwargs for _, op, _ in chosen):
            users = sorted(n for n, o in ops.items() if key in o.extra_kwargs)
            used = ", ".join(sorted({op.name for _, op, _ in chosen}))
            raise PhaseError(key, f"only {', '.join(users)} take(s) '{key}', but this rule's ops are {used}")
    return Phases(gen_d, pre_d, gen_op, pre_op)


def _op(cls, key: str, name: str):
    try:
        return resolve_op(cls, name)[0]
    except RuleError as e:
        raise PhaseError(key, str(e)) from None
