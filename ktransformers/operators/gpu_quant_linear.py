"""``KLinearGPUQ``: a linear op that keeps GGUF weights quantized on its device and dequantizes
them per call (vectorized torch, ``ktransformers.weights.dequant``), then ``F.linear``.

The device holds the stored bytes (Q4_K: 4.5 bits a weight instead of 16) plus, during one
call, one dequantized copy of this layer's weight.  It is the same torch code on CUDA and on
the CPU, which is how the tests check it against ``KLinearTorch``.  Weights with no stored
quantized form (safetensors, or tensors the GGUF reader computes, like gemma norms) are kept
dense in the model dtype.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..weights.dequant import dequantize
from .formats import FLOAT, float_format, raw_format, stored_blocks, stored_type
from .linear import LinearOp
from .registry import register


@register("KLinearGPUQ")
class KLinearGPUQ(LinearOp):
    """GGUF-quantized weight resident on the device, dequantized per call (GPU or CPU)."""

    @classmethod
    def decide_format(cls, weights, name, dtype, kwargs):
        """Stored ggml blocks stay blocks; a weight stored as plain elements (or FP8) is a dense copy."""
        stored = stored_type(weights, name)
        return raw_format(stored) if stored is not None and stored.quantized else float_format(dtype)

    def load(self, weights, dtype):
        name = f"{self.key}.weight"
        self.check_shape(weights, name)
        self.dtype = dtype
        fmt = self.weight_format(weights, name, dtype)
        if fmt.kind == FLOAT:
            self.qweight = None
            self.weight_dense = weights.tensor(name, dtype=fmt.torch_dtype, device=self.device)
        else:
            raw = stored_blocks(weights, name, fmt)
            self.qweight = torch.from_numpy(np.ascontiguousarray(raw.data)).to(self.device)
            self.ggml_type = fmt.type
            self.shape = tuple(raw.shape)
            self.weight_dense = None
        self.bias = weights.tensor(f"{self.key}.bias", dtype=dtype, device=self.device) if self.has_bias else None

    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight as the model sees it (dequantized now for quantized storage)."""
        if self.qweight is None:
            return self.weight_dense if dtype is None else self.weight_dense.to(dtype)
        return dequantize(self.qweight, self.ggml_type, self.shape, dtype=dtype or self.dtype, device=self.device)

    @property
    def weight(self) -> torch.Tensor:
        """Dense weight for code that inspects ``linear.weight`` (dequantizes: not for hot paths)."""
        return self.dense_weight()

    def forward(self, x):
        w = self.dense_weight()
        return F.linear(x.to(w.dtype), w, self.bias)
