"""The op: the computation of one phase of an injected module, on one device, and the spec of a
rule kwarg.  Below the registry (``@register`` files ops into their family's table) and the
per-phase decision (``phases.py``), which both need the class; ``base.py`` builds operators on it
and re-exports both names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from .formats import WeightFormat, float_format


@dataclass(frozen=True)
class KwargSpec:
    """One accepted rule kwarg: its type(s), default, and a one-line meaning for docs/errors."""

    types: tuple[type, ...]
    default: Any = None
    help: str = ""


class Op:
    """The computation of one phase of an injected module, on one device.

    Ops hold their tensors as plain attributes (not nn.Parameters) so that the module tree —
    and with it every parameter name — stays exactly that of the original model.  A family
    of ops (linear, experts) is a subclass with its own ``TABLE``; ``@register`` fills it.
    """

    #: short name used in rules (``generate_op: KLinearTorch``); set by ``@register``
    name: ClassVar[str] = ""
    #: the op table of this family (name -> op class); set on each family's base class
    TABLE: ClassVar[dict[str, type[Op]]]
    #: devices this op can run on: "cpu", "cuda" or "any"
    device_kinds: ClassVar[tuple[str, ...]] = ("any",)
    #: extra rule kwargs this op accepts beyond the wrapper's own
    extra_kwargs: ClassVar[dict[str, KwargSpec]] = {}

    def __init__(self, key: str, config, orig_module: nn.Module, device: torch.device, **kwargs):
        self.key = key
        self.config = config
        self.orig_module = orig_module
        self.device = torch.device(device)
        self.kwargs = kwargs
        self.loaded = False
        #: weight name -> the plan's :class:`~.formats.WeightFormat` (set by the operator building the op)
        self.formats: dict[str, WeightFormat] = {}
        #: the stored shape of the op's one weight tensor, which ``check_shape`` holds it to
        self.weight_shape: tuple[int, ...] | None = None

    @classmethod
    def weight_names(cls, key: str) -> tuple[str, ...]:
        """The weight tensors an op of module ``key`` holds, whose formats the plan decides."""
        return ()

    def check_shape(self, weights, name: str) -> None:
        """A one-line WeightError naming the file and tensor when ``name`` is stored in another shape
        than ``self.weight_shape`` (the model module's; set by ops of one weight tensor)."""
        shape = tuple(weights.shape(name))
        if shape != tuple(self.weight_shape):
            from ..errors import WeightError

            raise WeightError(f"{weights.path}: tensor '{name}' has shape {list(shape)}, the model expects "
                              f"{list(self.weight_shape)}")

    def float_weight(self, weights, name: str, dtype: torch.dtype) -> torch.Tensor:
        """``name``, its shape checked, as the plan's float copy on the op's device."""
        self.check_shape(weights, name)
        return weights.tensor(name, dtype=self.weight_format(weights, name, dtype).torch_dtype, device=self.device)

    @classmethod
    def decide_format(cls, weights, name: str, dtype: torch.dtype, kwargs: dict) -> WeightFormat:
        """How this op holds weight ``name`` of a model in ``dtype``, under its rule ``kwargs``: called
        by the plan, once.  By default a float copy in the model's dtype."""
        return float_format(dtype)

    def weight_format(self, weights, name: str, dtype: torch.dtype) -> WeightFormat:
        """The plan's format of ``name``; an op built outside a plan decides it here, the same way."""
        fmt = self.formats.get(name)
        return fmt if fmt is not None else type(self).decide_format(weights, name, dtype, self.kwargs)

    @classmethod
    def check_device(cls, device: torch.device) -> str | None:
        """None when this op can run on ``device``; else a sentence saying why not."""
        if "any" in cls.device_kinds or device.type in cls.device_kinds:
            return None
        return f"{cls.name} runs only on {' or '.join(cls.device_kinds)}, not {device}"

    @classmethod
    def validate_kwargs(cls, kwargs: dict) -> tuple[str, str] | None:
        """Check the values of this op's rule kwargs: ``(key, message)`` for the first bad one."""
        return None

    def load(self, weights, dtype: torch.dtype) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def unload(self) -> None:
        for k, v in list(vars(self).items()):
            if isinstance(v, torch.Tensor):
                setattr(self, k, None)
        self.loaded = False

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in vars(self).values() if isinstance(v, torch.Tensor))
