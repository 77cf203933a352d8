"""Dense linear layers on the CPU kernels (``LinearKernel``)."""

from __future__ import annotations

from typing import Any

from .. import cpuinfer_ext as _ext
from .args import _empty_like, _weight, ggml_type, linear_call_args, positive_ints, rows_of
from .moe import _backend
from .pool import CPUInfer


class LinearKernel:
    """y = x @ W^T on the CPU; see the module docstring."""

    def __init__(self, pool: CPUInfer, backend: str, in_features: int, out_features: int, weight: Any,
                 weight_type: Any):
        if not isinstance(pool, CPUInfer):
            raise TypeError(f"pool: expected ktransformers.kernels.CPUInfer, got {type(pool).__name__}")
        positive_ints(in_features=in_features, out_features=out_features)
        self.pool, self.backend = pool, backend
        self.in_features, self.out_features = int(in_features), int(out_features)
        t = ggml_type(weight_type, "weight_type")
        self.type = t.name
        p = _weight(weight, t, (self.out_features, self.in_features), "weight")
        self._weight = weight
        self._l = _ext.Linear(pool._c, self.in_features, self.out_features, _backend(backend), p, t.id)

    def submit(self, x: Any, out: Any) -> None:
        args = linear_call_args(x, out, self.in_features, self.out_features)
        self.pool._keep.append((x, out))
        self._l.submit(self.pool._c, *args)

    def forward(self, x: Any, out: Any = None, out_dtype: str | None = None) -> Any:
        if out is None:
            out = _empty_like(x, (rows_of(x), self.out_features), out_dtype)
        self._l.forward(self.pool._c, *linear_call_args(x, out, self.in_features, self.out_features))
        return out
