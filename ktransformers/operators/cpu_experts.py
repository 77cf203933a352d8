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

Weights that are not stored quantized (safetensors, F32/BF16 GGUF) are handed over as float
tensors (F32 for an fp32 model, BF16 otherwise).  The op runs asynchronously: ``submit``
returns at once so the MoE block computes shared experts meanwhile; ``collect`` waits.
"""

from __future__ import annotations

import torch

from .base import KwargSpec
from .cpu_threads import kernel_pool
from .experts import ExpertsOp
from .registry import register

BACKEND_NAMES = ("llamafile", "AMXInt8", "AMXBF16", "AMXInt4", "AMXInt4_1")
#: backends whose weights the LoRA forward / backward kernels (``kernels.MoETrainKernel``) read
LORA_BACKENDS = ("llamafile", "AMXInt8", "AMXBF16")


def _kernels():
    from .. import kernels

    return kernels


def weight_for_kernel(weights, name: str, dtype: torch.dtype):
    """(array, ggml type) of one weight for the CPU kernels: the stored bytes when the source
    stores a type the kernels compute on, else a float tensor (F32 for an fp32 model, else BF16)."""
    raw = weights.raw(name)
    if raw is not None and raw.type is not None and raw.type.kernel:
        return raw.data, raw.type
    float_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    t = weights.tensor(name, dtype=float_dtype)
    return t.contiguous(), ("F32" if float_dtype == torch.float32 else "BF16")


@register("KExpertsCPU")
class KExpertsCPU(ExpertsOp):
    device_kinds = ("cpu",)
    keeps_raw_weights = True
    extra_kwargs = {
        "backend": KwargSpec((str,), "llamafile", " | ".join(BACKEND_NAMES)),
    }

    @classmethod
    def validate_kwargs(cls, kwargs: dict):
        b = kwargs.get("backend", "llamafile")
        if b not in BACKEND_NAMES:
            import difflib

            near = difflib.get_close_matches(str(b), BACKEND_NAMES, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            return "backend", f"'{b}' is not a KExpertsCPU backend ({', '.join(BACKEND_NAMES)}){hint}"
        return None

    def __init__(self, key, config, orig_module, device, backend: str = "llamafile", **kwargs):
        super().__init__(key, config, orig_module, device, **kwargs)
        self.backend = backend
        self.kernel = None
        self.lora_kernel = None  # MoETrainKernel over self.kernel, made by the first lora_forward

    def load(self, weights, dtype):
        K = _kernels()
        self.check_shapes(weights)
        arrays = {}
        types = {}
        if self.from_parameters(weights):  # the module's own layout (gpt-oss safetensors): converted floats
            float_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
            arrays = self.float_weights(weights, float_dtype)
            types = dict.fromkeys(arrays, "F32" if float_dtype == torch.float32 else "BF16")
        else:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                arrays[proj], types[proj] = weight_for_kernel(weights, f"{self.key}.{proj}", dtype)
        b = self.biases(weights, torch.float32) or {}
        self._biases = b  # the kernel reads them in place
        self.pool = kernel_pool()
        args = (self.pool, self.backend, self.num_experts, self.hidden, self.intermediate,
                arrays["gate_proj"], arrays["up_proj"], arrays["down_proj"],
                types["gate_proj"], types["up_proj"], types["down_proj"])
        kw = dict(activation=self._kernel_activation(), alpha=self.alpha, limit=self.limit,
                  gate_bias=b.get("gate_proj"), up_bias=b.get("up_proj"), down_bias=b.get("down_proj"))
        try:
            if self.backend == "llamafile":
                self.kernel, self.packed_from = K.MoEKernel(*args, **kw), None
            else:  # repacked once, then mapped from the packed-weight cache (kernels/packed_cache.py)
                from ..kernels.packed_cache import packed_moe

                self.kernel, self.packed_from = packed_moe(args[0], args[1], self.key, getattr(weights, "path", None),
                                                           *args[2:], **kw)
        except (ValueError, TypeError) as e:
            from ..errors import WeightError

            raise WeightError(f"{weights.path}: {self.key}: the {self.backend} CPU kernel cannot take these "
                              f"weights: {e}") from None
        # the llamafile kernel reads them in place; the packed backends keep their own copy (then
        # dropping these frees a float copy of every expert: the peak RSS of a bf16 checkpoint's load)
        self._arrays = arrays if self.backend == "llamafile" else {}
        self.out_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16

    @classmethod
    def memory_plan(cls, key: str, kwargs: dict, weights) -> tuple[int, str] | None:
        """(bytes, how held) of this layer's experts, for the memory plan, before anything loads:
        ``in_place`` (llamafile: the stored blocks read from the mapped file), ``packed`` (a packed
        copy this load makes) or ``packed_cached`` (one the packed-weight cache holds already).
        None where the weights are not stored in a type the kernels take (a float copy is made)."""
        if weights is None:
            return None
        raws = [weights.raw(f"{key}.{proj}") for proj in ("gate_proj", "up_proj", "down_proj")]
        if any(r is None or r.type is None or not r.type.kernel or len(r.shape) != 3 for r in raws):
            return None
        backend = kwargs.get("backend", "llamafile")
        if backend == "llamafile":
            return sum(int(r.nbytes) for r in raws), "in_place"
        from ..kernels.moe import packed_weight_bytes
        from ..kernels.packed_cache import cached, layer_ident

        total = sum(packed_weight_bytes(backend, r.type, *r.shape) for r in raws)
        E, I, H = raws[0].shape
        ident = layer_ident(key, backend, getattr(weights, "path", None), E, H, I, [r.type for r in raws])
        return total, ("packed_cached" if cached(ident) else "packed")

    def _kernel_activation(self) -> str:
        K = _kernels()
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
        K = _kernels()
        if self.lora_kernel is None:
            self.lora_kernel = K.MoETrainKernel(self.kernel)
        gu = K.LoraFactors(lora.A_gu, lora.B_gu, lora.scale) if lora.A_gu is not None else None
        dn = K.LoraFactors(lora.A_d, lora.B_d, lora.scale) if lora.A_d is not None else None
        xs, ids, w = self._prep(x, top_k_index, top_k_weights)
        out, _ = self.lora_kernel.forward(xs, ids, w, gu, dn, save=False)
        return out.to(x.dtype)
