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


class LinearGroupKernel:
    """Several ``LinearKernel`` s that read the same input (q/k/v, gate/up) in one call: the
    input is quantised once per activation format and all row blocks share one pool wake-up.

    ``forward(x[T, in], out)`` writes ``out[T, sum(out_i)]`` = the members' outputs side by side,
    or with ``glu`` ("silu" / "gelu_tanh", exactly two equal members: gate then up)
    ``out[T, out_0]`` = act(gate) * up.  fp32 in and out (the decode path's buffers)."""

    def __init__(self, members: list[LinearKernel], glu: str | None = None):
        from .moe import ACTIVATIONS

        if not members or not all(isinstance(m, LinearKernel) for m in members):
            raise TypeError("members: expected a non-empty list of LinearKernel")
        pools = {id(m.pool) for m in members}
        if len(pools) != 1:
            raise ValueError("members: the linears of a group must share one CPUInfer pool")
        if glu is not None and glu not in ACTIVATIONS:
            raise ValueError(f"glu: expected one of {', '.join(ACTIVATIONS)} or None, got {glu!r}")
        self.pool = members[0].pool
        self.members = list(members)  # keeps the weights alive
        try:
            self._g = _ext.LinearGroup([m._l for m in members], -1 if glu is None else ACTIVATIONS[glu])
        except ValueError as e:
            raise ValueError(f"linear group: {e}") from None
        self.in_features = self._g.in_features
        self.out_features = self._g.out_features

    def forward(self, x: Any, out: Any) -> Any:
        import torch

        f32 = torch.float32
        if (x.dtype is not f32 or out.dtype is not f32 or not x.is_contiguous() or not out.is_contiguous()
                or x.device.type != "cpu" or out.device.type != "cpu"):
            raise ValueError("LinearGroupKernel.forward: x and out must be contiguous float32 CPU tensors")
        T = x.numel() // self.in_features
        if x.numel() != T * self.in_features or out.numel() != T * self.out_features or T < 1:
            raise ValueError(f"LinearGroupKernel.forward: x has {x.numel()} elements, out {out.numel()}; expected "
                             f"T x {self.in_features} and T x {self.out_features}")
        self._g.forward(self.pool._c, T, x.data_ptr(), out.data_ptr())
        return out
