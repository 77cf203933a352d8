"""Linear layers: ``KTransformersLinear`` and its ops (``KLinearTorch`` here; CPU-kernel and
FP8 ops register themselves into ``LINEAR_OPS`` from their own files with ``@register``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import BaseInjectedModule, Op
from .kinds import LINEAR
from .registry import register

LINEAR_OPS: dict[str, type[Op]] = {}


class LinearOp(Op):
    """A linear op: ``forward(x[..., in]) -> y[..., out]`` with x already on ``self.device``."""

    TABLE = LINEAR_OPS

    def __init__(self, key, config, orig_module, device, **kwargs):
        super().__init__(key, config, orig_module, device, **kwargs)
        self.in_features = int(orig_module.in_features)
        self.out_features = int(orig_module.out_features)
        self.has_bias = getattr(orig_module, "bias", None) is not None
        self.weight_shape = (self.out_features, self.in_features)

    @classmethod
    def weight_names(cls, key: str) -> tuple[str, ...]:
        return (f"{key}.weight",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError


@register("KLinearTorch")
class KLinearTorch(LinearOp):
    """Dequantized weight in the model dtype, ``torch.nn.functional.linear`` (CPU or CUDA)."""

    def load(self, weights, dtype):
        self.weight = self.float_weight(weights, f"{self.key}.weight", dtype)
        self.bias = (
            weights.tensor(f"{self.key}.bias", dtype=dtype, device=self.device) if self.has_bias else None
        )

    def forward(self, x):
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


@register("KTransformersLinear")
class KTransformersLinear(BaseInjectedModule):
    """Drop-in for ``nn.Linear`` whose weights live in per-phase ops.

    kwargs: ``generate_op``/``prefill_op`` (``KLinearTorch``, ``KLinearCPU`` …), devices, ``out_device``.
    """

    OPS = LINEAR_OPS
    OP_TABLE_NAME = "linear"
    DEFAULT_OP = "KLinearTorch"
    REPLACES = (LINEAR,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.numel() // x.shape[-1] if x.dim() > 0 else 1
        op = self.select_op(tokens)
        out_device = self.out_device or x.device
        in_dtype = x.dtype
        y = op.forward(x.to(op.device))
        if y.dtype != in_dtype and in_dtype.is_floating_point:
            y = y.to(in_dtype)
        return y.to(out_device)

    @property
    def weight(self) -> torch.Tensor:
        """The generate op's weight, for code that inspects ``linear.weight`` (dtype, device)."""
        w = getattr(self.generate_op, "weight", None)
        return w if w is not None else self.orig_module.weight
