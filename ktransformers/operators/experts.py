"""Routed experts: ``KTransformersExperts`` and its ops.

Follows the transformers 5 experts contract::

    forward(hidden_states [T, H], top_k_index [T, k] int64, top_k_weights [T, k]) -> [T, H]

routing weights applied inside.  ``KExpertsTorch`` is the reference implementation (any
device); ``KExpertsCPU`` (C++ kernels) registers itself from ``cpu_experts.py``.

Ops that can run asynchronously implement ``submit`` / ``collect`` so the MoE block can
compute shared experts while the routed ones run (see ``moe.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import WeightError
from .base import BaseInjectedModule, Op
from .kinds import EXPERTS
from .registry import register

EXPERTS_OPS: dict[str, type[Op]] = {}


def experts_geometry(orig: nn.Module, config) -> tuple[int, int, int]:
    """(num_experts, hidden, intermediate) of an experts module built from ``config``."""
    gu = getattr(orig, "gate_up_proj", None)
    if gu is not None and gu.dim() == 3:
        E, two_i, H = gu.shape
        if getattr(orig, "is_transposed", False):
            E, H, two_i = gu.shape
        return int(E), int(H), int(two_i) // 2
    raise WeightError(f"{type(orig).__name__}: cannot read the experts' shapes (no 3-D gate_up_proj)")


class ExpertsOp(Op):
    """Base of experts ops: knows the geometry and the activation."""

    TABLE = EXPERTS_OPS

    def __init__(self, key, config, orig_module, device, **kwargs):
        super().__init__(key, config, orig_module, device, **kwargs)
        self.num_experts, self.hidden, self.intermediate = experts_geometry(orig_module, config)
        act = getattr(orig_module, "act_fn", None)
        self.act_fn = act if act is not None else F.silu
        self.activation = _activation_name(act)

    def check_shapes(self, weights) -> None:
        want = {
            "gate_proj": (self.num_experts, self.intermediate, self.hidden),
            "up_proj": (self.num_experts, self.intermediate, self.hidden),
            "down_proj": (self.num_experts, self.hidden, self.intermediate),
        }
        for proj, shape in want.items():
            name = f"{self.key}.{proj}"
            got = tuple(weights.shape(name))
            if got != shape:
                raise WeightError(
                    f"{weights.path}: tensor '{name}' has shape {list(got)}, the model expects {list(shape)}"
                )

    def forward(self, x, top_k_index, top_k_weights):  # pragma: no cover - interface
        raise NotImplementedError

    # async interface; synchronous ops compute in submit
    def submit(self, x, top_k_index, top_k_weights):
        return self.forward(x, top_k_index, top_k_weights)

    def collect(self, handle):
        return handle


def _activation_name(act) -> str:
    n = type(act).__name__.lower() if act is not None else "silu"
    if "silu" in n or "swish" in n:
        return "silu"
    if "gelu" in n:
        return "gelu_tanh" if "tanh" in n or "pytorch" in n else "gelu"
    return n


@register("KExpertsTorch")
class KExpertsTorch(ExpertsOp):
    """Reference experts in torch: tokens grouped by expert, one GEMM per expert hit."""

    def load(self, weights, dtype):
        self.check_shapes(weights)
        self.gate_up = weights.tensor(f"{self.key}.gate_up_proj", dtype=dtype, device=self.device)
        self.down = weights.tensor(f"{self.key}.down_proj", dtype=dtype, device=self.device)

    def forward(self, x, top_k_index, top_k_weights):
        T, k = top_k_index.shape
        out = torch.zeros(T, self.hidden, dtype=torch.float32 if x.dtype == torch.float32 else x.dtype,
                          device=x.device)
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        token_of = order // k
        w_sorted = top_k_weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = token_of[start:start + n]
            xs = x.index_select(0, sel).to(self.gate_up.dtype)
            gate, up = F.linear(xs, self.gate_up[e]).chunk(2, dim=-1)
            h = F.linear(self.act_fn(gate) * up, self.down[e])
            h = h * w_sorted[start:start + n, None].to(h.dtype)
            out.index_add_(0, sel, h.to(out.dtype))
            start += n
        return out.to(x.dtype)


@register("KTransformersExperts")
class KTransformersExperts(BaseInjectedModule):
    """Replaces a transformers 5 experts module; runs its routed experts with per-phase ops.

    kwargs: ``generate_op`` (``KExpertsCPU``, ``KExpertsTorch``), ``prefill_op``, devices,
    ``out_device``, plus op kwargs (``backend`` for ``KExpertsCPU``).
    Use ``recursive: false`` in the rule: the experts' internals are not modules to match.
    """

    OPS = EXPERTS_OPS
    OP_TABLE_NAME = "experts"
    DEFAULT_OP = "KExpertsTorch"
    REPLACES = (EXPERTS,)

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.collect(self.submit(hidden_states, top_k_index, top_k_weights))

    def submit(self, hidden_states, top_k_index, top_k_weights):
        """Start the routed experts; returns a handle for ``collect`` (async where the op is)."""
        op = self.select_op(hidden_states.shape[0])
        out_device = self.out_device or hidden_states.device
        handle = op.submit(
            hidden_states.to(op.device), top_k_index.to(op.device), top_k_weights.to(op.device)
        )
        return op, handle, out_device, hidden_states.dtype

    def collect(self, token) -> torch.Tensor:
        op, handle, out_device, dtype = token
        return op.collect(handle).to(device=out_device, dtype=dtype)
