"""Routed experts: ``KTransformersExperts`` and its ops.

Follows the transformers 5 experts contract::

    forward(hidden_states [T, H], top_k_index [T, k] int64, top_k_weights [T, k]) -> [T, H]

routing weights applied inside.  ``KExpertsTorch`` is the reference implementation (any
device); ``KExpertsCPU`` (C++ kernels) registers itself from ``cpu_experts.py``.

Ops that can run asynchronously implement ``submit`` / ``collect`` so the MoE block can
compute shared experts while the routed ones run (see ``moe.py``).

Ops compute on the stacked layout of the weight sources (``source.py``: gate / up ``[E, I, H]``,
down ``[E, H, I]``).  A module whose parameters are laid out otherwise (gpt-oss: transposed,
gate/up interleaved, per-expert biases) says so through the flags transformers'
``use_experts_implementation`` sets on it; ``ExpertsLayout`` (``weights/experts_layout.py``) reads
them and converts a checkpoint that stores the module's own parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import RuleError, WeightError
from ..weights.experts_layout import ExpertsLayout
from ..weights.source import EXPERT_PROJS
from .base import BaseInjectedModule, Op
from .expert_lora import ExpertLora, KernelLora
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



def routed_groups(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int):
    """``(expert, token rows, routing weights)`` for every expert some token was routed to, in
    expert order: the tokens of one expert are computed together (one matmul per expert)."""
    k = top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    token_of = order // k
    w_sorted = top_k_weights.reshape(-1)[order]
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, token_of[start:start + n], w_sorted[start:start + n]
        start += n


class ExpertsOp(Op):
    """Base of experts ops: knows the geometry, the parameter layout and the activation."""

    TABLE = EXPERTS_OPS

    def __init__(self, key, config, orig_module, device, **kwargs):
        super().__init__(key, config, orig_module, device, **kwargs)
        self.num_experts, self.hidden, self.intermediate = experts_geometry(orig_module, config)
        name = type(orig_module).__name__
        if not getattr(orig_module, "has_gate", True):
            raise RuleError(f"{key}: {name} has no gate projection (up -> down only); the expert ops need "
                            f"gate and up, keep the module with 'class: default'")
        if getattr(orig_module, "has_post_expert_norm", False):
            raise RuleError(f"{key}: {name} normalises each expert's output, which the expert ops do not; "
                            f"keep the module with 'class: default'")
        self.layout = ExpertsLayout.of(orig_module)
        act = getattr(orig_module, "act_fn", None)
        self.act_fn = act if act is not None else F.silu
        self.activation = _activation_name(act)
        if act is None and hasattr(orig_module, "alpha") and hasattr(orig_module, "limit"):
            # gpt-oss: (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
            self.activation = "clamp_swiglu"
        elif self.activation == "silu" and hasattr(orig_module, "limit") and not hasattr(orig_module, "alpha"):
            # DeepSeek-V4: silu(min(gate, limit)) * clamp(up, +-limit)
            self.activation = "clamp_silu"
        self.alpha = float(getattr(orig_module, "alpha", 1.702))
        self.limit = float(getattr(orig_module, "limit", 7.0))

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up, the module's own activation (torch; the reference of the kernels)."""
        if self.activation == "clamp_swiglu":
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        if self.activation == "clamp_silu":
            return self.act_fn(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
        return self.act_fn(gate) * up

    @classmethod
    def weight_names(cls, key: str) -> tuple[str, ...]:
        """The stacked projections (a checkpoint in the module's own layout is converted to them)."""
        return tuple(f"{key}.{p}" for p in EXPERT_PROJS)

    def from_parameters(self, weights) -> bool:
        """True when the checkpoint stores this module's own parameters in a non-stacked layout
        (read them and convert); False when the source serves the stacked names itself."""
        return not self.layout.stacked and weights.stores_parameter(f"{self.key}.gate_up_proj")

    def check_shapes(self, weights) -> None:
        E, H, I = self.num_experts, self.hidden, self.intermediate
        if self.from_parameters(weights):
            names = ["gate_up_proj", "down_proj"] + (["gate_up_proj_bias", "down_proj_bias"] if self.layout.bias else [])
            want = {n: tuple(getattr(self.orig_module, n).shape) for n in names}
        else:
            want = {"gate_proj": (E, I, H), "up_proj": (E, I, H), "down_proj": (E, H, I)}
            if self.layout.bias:
                want.update(gate_proj_bias=(E, I), up_proj_bias=(E, I), down_proj_bias=(E, H))
        for proj, shape in want.items():
            name = f"{self.key}.{proj}"
            got = tuple(weights.shape(name))
            if got != shape:
                layout = "" if self.layout.stacked else f" ({type(self.orig_module).__name__} layout: {self.layout.describe()})"
                raise WeightError(
                    f"{weights.path}: tensor '{name}' has shape {list(got)}, the model expects {list(shape)}{layout}"
                )

    def float_weights(self, weights, dtype) -> dict[str, torch.Tensor]:
        """gate_proj / up_proj ``[E, I, H]`` and down_proj ``[E, H, I]`` as ``dtype`` tensors on the op's
        device, whatever the checkpoint's layout."""
        if self.from_parameters(weights):
            gate, up = self.layout.gate_up(weights.tensor(f"{self.key}.gate_up_proj", dtype=dtype, device=self.device))
            down = self.layout.down(weights.tensor(f"{self.key}.down_proj", dtype=dtype, device=self.device))
            return {"gate_proj": gate, "up_proj": up, "down_proj": down}
        return {p: weights.tensor(f"{self.key}.{p}", dtype=dtype, device=self.device)
                for p in ("gate_proj", "up_proj", "down_proj")}

    def biases(self, weights, dtype) -> dict[str, torch.Tensor] | None:
        """Per-expert biases ``gate_proj`` / ``up_proj`` ``[E, I]``, ``down_proj`` ``[E, H]`` (None: the
        module has none)."""
        if not self.layout.bias:
            return None
        k, dev = self.key, self.device
        if self.from_parameters(weights):
            gate, up = self.layout.gate_up_bias(weights.tensor(f"{k}.gate_up_proj_bias", dtype=dtype, device=dev))
        else:
            gate = weights.tensor(f"{k}.gate_proj_bias", dtype=dtype, device=dev)
            up = weights.tensor(f"{k}.up_proj_bias", dtype=dtype, device=dev)
        return {"gate_proj": gate, "up_proj": up,
                "down_proj": weights.tensor(f"{k}.down_proj_bias", dtype=dtype, device=dev).contiguous()}

    def forward(self, x, top_k_index, top_k_weights):  # pragma: no cover - interface
        raise NotImplementedError

    # expert LoRA beside the base computation (an adapter applied for inference)
    #: whether ``lora_forward`` is implemented
    LORA = False

    def lora_unsupported(self) -> str | None:
        """Why this op cannot apply expert LoRA (None: it can)."""
        if not self.LORA:
            return f"the {self.name} op has no expert LoRA path"
        if not self.layout.stacked:
            return (f"expert LoRA follows the fused [E, 2I, H] parameters; {type(self.orig_module).__name__} "
                    f"stores {self.layout.describe()}")
        return None

    def lora_forward(self, x, top_k_index, top_k_weights, lora: KernelLora) -> torch.Tensor:
        """The routed experts with ``lora`` added to each targeted projection of each expert, over the
        tokens routed to it, weighted by the routing weights; synchronous."""
        raise NotImplementedError(self.lora_unsupported())

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
        dtype = self.weight_format(weights, f"{self.key}.gate_proj", dtype).torch_dtype
        if self.layout.stacked and not self.layout.bias:
            self.gate_up = weights.tensor(f"{self.key}.gate_up_proj", dtype=dtype, device=self.device)
            self.down = weights.tensor(f"{self.key}.down_proj", dtype=dtype, device=self.device)
            self.gate_up_bias = self.down_bias = None
            return
        w = self.float_weights(weights, dtype)
        self.gate_up = torch.cat((w["gate_proj"], w["up_proj"]), dim=1)
        self.down = w["down_proj"]
        b = self.biases(weights, dtype)
        self.gate_up_bias = torch.cat((b["gate_proj"], b["up_proj"]), dim=-1) if b else None
        self.down_bias = b["down_proj"] if b else None

    LORA = True

    def forward(self, x, top_k_index, top_k_weights, lora: KernelLora | None = None):
        T = top_k_index.shape[0]
        out = torch.zeros(T, self.hidden, dtype=torch.float32 if x.dtype == torch.float32 else x.dtype,
                          device=x.device)
        if lora is not None:
            lora = KernelLora(*(None if f is None else f.to(self.device, self.gate_up.dtype) for f in lora[:4]),
                              lora.scale)
        for e, sel, w in routed_groups(top_k_index, top_k_weights, self.num_experts):
            xs = x.index_select(0, sel).to(self.gate_up.dtype)
            gub = self.gate_up_bias[e] if self.gate_up_bias is not None else None
            gu = F.linear(xs, self.gate_up[e], gub)
            if lora is not None and lora.A_gu is not None:
                gu = gu + F.linear(F.linear(xs, lora.A_gu[e]), lora.B_gu[e]) * lora.scale
            gate, up = gu.chunk(2, dim=-1)
            act = self.glu(gate, up)
            h = F.linear(act, self.down[e], self.down_bias[e] if self.down_bias is not None else None)
            if lora is not None and lora.A_d is not None:
                h = h + F.linear(F.linear(act, lora.A_d[e]), lora.B_d[e]) * lora.scale
            h = h * w[:, None].to(h.dtype)
            out.index_add_(0, sel, h.to(out.dtype))
        return out.to(x.dtype)

    def lora_forward(self, x, top_k_index, top_k_weights, lora: KernelLora) -> torch.Tensor:
        return self.forward(x, top_k_index, top_k_weights, lora)


@register("KTransformersExperts")
class KTransformersExperts(ExpertLora, BaseInjectedModule):
    """Replaces a transformers 5 experts module; runs its routed experts with per-phase ops.

    kwargs: ``generate_op`` (``KExpertsCPU``, ``KExpertsTorch``), ``prefill_op``, devices,
    ``out_device``, plus op kwargs (``backend`` for ``KExpertsCPU``).
    Use ``recursive: false`` in the rule: the experts' internals are not modules to match.

    An adapter's expert LoRA (``add_lora``, PEFT's layout: ``expert_lora.py``) is applied for
    inference by the ops beside their base computation (``ExpertsOp.lora_forward``), the base
    weights untouched; the calls then run synchronously and without autograd (training takes
    ``KSFTExpertsCPU`` / ``KSFTExpertsTorch``, whose backward trains the factors).
    """

    OPS = EXPERTS_OPS
    OP_TABLE_NAME = "experts"
    DEFAULT_OP = "KExpertsTorch"
    REPLACES = (EXPERTS,)
    #: whether the expert LoRA this operator carries is trained through its backward
    TRAINS_LORA = False

    def __init__(self, key, gguf_loader=None, config=None, orig_module=None, **kwargs):
        super().__init__(key, gguf_loader, config, orig_module, **kwargs)
        object.__setattr__(self, "lora_config", None)
        object.__setattr__(self, "_lora_cache", None)

    def lora_geometry(self) -> tuple[int, int, int]:
        op = self.generate_op
        return op.num_experts, op.hidden, op.intermediate

    def check_lora_ready(self) -> None:
        for op in self.ops():
            if not op.loaded:
                raise ValueError(f"{self.key}: add_lora after the model's weights are loaded")
            why = op.lora_unsupported()
            if why:
                raise ValueError(f"{self.key}: {why}")

    def frozen_lora(self) -> KernelLora:
        """``kernel_lora()`` as contiguous fp32 copies, made again only when a factor changed (the
        ops read them on every call; inference leaves them as loaded)."""
        versions = tuple(p._version for pair in self.lora_parameters().values() for p in pair)
        cache = self._lora_cache
        if cache is None or cache[0] != versions:
            with torch.no_grad():
                k = self.kernel_lora()
                k = KernelLora(*(None if f is None else f.detach().to(torch.float32).contiguous() for f in k[:4]),
                               k.scale)
            cache = (versions, k)
            object.__setattr__(self, "_lora_cache", cache)
        return cache[1]

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.collect(self.submit(hidden_states, top_k_index, top_k_weights))

    def submit(self, hidden_states, top_k_index, top_k_weights):
        """Start the routed experts; returns a handle for ``collect`` (async where the op is; with
        expert LoRA the result itself)."""
        op = self.select_op(hidden_states.shape[0])
        out_device = self.out_device or hidden_states.device
        args = (hidden_states.to(op.device), top_k_index.to(op.device), top_k_weights.to(op.device))
        if self.lora_config is not None:
            with torch.no_grad():
                return None, op.lora_forward(*args, self.frozen_lora()), out_device, hidden_states.dtype
        return op, op.submit(*args), out_device, hidden_states.dtype

    def collect(self, token) -> torch.Tensor:
        op, handle, out_device, dtype = token
        out = handle if op is None else op.collect(handle)
        return out.to(device=out_device, dtype=dtype)
