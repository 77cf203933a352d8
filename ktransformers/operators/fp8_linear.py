"""``KLinearFP8``: a linear op that keeps DeepSeek-style FP8 block-quantized weights.

The weight stays ``float8_e4m3fn [out, in]`` with fp32 ``scale_inv [ceil(out/128), ceil(in/128)]``
on the op's device (one byte per parameter, the point of the FP8 release), and each call
dequantizes it block-wise into the activation dtype and runs ``F.linear`` — pure torch, so it
runs on the CPU as well as on CUDA (no FP8 GEMM kernel is needed or assumed).  Per-call
dequantization costs bandwidth on the CPU; it is meant for the attention and shared-expert
linears, which are a small part of a DeepSeek-V3 token, while routed experts go through the
weight source's load-time dequantization (``weights/fp8.py``) to the CPU expert kernels.
Rules that prefer speed over memory use ``KLinearTorch`` (dequantized once at load).

Weights: the source's ``raw(name)`` when it is FP8 with its scales (``FP8DequantSource``); a
weight stored in any other precision is block-quantized at load with ``block_size`` (so the op
always holds FP8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..weights.fp8 import BLOCK, block_dequant, block_quant
from .base import KwargSpec
from .formats import FP8, WeightFormat
from .linear import LinearOp
from .registry import register


@register("KLinearFP8")
class KLinearFP8(LinearOp):
    """FP8 weight + 128x128 block scales, dequantized per call (CPU or CUDA)."""
    extra_kwargs = {
        "block_size": KwargSpec((int,), BLOCK, "FP8 block edge (weights quantized at load use it too)"),
    }

    def __init__(self, key, config, orig_module, device, block_size=BLOCK, **kwargs):
        super().__init__(key, config, orig_module, device, block_size=block_size, **kwargs)
        self.block_size = int(block_size)

    @classmethod
    def decide_format(cls, weights, name, dtype, kwargs):
        return WeightFormat(FP8, block=int(kwargs.get("block_size", BLOCK)))

    def load(self, weights, dtype):
        name = f"{self.key}.weight"
        self.check_shape(weights, name)
        self.block_size = self.weight_format(weights, name, dtype).block
        raw = weights.raw(name)
        if raw is not None and raw.is_fp8:
            w, s = raw.data, raw.scale_inv
        else:  # not stored as FP8: quantize once here
            w, s = block_quant(weights.tensor(name, dtype=torch.float32), self.block_size)
        self.weight_fp8 = w.to(self.device)
        self.scale_inv = s.to(device=self.device, dtype=torch.float32)
        self.compute_dtype = dtype
        self.bias = (
            weights.tensor(f"{self.key}.bias", dtype=dtype, device=self.device) if self.has_bias else None
        )

    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized ``[out, in]`` weight (a new tensor each call)."""
        return block_dequant(self.weight_fp8, self.scale_inv, self.block_size, dtype or self.compute_dtype)

    @property
    def weight(self) -> torch.Tensor:
        """Dense view for code that inspects ``linear.weight`` (dtype/device); costs a dequant."""
        return self.dense_weight()

    def forward(self, x):
        w = self.dense_weight(x.dtype if x.dtype.is_floating_point else self.compute_dtype)
        b = self.bias.to(w.dtype) if self.bias is not None else None
        return F.linear(x.to(w.dtype), w, b)
