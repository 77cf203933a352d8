"""Training path of the routed experts on the CPU kernels (``MoETrainKernel``): forward with
per-expert LoRA and its backward, on the frozen weights of an existing ``MoEKernel``.

The base weights are shared with the ``MoEKernel`` (in place for llamafile, its packed copy
for AMXInt8 / AMXBF16); the backward's products with the transposed weights dequantize one
block-aligned slice at a time into a per-thread buffer.  Everything is float32 torch CPU
tensors; LoRA tensors use the kernel layout::

    A_gu [E, r, H]   B_gu [E, 2I, r]   (fused gate_up: rows [0, I) gate, [I, 2I) up)
    A_d  [E, r, I]   B_d  [E, H, r]

``forward(x, ids, w, lora, save=True) -> (out [T, H], saved)``: ``saved`` is the
pre-activations ``[T*k, 2I]`` float32 (``save=False``: None, and the backward recomputes them:
saved-activation memory then is nothing beyond the inputs).
``saved_bytes(T, k, save=True)``: what ``forward`` keeps for the backward beyond its inputs.
``scratch_bytes()``: the transient per-call buffers, one set shared by every layer (the
largest call so far), not kept per layer.
``backward(x, ids, w, lora, saved, dout) -> (dx, dw, dA_gu, dB_gu, dA_d, dB_d)`` (LoRA grads
None where that projection has no LoRA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import cpuinfer_ext as _ext
from .moe import MoEKernel


@dataclass(frozen=True)
class LoraFactors:
    """One projection's LoRA in the kernel layout: A [E, r, in], B [E, out, r], scale alpha/r."""

    A: torch.Tensor
    B: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return int(self.A.shape[1])


def _f32(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
        raise TypeError(f"{name}: expected a CPU torch tensor, got {type(t).__name__}"
                        + (f" on {t.device}" if isinstance(t, torch.Tensor) else ""))
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")
    return t.detach().to(torch.float32).contiguous()


class MoETrainKernel:
    """Forward/backward of one MoE layer with expert LoRA; see the module docstring."""

    def __init__(self, moe: MoEKernel):
        if not isinstance(moe, MoEKernel):
            raise TypeError(f"moe: expected ktransformers.kernels.MoEKernel, got {type(moe).__name__}")
        self.moe = moe
        self.pool = moe.pool
        self.num_experts, self.hidden, self.intermediate = moe.num_experts, moe.hidden, moe.intermediate
        self._t = _ext.MoETrain(moe._m)

    def saved_bytes(self, T: int, k: int, save: bool = True) -> int:
        """Bytes ``forward`` returns for the backward (the float32 gate/up pre-activations)."""
        return 4 * T * k * 2 * self.intermediate if save else 0

    @staticmethod
    def scratch_bytes() -> int:
        """Bytes of the per-call scratch shared by all layers (grown to the largest call)."""
        return _ext.MoETrain.scratch_bytes()

    def _lora(self, gu: LoraFactors | None, d: LoraFactors | None):
        E, H, I = self.num_experts, self.hidden, self.intermediate
        keep = []
        args = []
        for f, n_in, n_out, name in ((gu, H, 2 * I, "gate_up"), (d, I, H, "down")):
            if f is None:
                args += [0, 0, 0, 0.0]
                continue
            r = f.rank
            A = _f32(f.A, f"{name} lora A", (E, r, n_in))
            B = _f32(f.B, f"{name} lora B", (E, n_out, r))
            keep += [A, B]
            args += [A.data_ptr(), B.data_ptr(), r, float(f.scale)]
        return tuple(args), keep

    def _inputs(self, x, ids, w):
        H = self.hidden
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            raise ValueError(f"x: expected a [T, {H}] tensor, got {getattr(x, 'shape', type(x).__name__)}")
        x = _f32(x, "x", (x.shape[0], H))
        T = x.shape[0]
        if ids.dim() != 2 or ids.shape[0] != T:
            raise ValueError(f"ids: expected shape [T={T}, k], got {list(ids.shape)}")
        ids = ids.to(torch.int64).contiguous()
        w = _f32(w, "weights", tuple(ids.shape))
        return x, ids, w

    def forward(self, x, ids, w, gate_up: LoraFactors | None = None, down: LoraFactors | None = None,
                save: bool = True):
        x, ids, w = self._inputs(x, ids, w)
        T, k = ids.shape
        lora, keep = self._lora(gate_up, down)
        out = torch.empty(T, self.hidden, dtype=torch.float32)
        saved = torch.empty(T * k, 2 * self.intermediate, dtype=torch.float32) if save else None
        self._t.forward(self.pool._c, T, k, x.data_ptr(), ids.data_ptr(), w.data_ptr(), lora, out.data_ptr(),
                        saved.data_ptr() if saved is not None else 0)
        del keep
        return out, saved

    def backward(self, x, ids, w, dout, saved=None, gate_up: LoraFactors | None = None,
                 down: LoraFactors | None = None):
        x, ids, w = self._inputs(x, ids, w)
        T, k = ids.shape
        E, H, I = self.num_experts, self.hidden, self.intermediate
        dout = _f32(dout, "grad_output", (T, H))
        if saved is not None:
            saved = _f32(saved, "saved pre-activations", (T * k, 2 * I))
        lora, keep = self._lora(gate_up, down)
        dx = torch.empty(T, H, dtype=torch.float32)
        dw = torch.empty(T, k, dtype=torch.float32)
        g_gu = (torch.empty(E, gate_up.rank, H), torch.empty(E, 2 * I, gate_up.rank)) if gate_up else (None, None)
        g_d = (torch.empty(E, down.rank, I), torch.empty(E, H, down.rank)) if down else (None, None)
        grads = tuple(g.data_ptr() if g is not None else 0 for g in (*g_gu, *g_d))
        self._t.backward(self.pool._c, T, k, x.data_ptr(), ids.data_ptr(), w.data_ptr(), lora,
                         saved.data_ptr() if saved is not None else 0, dout.data_ptr(), dx.data_ptr(),
                         dw.data_ptr(), grads)
        del keep
        return dx, dw, g_gu[0], g_gu[1], g_d[0], g_d[1]
