"""``KLinearCPU``: dense linear on the C++ CPU kernels, weights kept in their GGUF type (read in
place) or as F32/BF16 when stored in a type the kernels do not take (``formats.kernel_format``)."""

from __future__ import annotations

import torch

from .. import kernels as K
from .cpu_threads import kernel_pool
from .formats import kernel_format, read_for_kernel, stored_type
from .linear import LinearOp
from .registry import register


@register("KLinearCPU")
class KLinearCPU(LinearOp):
    device_kinds = ("cpu",)

    @classmethod
    def decide_format(cls, weights, name, dtype, kwargs):
        return kernel_format(stored_type(weights, name), dtype)

    def load(self, weights, dtype):
        name = f"{self.key}.weight"
        self.check_shape(weights, name)
        fmt = self.weight_format(weights, name, dtype)
        w = read_for_kernel(weights, name, fmt)
        self.pool = kernel_pool()
        try:
            self.kernel = K.LinearKernel(self.pool, "llamafile", self.in_features, self.out_features, w, fmt.type)
        except (ValueError, TypeError) as e:
            from ..errors import WeightError

            raise WeightError(f"{weights.path}: {self.key}: the CPU linear kernel cannot take this weight: {e}") \
                from None
        self._weight_array = w
        self.bias = weights.tensor(f"{self.key}.bias", dtype=torch.float32) if self.has_bias else None

    def nbytes(self) -> int:
        w = getattr(self, "_weight_array", None)
        return int(w.nbytes) if w is not None else 0

    def unload(self):
        self.kernel = None
        self._weight_array = None
        self.loaded = False

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        x2 = x2.contiguous()
        y = torch.empty((x2.shape[0], self.out_features), dtype=x2.dtype)  # not forward()'s checked allocation
        self.kernel.forward(x2, y)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

