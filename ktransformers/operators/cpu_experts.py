"""``KExpertsCPU``: routed experts on the C++ CPU kernels (``ktransformers.kernels``).

Backends (the ``backend`` rule kwarg): ``llamafile`` computes on the weights in their stored
GGUF type, read in place from the memory-mapped file (no copy); ``AMXInt8`` requantizes at load
to int8 with per-row scales, ``AMXBF16`` repacks to bf16 — both in a tile layout that the AMX
kernel uses where the CPU has AMX and the AVX-512 (VNNI / BF16) kernels use elsewhere;
``AMXInt4`` / ``AMXInt4_1`` requantize to int4 per 32-k group (fp16 scale; ``_1`` also an fp16
min), two weights per byte, run by the VNNI-512 / AVX-VNNI / AVX2 kernels.

Expert LoRA (an adapter applied for inference, ``lora_forward``) runs on ``kernels.MoETrainKernel``
over this op's kernel: the same weights (in place or the packed copy, never expanded), each
expert's LoRA on the rows routed to it added inside the kernel before the activation (gate/up)
and before the routing weight (down) — the int4 backends have no such kernel.

Each weight is read in the format the plan decided (``formats.kernel_format``: the stored blocks,
or a float copy where the kernels do not take the stored type).  The op runs asynchronously: ``submit``
returns at once so the MoE block computes shared experts meanwhile; ``collect`` waits.
"""

from __future__ import annotations

import torch

from .. import kernels as K
from ..kernels.moe import BACKENDS, IN_PLACE_BACKEND, LORA_BACKENDS
from ..weights.source import EXPERT_PROJS
from .base import KwargSpec
from .cpu_threads import kernel_pool
from .experts import ExpertsOp
from .formats import PACKED, RAW, kernel_backend, kernel_format, read_for_kernel, stored_type
from .registry import register


@register("KExpertsCPU")
class KExpertsCPU(ExpertsOp):
    device_kinds = ("cpu",)
    extra_kwargs = {
        "backend": KwargSpec((str,), IN_PLACE_BACKEND, " | ".join(BACKENDS)),
    }

    @classmethod
    def validate_kwargs(cls, kwargs: dict):
        b = kwargs.get("backend", IN_PLACE_BACKEND)
        if b not in BACKENDS:
            import difflib

            near = difflib.get_close_matches(str(b), BACKENDS, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            return "backend", f"'{b}' is not a KExpertsCPU backend ({', '.join(BACKENDS)}){hint}"
        return None

    @classmethod
    def decide_format(cls, weights, name, dtype, kwargs):
        return kernel_format(stored_type(weights, name), dtype, kwargs.get("backend", IN_PLACE_BACKEND))

    def __init__(self, key, config, orig_module, device, backend: str = IN_PLACE_BACKEND, **kwargs):
        super().__init__(key, config, orig_module, device, backend=backend, **kwargs)
        self.backend = backend
        self.kernel = None
        self.lora_kernel = None  # MoETrainKernel over self.kernel, made by the first lora_forward

    def load(self, weights, dtype):
        self.check_shapes(weights)
        fmts = {p: self.weight_format(weights, f"{self.key}.{p}", dtype) for p in EXPERT_PROJS}
        if self.from_parameters(weights):  # the module's own layout (gpt-oss safetensors): converted floats
            floats = self.float_weights(weights, fmts["gate_proj"].read.torch_dtype)
            arrays = {p: t.contiguous() for p, t in floats.items()}
        else:
            arrays = {p: read_for_kernel(weights, f"{self.key}.{p}", fmt) for p, fmt in fmts.items()}
        types = {p: fmt.read.type for p, fmt in fmts.items()}
        # the plan's: the rule's backend, decided once (llamafile_panels may pack some projections only)
        packed_fmts = [f for f in fmts.values() if f.kind == PACKED]
        backend = kernel_backend(packed_fmts[0] if packed_fmts else fmts["gate_proj"])
        packed = bool(packed_fmts)
        b = self.biases(weights, torch.float32) or {}
        self._biases = b  # the kernel reads them in place
        self.pool = kernel_pool()
        args = (self.pool, backend, self.num_experts, self.hidden, self.intermediate,
                arrays["gate_proj"], arrays["up_proj"], arrays["down_proj"],
                types["gate_proj"], types["up_proj"], types["down_proj"])
        kw = dict(activation=self._kernel_activation(), alpha=self.alpha, limit=self.limit,
                  gate_bias=b.get("gate_proj"), up_bias=b.get("up_proj"), down_bias=b.get("down_proj"))
        try:
            if not packed:
                self.kernel, self.packed_from = K.MoEKernel(*args, **kw), None
            else:  # repacked once, then mapped from the packed-weight cache (kernels/packed_cache.py)
                from ..kernels.packed_cache import packed_moe

                self.kernel, self.packed_from = packed_moe(args[0], args[1], self.key, getattr(weights, "path", None),
                                                           *args[2:], **kw)
        except (ValueError, TypeError) as e:
            from ..errors import WeightError

            raise WeightError(f"{weights.path}: {self.key}: the {backend} CPU kernel cannot take these "
                              f"weights: {e}") from None
        # the llamafile kernel reads them in place; the packed backends keep their own copy (then
        # dropping these frees a float copy of every expert: the peak RSS of a bf16 checkpoint's load);
        # llamafile_panels reads its other projections in place (the kernel keeps them referenced)
        self._arrays = arrays if not packed else {}
        self.out_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16

    @classmethod
    def memory_plan(cls, key: str, kwargs: dict, weights, formats: dict) -> tuple[int, str] | None:
        """(bytes, how held) of this layer's experts, for the memory plan, before anything loads, from
        the plan's ``formats``: ``in_place`` (raw blocks read from the mapped file), ``packed`` (a packed
        copy this load makes) or ``packed_cached`` (one the packed-weight cache holds already).
        None where the kernels read float copies (counted as copies)."""
        fmts = [formats.get(f"{key}.{p}") for p in EXPERT_PROJS]
        if weights is None or any(f is None or f.read.kind != RAW for f in fmts):
            return None
        shapes = [tuple(weights.shape(f"{key}.{p}")) for p in EXPERT_PROJS]
        if any(len(s) != 3 for s in shapes):
            return None
        packed = [f for f in fmts if f.kind == PACKED]
        if not packed:
            return sum(f.type.nbytes(s) for f, s in zip(fmts, shapes)), "in_place"
        from ..kernels.moe import packed_weight_bytes
        from ..kernels.packed_cache import cached, layer_ident

        backend = packed[0].backend
        # (llamafile_panels: the projections it reads in place count 0 here, as the file's pages)
        total = sum(packed_weight_bytes(backend, f.read.type, *s) for f, s in zip(fmts, shapes))
        E, I, H = shapes[0]
        ident = layer_ident(key, backend, getattr(weights, "path", None), E, H, I, [f.read.type for f in fmts])
        return total, ("packed_cached" if cached(ident) else "packed")

    def _kernel_activation(self) -> str:
        if self.activation in K.ACTIVATIONS:
            return self.activation
        from ..errors import RuleError

        raise RuleError(f"{self.key}: KExpertsCPU has no kernel for activation '{self.activation}' "
                        f"(has {', '.join(K.ACTIVATIONS)}); use KExpertsTorch")

    def nbytes(self) -> int:
        return int(self.kernel.packed_bytes) if self.kernel is not None else 0

    def unload(self):
        self.kernel = None
        self.lora_kernel = None
        self._arrays = None
        self._biases = None
        self.loaded = False

    def _prep(self, x, top_k_index, top_k_weights):
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        return (x.contiguous(), top_k_index.to(torch.int64).contiguous(),
                top_k_weights.to(torch.float32).contiguous())

    def submit(self, x, top_k_index, top_k_weights):
        x, ids, w = self._prep(x, top_k_index, top_k_weights)
        out = torch.empty(x.shape[0], self.hidden, dtype=x.dtype)
        self.kernel.submit(x, ids, w, out)
        return out, (x, ids, w)  # inputs kept alive until collected

    def collect(self, handle):
        self.pool.sync()
        return handle[0]

    def forward(self, x, top_k_index, top_k_weights):
        return self.collect(self.submit(x, top_k_index, top_k_weights))

    LORA = True

    def lora_unsupported(self) -> str | None:
        why = super().lora_unsupported()
        if why is None and self.backend not in LORA_BACKENDS:
            why = (f"expert LoRA runs beside the {' / '.join(LORA_BACKENDS)} kernels, not backend "
                   f"{self.backend}; name one of them in the rule, or merge the adapter "
                   f"(python -m ktransformers.sft export CONFIG.yaml)")
        return why

    def lora_forward(self, x, top_k_index, top_k_weights, lora):
        if self.lora_kernel is None:
            self.lora_kernel = K.MoETrainKernel(self.kernel)
        gu = K.LoraFactors(lora.A_gu, lora.B_gu, lora.scale) if lora.A_gu is not None else None
        dn = K.LoraFactors(lora.A_d, lora.B_d, lora.scale) if lora.A_d is not None else None
        xs, ids, w = self._prep(x, top_k_index, top_k_weights)
        out, _ = self.lora_kernel.forward(xs, ids, w, gu, dn, save=False)
        return out.to(x.dtype)
