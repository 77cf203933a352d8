"""The one decode step: N rows, one new token each, over a transformers cache or the page pool.

A decode token through the generic path costs as much Python/dispatch as kernel time on a small
model: ~40 torch ops and ~7 module hops per layer, HF's mask building per step, a kernel call
(one pool wake-up and one activation quantisation) per matrix.  ``DecodeStep`` does the same
arithmetic with the layers' weights bound once, for every caller that decodes:

* ``step(token, pos, cache)``: one sequence over transformers' ``StaticCache`` / ``DynamicCache``
  (the ``Generator`` of local_chat and the single-request server; ``generate()`` on an injected
  model, generation/hf_generate.py);
* ``step_pages(tokens, positions, tables, pool)``: N sequences over the page pool of continuous
  batching (generation/paged.py's ``BatchRunner``).

Both run the same layer loop (``_rows``) on the same buffers; only where a row's keys live
differs, and the attention reads both layouts through one C++ kernel
(``decode_ops.attend_rows``: q/k norm, RoPE, the new key/value written, then the query over the
row's keys in chunks of 256 at absolute positions, merged in order, each row with the prompt flash
kernel's arithmetic).  So a request's logits are the same bits whichever route decodes it and
whatever rows run beside it, and a decoded token leaves the K/V it would leave read in a prompt:

* q/k/v in one kernel call and gate/up+activation in one (``kernels.LinearGroupKernel``: the
  input is quantised once per row, all row blocks share one pool wake-up), into buffers
  allocated once;
* the rest in a few fp32 C++ helpers (``cpuinfer_ext.decode_ops``, csrc/decode_ops.cpp): RMSNorm
  with the effective weight made once (Gemma's ``1 + w``), the residual add fused with the next
  sublayer's norm, cos/sin from the model's own rotary module per row.  A transformers cache's
  own bookkeeping is kept exactly (sliding-window layers included); the query attends to the
  entries the causal / sliding mask leaves visible, no mask built.

It serves Gemma-3 (text) and the Llama / Mistral / Qwen2 / Qwen3 family, and Qwen3-MoE / Qwen2-MoE
layers: their MoE block runs as ``_MoE`` (the router's linear on the kernels, softmax / top-k /
renormalisation in C++, the routed experts' ``MoEKernel`` straight into the step's buffer, the
shared expert and its sigmoid gate as grouped kernel calls) where its router is the plain
softmax-top-k one and its experts are on the CPU kernels; otherwise the block is called as a
module on the step's rows.

DeepSeek-V2 / V3 (and the ``deepseek_v3`` configs of Kimi-K2 / Moonlight) are served on every
route: the attention is ``_MLA`` (query and ``kv_a`` in one kernel call, the norms in C++, RoPE by
``operators/mla.py``, the latent written through the cache layer's own ``update`` in the layout the
model's attention keeps -- or into the page pool's latent / rope-key slots -- and read back per
row, the absorbed attention per row in torch, ``o_proj`` on the kernels), the MoE block ``_MoE``
with the DeepSeek routers (gate.py's functions, per row), the routed experts' ``MoEKernel`` and
the shared experts added; the dense first layers as any MLP.

GLM-4-MoE (GLM-4.5 / 4.6 / 4.7) is served on every route: its GQA attention as the Llama family's
with the q/k/v biases added after the kernel call and, where ``partial_rotary_factor`` leaves part
of each head unrotated, the q/k norm and the RoPE of the rotated part done before the attention
kernel (``_Layer.rope_rows``: the kernel's own norm per row, transformers' rotate-half arithmetic
in torch), the kernel then given identity tables; its sigmoid group-limited router is DeepSeek-V3's
(gate.py's functions, per row), with the shared experts and dense first layers as DeepSeek's.
``DecodeStep.build`` returns ``None`` for anything else (linear attention, a rotary width that
does not split a head in rotate-half pairs: the generic forward), and ``accepts`` /
``accepts_rows`` are checked on every call.
"""

from __future__ import annotations

import logging
import math
import os
import threading

import torch

from ..operators.moe import SOFTMAX_TOPK_ROUTERS
from .devices import module_device

log = logging.getLogger("ktransformers.decode")

#: config.model_type -> (Gemma-style norms and sandwich layers?)
FAMILIES = {"gemma3_text": True, "llama": False, "mistral": False, "qwen2": False, "qwen3": False,
            "qwen3_moe": False, "qwen2_moe": False, "deepseek_v2": False, "deepseek_v3": False, "glm4_moe": False}
#: config activation name -> the kernels' gated activation
GLU = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def _layer_kinds():
    from transformers.cache_utils import (DynamicLayer, DynamicSlidingWindowLayer, StaticLayer,
                                          StaticSlidingWindowLayer)

    return (StaticLayer, StaticSlidingWindowLayer), (DynamicLayer, DynamicSlidingWindowLayer)


class Unsupported(Exception):
    """The model has a part the lean step does not reproduce; the generic forward serves it."""


def _norm_weight(norm, gemma: bool) -> tuple[torch.Tensor, float]:
    w = getattr(norm, "weight", None)
    eps = getattr(norm, "eps", getattr(norm, "variance_epsilon", None))
    if w is None or eps is None or w.is_meta:
        raise Unsupported(f"norm {type(norm).__name__} has no loaded weight / eps")
    w = w.detach().float()
    w = ((1.0 + w) if gemma else w).contiguous()
    return w, float(eps), w.data_ptr()


def _one_row_op(module, cls):
    """The op of class ``cls`` (with a kernel) that serves ``module`` at T=1 with its output on the
    CPU, or None."""
    if not hasattr(module, "generate_op") or getattr(module, "out_device", None) not in (None, "cpu"):
        return None
    pre = module.prefill_op
    op = pre if pre is not None and 1 > module.prefill_threshold else module.generate_op
    if not isinstance(op, cls) or getattr(op, "kernel", None) is None:
        return None
    return op


def _cpu_kernel(linear):
    """The ``KLinearCPU`` op that serves ``linear`` at T=1 with its output on the CPU, or None."""
    from ..operators.cpu_linear import KLinearCPU

    return _one_row_op(linear, KLinearCPU)


def _embedding_rows(embed, hidden: int):
    """(rows [V, row bytes] of the table read in place, ggml type id, scale or None) when the
    embedding is ``KEmbeddingQuant`` on a type the kernels dequantize: the step dequantizes its one
    row with the C++ ``dequantize`` (the torch block dequantizer costs ~0.25 ms a token on
    Q4_K).  None otherwise: the module is called."""
    from ..operators.embedding import KEmbeddingQuant, KTransformersEmbedding

    op = getattr(embed, "generate_op", None)
    if type(embed) is not KTransformersEmbedding or not isinstance(op, KEmbeddingQuant):
        return None
    t, rows = getattr(op, "ggml_type", None), getattr(op, "_rows", None)
    if rows is None or t is None or not t.kernel or op.embedding_dim != hidden or torch.device(op.device).type != "cpu":
        return None
    scale = getattr(embed.orig_module, "embed_scale", None)
    if scale is not None:
        scale = (torch.tensor(float(hidden) ** 0.5) if scale.is_meta else scale.detach()).to(torch.float32)
    return rows, int(t.id), scale


class _Proj:
    """One or more linears sharing an input, as one call into a preallocated output.

    ``linears``: modules served by ``KLinearCPU``; ``kernels``: ``LinearKernel`` s appended after
    them (weights the step binds itself, e.g. a router's)."""

    def __init__(self, linears, glu: str | None = None, kernels=()):
        from ..kernels import LinearGroupKernel

        ops = [_cpu_kernel(m) for m in linears]
        if not all(ops):
            raise Unsupported("a projection is not on the CPU linear kernels")
        if any(op.bias is not None for op in ops):
            if glu is not None or kernels:
                raise Unsupported("gated or kernel-extended projection with a bias")
            self.bias = torch.cat([op.bias.float() for op in ops]).contiguous()
        else:
            self.bias = None
        self.group = LinearGroupKernel([op.kernel for op in ops] + list(kernels), glu=glu)
        self.out_features = self.group.out_features
        self.out = torch.empty(self.group.out_features)
        self._call = self.group._g.forward
        self._pool = self.group.pool._c

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.rows(1, x, self.out)

    def rows(self, n: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out [n, out_features]`` of ``n`` contiguous fp32 rows ``x`` (the step's buffers)."""
        self._call(self._pool, n, x.data_ptr(), out.data_ptr())
        if self.bias is not None:
            out.add_(self.bias)
        return out


#: DeepSeek routers (transformers' own, or ``KMoEGate`` over one): routed in the step by gate.py's functions
#: (GLM-4-MoE's is DeepSeek-V3's: sigmoid, correction bias, group-limited top-k, the same ops in the same order)
DEEPSEEK_ROUTERS = ("DeepseekV2TopkRouter", "DeepseekV3TopkRouter", "Glm4MoeTopkRouter")


def _deepseek_router(router) -> dict | None:
    """The routing parameters of a DeepSeek-V2/V3 or GLM-4-MoE router (``KMoEGate`` or transformers' own), else None."""
    if router is None:
        return None
    orig = router.orig_module if type(router).__name__ == "KMoEGate" else router
    if type(orig).__name__ not in DEEPSEEK_ROUTERS:
        return None
    bias = router._buffers.get("e_score_correction_bias") if hasattr(router, "_buffers") else None
    method = getattr(orig, "topk_method", None)
    if (bias is None) == (method is None):
        raise Unsupported(f"router {type(orig).__name__}: neither a correction bias nor a topk_method")
    if bias is not None and (bias.is_meta or bias.device.type != "cpu"):
        raise Unsupported("router correction bias not loaded on the CPU")
    if method is not None and method not in ("greedy", "group_limited_greedy"):
        raise Unsupported(f"router topk_method {method!r}")
    return dict(bias=None if bias is None else bias.detach().float(), method=method, top_k=int(orig.top_k),
                n_group=int(orig.num_group or 1), topk_group=int(orig.topk_group or 1),
                norm=bool(getattr(orig, "norm_topk_prob", False)), scale=float(orig.routed_scaling_factor))


def _experts_op(experts):
    """The ``KExpertsCPU`` op that serves ``experts`` at T=1 with its output on the CPU, or None.

    None also for experts carrying an adapter's LoRA: the step's ``MoEKernel`` call has no LoRA,
    so such a block runs its own forward on the step's rows (the operator applies the LoRA)."""
    from ..operators.cpu_experts import KExpertsCPU

    if getattr(experts, "lora_config", None) is not None:
        return None
    return _one_row_op(experts, KExpertsCPU)


class _MoE:
    """A Qwen-MoE block at T=1 on the step's buffers: the router's linear (fp32, on the kernels;
    with the shared expert's gate row appended when there is one), ``decode_ops.moe_route``
    (softmax, top-k, renormalisation as the router does), the routed experts' ``MoEKernel`` into a
    preallocated output, and the shared expert (gate/up+activation, down) scaled by
    sigmoid(its gate) and added."""

    def __init__(self, mlp, config, act: str | None):
        from ..kernels import LinearKernel

        mods = mlp._modules
        router, experts = mods.get("gate"), mods.get("experts")
        self.deepseek = _deepseek_router(router)
        if router is None or (type(router).__name__ not in SOFTMAX_TOPK_ROUTERS and self.deepseek is None):
            raise Unsupported(f"router {type(router).__name__}")
        op = _experts_op(experts) if experts is not None else None
        if op is None:
            raise Unsupported("routed experts not on the CPU kernels")
        w = getattr(router, "weight", None)
        E, H = op.num_experts, op.hidden
        if w is None or w.is_meta or tuple(w.shape) != (E, H) or w.dtype != torch.float32:
            raise Unsupported("router weight is not an fp32 [num_experts, hidden] tensor")
        self.router_w = w.detach().contiguous()  # the kernel reads it in place
        self.num_experts, self.hidden = E, H
        if self.deepseek is not None:
            self.top_k, self.norm = self.deepseek["top_k"], False
            if self.deepseek["bias"] is not None and tuple(self.deepseek["bias"].shape) != (E,):
                raise Unsupported("router correction bias of another shape than the experts")
            if E % self.deepseek["n_group"] or not 0 < self.deepseek["topk_group"] <= self.deepseek["n_group"]:
                raise Unsupported("router groups")
        else:
            self.top_k, self.norm = int(router.top_k), bool(router.norm_topk_prob)
        if not 0 < self.top_k <= E:
            raise Unsupported(f"top_k {self.top_k}")
        extra = []
        self.shared = self.shared_down = None
        ds = mods.get("shared_experts")
        if ds is not None:  # DeepSeek: ungated shared experts, added to the routed output
            if self.deepseek is None or act not in GLU or not all(
                    hasattr(ds, n) for n in ("gate_proj", "up_proj", "down_proj")):
                raise Unsupported(f"shared experts {type(ds).__name__}")
            self.shared = _Proj([ds.gate_proj, ds.up_proj], glu=GLU[act])
            self.shared_down = _Proj([ds.down_proj])
        sh = mods.get("shared_expert")
        if sh is not None:
            sgate = mods.get("shared_expert_gate")
            if sgate is None or act not in GLU or not all(hasattr(sh, n) for n in ("gate_proj", "up_proj", "down_proj")):
                raise Unsupported(f"shared expert {type(sh).__name__} without a gate / gated activation")
            sg = _cpu_kernel(sgate)
            if sg is not None:
                if sg.bias is not None or int(sg.out_features) != 1:
                    raise Unsupported("shared expert gate with a bias / more than one output")
                extra = [sg.kernel]
            else:  # a plain fp32 linear (not injected): its weight read in place
                sw = getattr(sgate, "weight", None)
                if (type(sgate) is not torch.nn.Linear or sgate.bias is not None or sw is None or sw.is_meta
                        or tuple(sw.shape) != (1, H) or sw.dtype != torch.float32):
                    raise Unsupported(f"shared expert gate {type(sgate).__name__}")
                self.shared_gate_w = sw.detach().contiguous()
                extra = [LinearKernel(op.pool, "llamafile", H, 1, self.shared_gate_w, "F32")]
            self.shared = _Proj([sh.gate_proj, sh.up_proj], glu=GLU[act])
            self.shared_down = _Proj([sh.down_proj])
        self.router = _Proj([], kernels=[LinearKernel(op.pool, "llamafile", H, E, self.router_w, "F32")] + extra)
        self.expert_bytes = int(op.kernel.packed_bytes) or sum(
            int(a.numel() * a.element_size()) if isinstance(a, torch.Tensor) else int(a.nbytes)
            for a in op._arrays.values())
        self.expert_bytes //= E
        self._op = op  # keeps the kernel (and its weights) alive
        self._submit = op.kernel._m.submit
        self._pool = op.pool._c
        self.width = E + len(extra)  # router logits per row (the shared expert's gate logit last)
        self._bufs: dict[int, tuple] = {}
        from .. import cpuinfer_ext

        self._route = cpuinfer_ext.decode_ops.moe_route

    def _buffers(self, n: int):
        got = self._bufs.get(n)
        if got is None:
            with torch.inference_mode(False):  # reused across modes (see _Buf)
                ids, w = torch.zeros(n, self.top_k, dtype=torch.int64), torch.zeros(n, self.top_k)
                got = self._bufs[n] = (torch.empty(n, self.width), ids, w, torch.empty(n, self.hidden))
        return got

    def route(self, n: int, h: torch.Tensor) -> torch.Tensor:
        """Router logits ``[n, width]`` of the rows ``h`` (the shared expert's gate logit last);
        fills each row's expert ids / weights."""
        logits, ids, w, _ = self._buffers(n)
        self.router.rows(n, h, logits)
        if self.deepseek is not None:
            self._route_deepseek(n, logits, ids, w)
            return logits
        # each row alone, as the prompt's MoE block routes it (operators/moe.py: kernels.route_softmax_topk)
        self._route(logits.data_ptr(), self.num_experts, self.top_k, self.norm, ids.data_ptr(), w.data_ptr(),
                    rows=n, stride=self.width)
        return logits

    def _route_deepseek(self, n: int, logits: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> None:
        """The DeepSeek routers (V3: sigmoid + correction bias, groups by their top-2 sum; V2: softmax,
        greedy or group-limited), by the functions ``KMoEGate`` runs (operators/gate.py: transformers'
        ops in transformers' order), one row at a time so a row's choice never depends on the rows
        beside it."""
        from ..operators.gate import deepseek_v2_route, deepseek_v3_route

        d = self.deepseek
        for r in range(n):
            row = logits[r:r + 1, :self.num_experts]
            if d["bias"] is not None:
                wr, ir = deepseek_v3_route(row, d["bias"], d["top_k"], d["n_group"], d["topk_group"], d["norm"],
                                           d["scale"])
            else:
                wr, ir = deepseek_v2_route(row, d["top_k"], d["method"], d["n_group"], d["topk_group"], d["scale"])
            ids[r].copy_(ir[0])
            w[r].copy_(wr[0])

    def run_experts(self, n: int, h: torch.Tensor) -> torch.Tensor:
        """The routed experts of the rows ``h`` into the ``[n, hidden]`` output.  Submitted to the
        pool's queue thread and waited for (as the MoE block does) rather than run on the calling
        thread: on a loaded machine the just-woken queue thread is scheduled promptly, the busy
        Python thread is not (decode 2x slower on a 2-core box with other jobs, same speed when
        idle)."""
        _, ids, w, out = self._buffers(n)
        self._submit(self._pool, n, self.top_k, h.data_ptr(), 0, ids.data_ptr(), w.data_ptr(), out.data_ptr(), 0)
        self._pool.sync()
        return out

    def __call__(self, n: int, h: torch.Tensor) -> torch.Tensor:
        logits = self.route(n, h)
        out = self.run_experts(n, h)
        if self.shared is not None:
            mid = torch.empty(n, self.shared.out_features)
            s = self.shared_down.rows(n, self.shared.rows(n, h, mid), torch.empty(n, self.hidden))
            if self.deepseek is not None:  # routed + shared, as the block adds them (one rounding per value)
                return out.add_(s)
            for r in range(n):  # row by row: one row's bits never depend on the others
                out[r].add_(s[r], alpha=1.0 / (1.0 + math.exp(-float(logits[r, self.num_experts]))))
        return out


class _MLA:
    """DeepSeek-V2/V3 multi-head latent attention of N rows on the step's buffers, as
    ``KDeepseekV2Attention`` decodes (operators/attention.py, operators/mla.py):

    * the query (``q_proj``, or ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``) and
      ``kv_a_proj_with_mqa`` in one kernel call (they share the input), the norms in C++;
    * RoPE on the rope parts by ``mla.apply_mla_rope`` (V2's complex tables, V3's cos / sin,
      interleaved or not), the normed latent and the roped shared key written through the cache
      layer's own ``update`` (the layout the model's attention keeps: ``c_kv`` as keys, ``k_pe`` as
      values);
    * the attention in latent space (``W_UK`` folded into the query, ``W_UV`` after the weighted
      sum), one row at a time, each row over the keys up to its own position: a row's bits never
      depend on how many rows the step has.  On the CPU kernel (``mla.latent_kernel_attention``)
      where the tier serves it -- the prompt rows' kernel, so a decoded token has the bits it has
      read as a prompt -- else in torch;
    * ``o_proj`` on the kernels."""

    def __init__(self, attn, config, idx: int):
        from ..operators.attention import dense_linear_weight
        from ..operators.mla import split_kv_b

        mods = attn._modules
        self.idx = idx
        self.H = int(attn.num_heads)
        self.nope, self.rope, self.v = int(attn.qk_nope_head_dim), int(attn.qk_rope_head_dim), int(attn.v_head_dim)
        self.C = int(attn.kv_lora_rank)
        self.scaling = float(attn.scaling)
        self.interleave = bool(getattr(config, "rope_interleave", True))
        self.qk = self.nope + self.rope
        if getattr(attn, "q_lora_rank", None) is None:
            q_first, self.q_b, self.qa, self.q_norm = mods.get("q_proj"), None, 0, None
        else:
            q_first, self.q_b = mods.get("q_a_proj"), _Proj([mods["q_b_proj"]])
            self.qa = int(attn.q_lora_rank)
            self.q_norm = _norm_weight(mods["q_a_layernorm"], False)
            if self.q_b.out_features != self.H * self.qk:
                raise Unsupported("q_b_proj of another width than the heads")
        if q_first is None or "kv_a_proj_with_mqa" not in mods or "kv_b_proj" not in mods:
            raise Unsupported(f"MLA attention {type(attn).__name__} without its projections")
        self.first = _Proj([q_first, mods["kv_a_proj_with_mqa"]])
        self.q_width = self.qa if self.q_b is not None else self.H * self.qk
        if self.first.out_features != self.q_width + self.C + self.rope:
            raise Unsupported("MLA projections of other widths than the config's")
        self.kv_norm = _norm_weight(mods["kv_a_layernorm"], False)
        if self.kv_norm[0].numel() != self.C:
            raise Unsupported("kv_a_layernorm of another width than kv_lora_rank")
        w = dense_linear_weight(mods["kv_b_proj"])
        if not isinstance(w, torch.Tensor) or w.is_meta or w.device.type != "cpu":
            raise Unsupported("kv_b_proj has no dense weight on the CPU")
        if tuple(w.shape) != (self.H * (self.nope + self.v), self.C):
            raise Unsupported("kv_b_proj of another shape than the heads")
        if hasattr(attn, "latent_weights"):  # the operator's own fp32 split (made once, shared)
            w_uk, w_uv_t = attn.latent_weights()
        else:
            w_uk, w_uv = split_kv_b(w.detach().float(), self.H, self.nope, self.v)
            w_uv_t = w_uv.transpose(-1, -2).contiguous()
        self.w_uk = w_uk.detach().contiguous()  # [H, nope, C]
        self.w_uv_t = w_uv_t.detach()  # [H, C, v]
        self.o = _Proj([mods["o_proj"]])
        self.linears = [q_first, mods["kv_a_proj_with_mqa"], mods["o_proj"]] + (
            [mods["q_b_proj"]] if self.q_b is not None else [])
        self._serves = None  # (KT_FLASH_ATTN, grad mode) -> the latent kernel serves the rows (fp32 CPU buffers)

    def __call__(self, n: int, h: torch.Tensor, pe: list, kv, a: torch.Tensor, bufs: dict, ops) -> None:
        """``a [n, hidden]`` = the attention output of the rows ``h``; ``pe[r]`` the rotary tables of
        row r, ``kv(layer index, r, c_kv [1,1,1,C], k_pe [1,1,1,rope])`` writes row r's latent into the
        cache and returns ``(latent, rope keys, table, page_size, L)``: the ``L`` keys row r attends
        to are rows ``0 .. L-1`` of ``latent [., C]`` / ``rope keys [., rope]`` (``table`` None), or
        a page pool's rows by the int64 block ``table`` of ``page_size``-slot pages."""
        H, C, R, nope = self.H, self.C, self.rope, self.nope
        W = self.first.out_features
        first = self.first.rows(n, h, bufs["first"].rows(n, W))
        fp = first.data_ptr()
        c = bufs["c"].rows(n, C)
        cp = c.data_ptr()
        for r in range(n):  # the latent's norm; the query's low-rank norm
            ops.rms_norm(fp + 4 * (r * W + self.q_width), self.kv_norm[2], cp + 4 * r * C, 1, C, 0, self.kv_norm[1])
        if self.q_b is not None:
            qa = bufs["qa"].rows(n, self.qa)
            for r in range(n):
                ops.rms_norm(fp + 4 * r * W, self.q_norm[2], qa.data_ptr() + 4 * r * self.qa, 1, self.qa, 0,
                             self.q_norm[1])
            q = self.q_b.rows(n, qa, bufs["q"].rows(n, H * self.qk))
        else:
            q = first[:, :self.q_width]
        o = bufs["o"].rows(n, H * self.v)
        from ..operators.mla import apply_mla_rope, latent_kernel_attention, latent_kernel_serves

        key = (os.environ.get("KT_FLASH_ATTN"), torch.is_grad_enabled())  # what the answer depends on here
        if self._serves is None or self._serves[0] != key:
            self._serves = (key, latent_kernel_serves(C, R, q))
        kernel = self._serves[1]
        for r in range(n):
            qr = q[r].view(1, H, 1, self.qk)
            q_pe, k_pe = apply_mla_rope(qr[..., nope:], first[r, self.q_width + C:].view(1, 1, 1, R), pe[r],
                                        self.interleave)
            lat, rk, table, ps, seen = kv(self.idx, r, c[r].view(1, 1, 1, C), k_pe.float())
            if kernel:  # the prompt rows' kernel: a decoded token's bits are those of it read as a prompt
                latent_kernel_attention(qr[..., :nope], q_pe.float(), lat, rk, self.w_uk, self.w_uv_t, seen - 1,
                                        self.scaling, table=table, page_size=ps, out=o[r].view(1, H, self.v))
                continue
            if table is not None:  # torch reads the row's keys gathered from the pages
                slots = (table[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)[:seen]
                lat, rk = lat.index_select(0, slots), rk.index_select(0, slots)
            q_abs = torch.bmm(qr[0, :, :, :nope], self.w_uk).view(H, C)
            scores = torch.mm(q_abs, lat.t())
            scores.add_(torch.mm(q_pe.reshape(H, R).float(), rk.t()))
            probs = torch.softmax(scores.mul_(self.scaling), dim=-1)
            torch.bmm(torch.mm(probs, lat).view(H, 1, C), self.w_uv_t, out=o[r].view(H, 1, self.v))
        self.o.rows(n, o, a)


_IDENTITY: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
_IDENTITY_ALL: list[tuple[torch.Tensor, torch.Tensor]] = []  # never freed: steps on other threads hold their addresses


def _identity_rope(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos = 1, sin = 0 tables ``[n, d]`` (RoPE that changes nothing), kept per ``d`` and grown by
    doubling; a table outgrown stays allocated (a step on another thread may be reading it)."""
    got = _IDENTITY.get(d)
    if got is None or got[0].shape[0] < n:
        with torch.inference_mode(False):
            rows = max(n, 2 * got[0].shape[0] if got is not None else 64)
            got = _IDENTITY[d] = (torch.ones(rows, d), torch.zeros(rows, d))
            _IDENTITY_ALL.append(got)
    return got[0][:n], got[1][:n]


class _Layer:
    def __init__(self, layer, idx: int, config, gemma: bool):
        attn = layer.self_attn
        self.idx = idx
        self.mla = None
        if "kv_a_proj_with_mqa" in attn._modules:  # DeepSeek MLA
            self.mla = _MLA(attn, config, idx)
            self.hq = self.hkv = 1
            self.d = 0
            self.layer_type, self.window, self.gemma = "full_attention", 0, False
            self.qkv = self.o = self.qk_norm = None
            self.qk_ptr, self.qk_eps = 0, 0.0
            self.in_norm = _norm_weight(layer.input_layernorm, False)
            self.pre_mlp_norm = _norm_weight(layer.post_attention_layernorm, False)
            self._mlp(layer, idx, config)
            return
        self.hq = int(config.num_attention_heads)
        self.hkv = int(config.num_key_value_heads)
        self.d = int(getattr(attn, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.scaling = float(attn.scaling)
        if getattr(attn, "attn_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
            raise Unsupported("attention logit softcapping")
        self.layer_type = (config.layer_types[idx] if getattr(config, "layer_types", None) else "full_attention")
        # the window the layer's own forward passes to its attention (Mistral: the config's)
        w = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
        self.window = int(w or 0)
        if self.d % 2:
            raise Unsupported(f"layer {idx}: odd head_dim")
        self.qkv = _Proj([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o = _Proj([attn.o_proj])
        self.in_norm = _norm_weight(layer.input_layernorm, gemma)
        qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if (qn is None) != (kn is None):
            raise Unsupported("only one of q_norm / k_norm")
        if qn is not None:
            (wq, eq, _), (wk, ek, _) = _norm_weight(qn, gemma), _norm_weight(kn, gemma)
            if eq != ek or wq.numel() != self.d or wk.numel() != self.d:
                raise Unsupported("q_norm / k_norm of another shape than the head")
            w = torch.cat([wq.expand(self.hq, -1), wk.expand(self.hkv, -1)]).contiguous()
            self.qk_norm = (w, eq, w.data_ptr())
        else:
            self.qk_norm = None
        self.qk_ptr, self.qk_eps = (self.qk_norm[2], self.qk_norm[1]) if self.qk_norm is not None else (0, 0.0)
        self.rot = self.d  # the rotary width (partial_rotary: set by ``partial_rotary``)
        self.gemma = gemma
        if gemma:
            self.post_attn_norm = _norm_weight(layer.post_attention_layernorm, True)
            self.pre_mlp_norm = _norm_weight(layer.pre_feedforward_layernorm, True)
            self.post_mlp_norm = _norm_weight(layer.post_feedforward_layernorm, True)
        else:
            self.pre_mlp_norm = _norm_weight(layer.post_attention_layernorm, False)
        self._mlp(layer, idx, config)

    def partial_rotary(self, rot: int) -> None:
        """Rotate only the first ``rot`` of each head's ``d`` values (GLM-4-MoE's
        ``partial_rotary_factor``): the q/k norm and that RoPE run before the attention kernel
        (``rope_rows``), which is then given identity tables (its RoPE leaves every value as it is)."""
        if rot == self.d:
            return
        if not 2 <= rot < self.d or rot % 2:
            raise Unsupported(f"layer {self.idx}: rotary width {rot} of a head of {self.d}")
        self.rot = rot
        self.pre_qk = (self.qk_ptr, self.qk_eps)
        self.qk_ptr, self.qk_eps = 0, 0.0

    def rope_rows(self, n: int, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops) -> tuple[int, int]:
        """The cos / sin addresses the attention kernel takes for the rows ``q [n, (hq + 2 hkv) d]``
        with ``cos`` / ``sin [n, rotary width]``.  Partial rotary: each row's q/k heads normed here (the
        kernel's own per-head norm, one call per row) and their first ``rot`` values rotated in torch
        with transformers' arithmetic (``q * cos + rotate_half(q) * sin``: elementwise, so a row's bits
        never depend on the rows beside it); the identity tables returned."""
        if self.rot == self.d:
            return cos.data_ptr(), sin.data_ptr()
        heads, d, W = self.hq + self.hkv, self.d, self.qkv.out_features
        w, eps = self.pre_qk
        if w:
            qp = q.data_ptr()
            for r in range(n):
                ops.rms_norm(qp + 4 * r * W, w, qp + 4 * r * W, heads, d, d, eps)
        x = q[:, :heads * d].view(n, heads, d)[..., :self.rot]
        c, s = cos[:, None, :], sin[:, None, :]
        half = self.rot // 2
        x.copy_(x * c + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * s)
        ones, zeros = _identity_rope(n, d)
        return ones.data_ptr(), zeros.data_ptr()

    def _mlp(self, layer, idx: int, config) -> None:
        mlp = layer.mlp
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        self.gate_up = self.down = None
        self.mlp_module = self.moe = None
        if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")) and act in GLU:
            try:
                self.gate_up = _Proj([mlp.gate_proj, mlp.up_proj], glu=GLU[act])
                self.down = _Proj([mlp.down_proj])
            except Unsupported:
                self.gate_up = self.down = None
        if self.gate_up is None and "experts" in mlp._modules:
            try:
                self.moe = _MoE(mlp, config, act)
            except Unsupported as e:
                log.debug("layer %d: MoE block called as a module: %s", idx, e)
        if self.gate_up is None and self.moe is None:
            if not any(hasattr(mlp, n) for n in ("experts", "gate_proj")):
                raise Unsupported(f"MLP {type(mlp).__name__}")
            self.mlp_module = mlp  # MoE block (or a dense MLP off the kernels): its own forward


def lean_parts(model):
    """(text config, is-Gemma, backbone, lm_head) of a model a lean step can serve, else :class:`Unsupported`."""
    config = model.config.get_text_config()
    gemma = FAMILIES.get(getattr(config, "model_type", None))
    if gemma is None:
        raise Unsupported(f"model type {getattr(config, 'model_type', None)!r}")
    if getattr(config, "use_bidirectional_attention", False):
        raise Unsupported("bidirectional attention")
    backbone = getattr(model, "model", None)
    lm_head = getattr(model, "lm_head", None)
    if backbone is None or lm_head is None or not hasattr(backbone, "layers"):
        raise Unsupported("no model.model.layers / lm_head")
    if getattr(model, "training", False):
        raise Unsupported("model in training mode")
    return config, gemma, backbone, lm_head


def _rows_limit(linears) -> float:
    """Most rows for which each linear's own op choice is the kernel ``_cpu_kernel`` bound."""
    limit = math.inf
    for lin in linears:
        op = _cpu_kernel(lin)
        pre = getattr(lin, "prefill_op", None)
        if pre is not None and pre is not op:
            limit = min(limit, int(lin.prefill_threshold))
    return limit


class _Buf:
    """A reusable fp32 buffer for ``rows x width`` contiguous values (width up to ``width``; grown
    when a step has more rows)."""

    def __init__(self, width: int):
        self.width = int(width)
        self.t = torch.empty(0)
        self._views: dict[tuple[int, int], torch.Tensor] = {}

    def rows(self, n: int, width: int | None = None) -> torch.Tensor:
        width = self.width if width is None else width
        v = self._views.get((n, width))
        if v is None:
            # normal tensors whatever the mode of the first call: the Generator steps in inference
            # mode, transformers' generate() and the batch runner under no_grad
            with torch.inference_mode(False):
                if self.t.numel() < n * self.width:
                    self.t = torch.empty(n * self.width)
                    self._views.clear()
                v = self._views[(n, width)] = self.t[: n * width].view(n, width)
        return v


_NO_ROWS = torch.zeros(2, dtype=torch.int64)  # the page arguments of a cache-layer call (not read)


class DecodeStep:
    """See the module docstring.  ``step`` -> logits ``[1, vocab]``, ``step_pages`` -> ``[N, vocab]``
    (fp32; a fresh tensor each step: callers may keep rows across steps)."""

    def __init__(self, model):
        config, gemma, backbone, lm_head = lean_parts(model)
        self.config = config
        self.embed = backbone.embed_tokens
        if module_device(self.embed).type != "cpu":
            raise Unsupported("embeddings off the CPU")
        self.embed_rows = _embedding_rows(self.embed, int(config.hidden_size))
        self.rotary = backbone.rotary_emb
        self.layers = [_Layer(layer, i, config, gemma) for i, layer in enumerate(backbone.layers)]
        self.final_norm = _norm_weight(backbone.norm, gemma)
        self.head = _Proj([lm_head])
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.hidden = H = int(config.hidden_size)
        self.layer_types = sorted({lay.layer_type for lay in self.layers})
        self.gemma_rope = gemma  # Gemma-3's rotary module takes the layer type
        mla = [lay.mla is not None for lay in self.layers]
        self.mla = all(mla)
        if any(mla) and not self.mla:
            raise Unsupported("MLA on some layers only")
        linears = [lm_head]
        for layer, lay in zip(backbone.layers, self.layers):
            attn = layer.self_attn
            linears += lay.mla.linears if lay.mla is not None else [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
            if lay.gate_up is not None:
                linears += [layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
        self.max_rows = _rows_limit(linears)
        probe = torch.zeros(1, 1, H), torch.zeros(1, 1, dtype=torch.long)
        self._rope_width = {}
        for lt in ([] if self.mla else self.layer_types):  # MLA: the rotary tables of the rope part, per row
            cos = self._rope(*probe, lt)[0]
            for lay in self.layers:
                if lay.layer_type == lt:
                    lay.partial_rotary(int(cos.shape[-1]))  # Unsupported unless an even width <= head_dim
            self._rope_width[lt] = int(cos.shape[-1])
        # cos / sin of N positions in one call give each row the bits of its own call when nothing
        # couples the rows: a static rope type (a dynamic one rescales by the batch's longest
        # position), rows of whole 32-lane iterations of torch's vector loop (no scalar tail inside
        # a row), and one thread (under torch's grain size); else one call per row
        kinds = set()
        for a in ("rope_type", *(f"{lt}_rope_type" for lt in self.layer_types)):
            v = getattr(self.rotary, a, None)
            kinds |= {str(t) for t in (v.values() if isinstance(v, dict) else [v]) if t is not None}
        static = kinds <= {"default", "linear", "llama3", "yarn"}
        aligned = all(w % 32 == 0 for w in self._rope_width.values())
        self._rope_rows_max = 16384 if static and aligned and not self.mla else 0
        from .. import cpuinfer_ext

        self._ops = cpuinfer_ext.decode_ops
        self._dequantize = cpuinfer_ext.dequantize
        self._cpuinfer = self.head._pool  # attention runs on the kernels' pool
        self._lock = threading.Lock()
        self._pv_mode = None  # (KT_FLASH_ATTN, bf16 P V): _pv_bf16
        #: when set (the MTP drafter, generation/mtp.py): each step leaves ``last_hidden`` =
        #: (positions, the rows' final hidden states after the final norm ``[n, hidden]``)
        self.keep_hidden = False
        self.last_hidden = None
        self.x, self.h, self.a, self.m = _Buf(H), _Buf(H), _Buf(H), _Buf(H)
        self.qkv = _Buf(max([lay.qkv.out_features for lay in self.layers if lay.qkv is not None], default=1))
        self.att = _Buf(max([lay.hq * lay.d for lay in self.layers if lay.mla is None], default=1))
        if self.mla:
            ms = [lay.mla for lay in self.layers]
            self.mla_bufs = {"first": _Buf(max(m.first.out_features for m in ms)), "c": _Buf(max(m.C for m in ms)),
                             "qa": _Buf(max(m.qa for m in ms) or 1), "q": _Buf(max(m.H * m.qk for m in ms)),
                             "o": _Buf(max(m.H * m.v for m in ms))}
        self.mid = _Buf(max([lay.gate_up.out_features for lay in self.layers if lay.gate_up is not None], default=1))

    @classmethod
    def build(cls, model) -> "DecodeStep | None":
        try:
            # the step's buffers are normal tensors, whichever mode builds it: the Generator steps
            # in inference mode, transformers' generate() under no_grad
            with torch.inference_mode(False), torch.no_grad():
                return cls(model)
        except Unsupported as e:
            log.debug("lean decode step not used: %s", e)
            return None

    # ---------------------------------------------------------------------------------- gate
    def accepts(self, cache) -> bool:
        """Whether the next single-token step on ``cache`` can take this path: a ``StaticCache``
        (static / sliding layers) or a ``DynamicCache`` (dynamic / dynamic sliding layers, the
        sliding ones not recording their past), initialised by a prefill, fp32 batch 1 on the CPU,
        with autograd off (inference mode or ``no_grad``: the cache is written in place)."""
        from transformers import DynamicCache, StaticCache

        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            return False
        if getattr(cache, "offloading", False) or len(getattr(cache, "layers", ())) != len(self.layers):
            return False
        static, dynamic = _layer_kinds()
        kinds = static if type(cache) is StaticCache else dynamic if type(cache) is DynamicCache else None
        if kinds is None:
            return False
        if self.mla:  # the latent [1, 1, S, C] as keys, the rope key [1, 1, S, rope] as values
            for lay, cl in zip(self.layers, cache.layers):
                if type(cl) is not kinds[0] or not cl.is_initialized:
                    return False
                k, v, m = cl.keys, cl.values, lay.mla
                if (k.dtype is not torch.float32 or v.dtype is not torch.float32 or k.dim() != 4 or v.dim() != 4
                        or k.device.type != "cpu" or v.device.type != "cpu" or tuple(k.shape[:2]) != (1, 1)
                        or tuple(v.shape[:2]) != (1, 1) or k.shape[3] != m.C or v.shape[3] != m.rope):
                    return False
            return True
        for lay, cl in zip(self.layers, cache.layers):
            if type(cl) not in kinds or not cl.is_initialized or getattr(cl, "record_past", False):
                return False
            k = cl.keys
            if (k.dtype is not torch.float32 or k.dim() != 4 or k.shape[0] != 1 or k.device.type != "cpu"
                    or k.shape[1] != lay.hkv or k.shape[3] != lay.d):
                return False
        return True

    def accepts_rows(self, n_rows: int) -> bool:
        """Whether a page-pool step of ``n_rows`` sequences can take this path (no autograd; no more
        rows than the linears' prefill threshold: above it their modules would pick another op)."""
        return 1 <= n_rows <= self.max_rows and not torch.is_grad_enabled()

    def pages_of(self, pool) -> list | None:
        """Per layer the (keys, values) addresses of ``pool``'s fp32 CPU ``[slots, kv heads, d]``
        pages (MLA: its ``[slots, kv_lora_rank]`` latent and ``[slots, rope]`` rope-key tensors), or
        None when the pool holds another layout (the generic step)."""
        if self.mla:
            got = []
            for lay in self.layers:
                lat, rk = pool.tensors.get(f"layers.{lay.idx}.latent"), pool.tensors.get(f"layers.{lay.idx}.rope_key")
                if lat is None or rk is None or any(
                        t.dtype is not torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 2
                        for t in (lat, rk)) or lat.shape[1] != lay.mla.C or rk.shape[1] != lay.mla.rope:
                    return None
                got.append((lat, rk))
            return got
        mine = pool.__dict__.setdefault("_kt_step_pages", {})  # kept on the pool: it lives as long
        got = mine.get(id(self))                                  # as the addresses it holds
        if got is None:
            got = []
            for lay in self.layers:
                k, v = pool.tensors.get(f"layers.{lay.idx}.key"), pool.tensors.get(f"layers.{lay.idx}.value")
                if k is None or v is None or any(
                        t.dtype is not torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                        or tuple(t.shape[1:]) != (lay.hkv, lay.d) for t in (k, v)):
                    got = False
                    break
                got.append((k.data_ptr(), v.data_ptr()))
            mine[id(self)] = got
        return got or None

    # ---------------------------------------------------------------------------------- caches
    def _static_plan(self, cache):
        """Per layer: (layer, keys / values / counter pointers, capacity, sliding?) of ``cache``,
        made once per cache (static layers keep their tensors' addresses for their lifetime)."""
        plan = cache.__dict__.get("_kt_lean_plan")
        if plan is None or plan[0] != cache.layers[0].keys.data_ptr():
            rows = []
            for lay, cl in zip(self.layers, cache.layers):
                k, v = cl.keys, cl.values
                if (k.shape[1] != lay.hkv or k.shape[3] != lay.d or v.shape != k.shape
                        or not (k.is_contiguous() and v.is_contiguous())):
                    raise Unsupported("cache layer shape")
                rows.append((cl, k.data_ptr(), v.data_ptr(), cl.cumulative_length.data_ptr(), int(cl.max_cache_len),
                             bool(cl.is_sliding)))
            full = next((i for i, r in enumerate(rows) if not r[5]), None)
            plan = (cache.layers[0].keys.data_ptr(), rows, full)
            cache.__dict__["_kt_lean_plan"] = plan
        return plan[1], plan[2]

    def attended(self, cache, pos: int) -> dict[str, int]:
        """Per layer type, how many of its cache entries (from the first) the query at ``pos``
        attends to on this cache: what a mask built for the step's own layout must show."""
        seen = {}
        for lay, cl in zip(self.layers, cache.layers):
            if getattr(cl, "is_sliding", False):
                cur = cl.cumulative_length_int if hasattr(cl, "cumulative_length_int") else cl.keys.shape[-2]
                cap = int(getattr(cl, "max_cache_len", cur + 1))
                seen[lay.layer_type] = min(cur + 1, cap)
            else:
                seen[lay.layer_type] = pos + 1
        return seen

    def _static_slots(self, cache, pos: int):
        """Per layer (keys, values, capacity, roll, entries, counter pointer) for writing position
        ``pos`` into a ``StaticCache`` as its layers' own ``update`` would, or None."""
        plan, full = self._static_plan(cache)
        if full is not None:
            cl, cap = plan[full][0], plan[full][4]
            if pos >= cap or int(cl.cumulative_length) != pos:
                return None
        slots = []
        for cl, kp, vp, lp, cap, sliding in plan:
            if sliding:
                cur = cl.cumulative_length_int
                cl.cumulative_length_int = cur + 1
                if cur < cap:
                    slots.append((kp, vp, cap, 0, cur + 1, lp))
                else:  # a full window: shifted left by one, newest last (the layer's own layout)
                    slots.append((kp, vp, cap, 1, cap, 0))
            else:
                slots.append((kp, vp, cap, 0, pos + 1, lp))
        return slots, None

    def _dynamic_slots(self, cache, pos: int, rows: int = 1):
        """The same for a ``DynamicCache``.  Its layers grow by concatenation in their own
        ``update``; here each layer's keys / values become views of a buffer with room to grow (kept
        on the layer, ``_kt_grow``), so a token is one row written, not the cache copied.  The
        layers end as their ``update`` leaves them: a dynamic layer holds every position, a sliding
        one its last ``window - 1`` (the views' offset moves; the buffer is compacted when full).
        A generic forward in between replaces the views by its own tensors; they are adopted again.
        ``rows``: room for that many positions from ``pos`` (several rows: dynamic layers only)."""
        for lay, cl in zip(self.layers, cache.layers):
            n = cl.keys.shape[-2]
            if (cl.cumulative_length if cl.is_sliding else n) != pos or (rows > 1 and cl.is_sliding):
                return None
        slots, after = [], []
        for lay, cl in zip(self.layers, cache.layers):
            k, v, n = cl.keys, cl.values, cl.keys.shape[-2]
            row = 4 * lay.d
            grow = cl.__dict__.get("_kt_grow")
            off = -1
            if grow is not None and k.dim() == 4 and v.shape == k.shape:
                kb, vb = grow
                delta = k.data_ptr() - kb.data_ptr()
                if (delta == v.data_ptr() - vb.data_ptr() and delta % row == 0 and k.stride() == kb.stride()
                        and v.stride() == vb.stride() and 0 <= delta // row and delta // row + n + rows <= kb.shape[2]):
                    off = delta // row
            if off < 0:  # adopt: a buffer with room for the next positions (a window and a half when sliding)
                cap = (2 * int(cl.sliding_window) + 64) if cl.is_sliding else max(n + 256, n + n // 2, n + rows + 1)
                kb = torch.empty(1, lay.hkv, cap, lay.d)
                vb = torch.empty(1, lay.hkv, cap, lay.d)
                kb[:, :, :n].copy_(k)
                vb[:, :, :n].copy_(v)
                cl.__dict__["_kt_grow"] = (kb, vb)
                off = 0
            cap = kb.shape[2]
            # the view starts at slot `off` of a [1, hkv, cap, d] buffer: head stride cap * d
            slots.append((kb.data_ptr() + off * row, vb.data_ptr() + off * row, cap, 0, n + 1, 0))
            if cl.is_sliding:
                keep = min(n + 1, int(cl.sliding_window) - 1)
                start = off + n + 1 - keep
                if start + keep + 1 > cap:  # no room for the next token: compact after this one
                    after.append((cl, kb, vb, start, keep, True))
                else:
                    after.append((cl, kb, vb, start, keep, False))
            else:
                after.append((cl, kb, vb, off, n + rows, False))
        return slots, after

    @staticmethod
    def _static(cache) -> bool:
        from transformers import StaticCache

        return type(cache) is StaticCache

    @staticmethod
    def _finish_dynamic(after) -> None:
        for cl, kb, vb, start, keep, compact in after:
            if compact:
                kb[:, :, :keep].copy_(kb[:, :, start:start + keep].clone())
                vb[:, :, :keep].copy_(vb[:, :, start:start + keep].clone())
                start = 0
            cl.keys, cl.values = kb[:, :, start:start + keep], vb[:, :, start:start + keep]
            if cl.is_sliding:
                cl.cumulative_length += 1

    # ---------------------------------------------------------------------------------- the step
    def embed_into_x(self, token: int) -> torch.Tensor:
        """The embedding of ``token``, as the step reads it (one row of ``x``)."""
        x = self.x.rows(1)
        self._embed([token], x)
        return x[0]

    def _embed(self, tokens: list[int], x: torch.Tensor) -> None:
        er = self.embed_rows
        if er is not None and all(0 <= t < er[0].shape[0] for t in tokens):
            rows, tid, scale = er
            base, width = rows.data_ptr(), rows.shape[1]
            for r, t in enumerate(tokens):
                self._dequantize(tid, base + t * width, self.hidden, x[r].data_ptr())
            if scale is not None:
                x.mul_(scale)
        else:  # no row read in place (or an out-of-range id: the module raises its own error)
            x.copy_(self.embed(torch.tensor([tokens], dtype=torch.long)).reshape(len(tokens), self.hidden))

    def _rope(self, x, pos_t, layer_type):
        return self.rotary(x, pos_t, layer_type) if self.gemma_rope else self.rotary(x, pos_t)

    def step(self, token: int, pos: int, cache) -> torch.Tensor | None:
        """Logits ``[1, vocab]`` of ``token`` at ``pos`` (the cache holds positions < pos), or None
        when this cache state is not one the step reproduces (the caller takes the generic forward).
        One step at a time on the model's buffers (a lock, uncontended per stream)."""
        if self.mla:
            kv = self._latent(cache, pos, 1)
            if kv is None:
                return None
            with self._lock:
                return self._rows([token], [pos], kv)
        with self._lock:
            try:
                got = (self._static_slots if self._static(cache) else self._dynamic_slots)(cache, pos)
            except Unsupported:
                return None
            if got is None:
                return None
            slots, after = got
            pos_t = torch.tensor([pos], dtype=torch.int64)
            # each layer's first visible key, one tensor (layer i's at element i): no tensor per layer
            los = torch.tensor([pos + 1 - sl[4] for sl in slots], dtype=torch.int64)
            lo0, pv = los.data_ptr(), self._pv_bf16

            def keys_of(lay, q, cos, sin, out):
                kp, vp, cap, roll, n, lenp = slots[lay.idx]
                self._ops.attend_rows(self._cpuinfer, q, 1, lay.hq, lay.hkv, lay.d, lay.qk_ptr, lay.qk_eps, cos, sin,
                                      kp, vp, lay.d, cap * lay.d, 0, _NO_ROWS.data_ptr(), _NO_ROWS.data_ptr(),
                                      pos_t.data_ptr(), lo0 + 8 * lay.idx, roll, cap, lenp, lay.scaling, out, bf16_pv=pv)

            logits = self._rows([token], [pos], keys_of)
            if after is not None:
                self._finish_dynamic(after)
            return logits

    def step_rows(self, tokens: list[int], pos: int, cache):
        """Verify several tokens in one step (speculative decoding): ``(logits [n, vocab], undo)``
        for ``tokens`` at ``pos, pos + 1, ...`` of one sequence over a ``StaticCache`` (or a
        ``DynamicCache`` of dynamic layers, no sliding ones: transformers' assisted ``generate()``,
        generation/hf_generate.py), or None when this cache state is not one the step reproduces.

        Row ``r`` has the bits ``step(tokens[r], pos + r)`` gives after the steps of
        ``tokens[:r]``: every projection, norm and MoE row is computed as it is alone (the kernels
        are row-invariant), and each row's attention is its own single-row call, made in order, so
        it reads the keys the rows before it just wrote.  ``undo(kept)`` then leaves the cache as
        if only the first ``kept`` tokens had been stepped (counters reset; a sliding window that
        rolled gets back the entries the dropped rows pushed out; a dynamic layer's keys / values
        become the first ``pos + kept`` entries, as its ``crop`` leaves them)."""
        from transformers import DynamicCache, StaticCache

        n = len(tokens)
        if (n < 1 or type(cache) not in (StaticCache, DynamicCache) or not self.accepts_rows(n)
                or not self.accepts(cache)):
            return None
        if self.mla:
            return self._latent_rows(list(tokens), pos, cache)
        if type(cache) is DynamicCache:
            return self._dynamic_rows(list(tokens), pos, cache)
        with self._lock:
            try:
                plan, full = self._static_plan(cache)
            except Unsupported:
                return None
            if full is not None:
                cl, cap = plan[full][0], plan[full][4]
                if pos + n > cap or int(cl.cumulative_length) != pos:
                    return None
            if any(sliding and cap < n for _, _, _, _, cap, sliding in plan):
                return None
            saved = []  # per sliding layer: (counter int, counter tensor, the entries rolls may drop)
            for cl, kp, vp, lp, cap, sliding in plan:
                if not sliding:
                    saved.append(None)
                    continue
                cur0 = cl.cumulative_length_int
                drop = max(0, min(cur0, cap) + n - cap)
                front = (cl.keys[:, :, :drop].clone(), cl.values[:, :, :drop].clone()) if drop else None
                saved.append((cur0, int(cl.cumulative_length), front))
            ptr = torch.zeros(1, dtype=torch.int64)  # one row's position / first key, rewritten per call
            lo = torch.zeros(1, dtype=torch.int64)
            pp, lop, pv = ptr.data_ptr(), lo.data_ptr(), self._pv_bf16

            def keys_of(lay, q, cos, sin, out):
                cl, kp, vp, lp, cap, sliding = plan[lay.idx]
                qw, cw, ow = 4 * lay.qkv.out_features, 4 * lay.d, 4 * lay.hq * lay.d  # tables: d wide (rope_rows)
                for r in range(n):
                    p = pos + r
                    if sliding:
                        cur = cl.cumulative_length_int
                        cl.cumulative_length_int = cur + 1
                        roll, filled, lenp = (0, cur + 1, lp) if cur < cap else (1, cap, 0)
                    else:
                        roll, filled, lenp = 0, p + 1, lp
                    ptr[0], lo[0] = p, p + 1 - filled
                    self._ops.attend_rows(self._cpuinfer, q + r * qw, 1, lay.hq, lay.hkv, lay.d, lay.qk_ptr,
                                          lay.qk_eps, cos + r * cw, sin + r * cw, kp, vp, lay.d, cap * lay.d, 0,
                                          _NO_ROWS.data_ptr(), _NO_ROWS.data_ptr(), pp, lop, roll, cap, lenp,
                                          lay.scaling, out + r * ow, bf16_pv=pv)

            logits = self._rows(list(tokens), list(range(pos, pos + n)), keys_of)

        def undo(kept: int) -> None:
            if not 0 <= kept <= n:
                raise ValueError(f"undo: kept {kept} of {n} rows")
            for (cl, kp, vp, lp, cap, sliding), sv in zip(plan, saved):
                if not sliding:
                    cl.cumulative_length.fill_(pos + kept)
                    continue
                cur0, t0, front = sv
                cl.cumulative_length_int = cur0 + kept
                cl.cumulative_length.fill_(t0 + max(0, min(kept, cap - cur0)))
                filled0 = min(cur0, cap)
                if front is None or kept == n:
                    continue  # no row rolled the window, or every row stays
                # the layer's sequence: the entries rolled out, then the window as it is now
                fk, fv = front
                seq_k = torch.cat([fk, cl.keys], dim=2)[:, :, :filled0 + kept]
                seq_v = torch.cat([fv, cl.values], dim=2)[:, :, :filled0 + kept]
                keep = min(cap, filled0 + kept)
                cl.keys[:, :, :keep].copy_(seq_k[:, :, -keep:])
                cl.values[:, :, :keep].copy_(seq_v[:, :, -keep:])

        return logits, undo

    def _dynamic_rows(self, tokens: list[int], pos: int, cache):
        """``step_rows`` on a ``DynamicCache``: the rows written into the layers' growth buffers
        (``_dynamic_slots`` with room for all of them), each row's attention its own call in
        order, as the static path makes them."""
        n = len(tokens)
        with self._lock:
            got = self._dynamic_slots(cache, pos, rows=n)
            if got is None:
                return None
            slots, after = got
            ptr = torch.zeros(1, dtype=torch.int64)  # one row's position, rewritten per call
            lo = torch.zeros(1, dtype=torch.int64)   # every dynamic entry is attended: first key 0
            pp, lop, pv = ptr.data_ptr(), lo.data_ptr(), self._pv_bf16

            def keys_of(lay, q, cos, sin, out):
                kp, vp, cap, _, _, _ = slots[lay.idx]
                qw, cw, ow = 4 * lay.qkv.out_features, 4 * lay.d, 4 * lay.hq * lay.d
                for r in range(n):
                    ptr[0] = pos + r
                    self._ops.attend_rows(self._cpuinfer, q + r * qw, 1, lay.hq, lay.hkv, lay.d, lay.qk_ptr,
                                          lay.qk_eps, cos + r * cw, sin + r * cw, kp, vp, lay.d, cap * lay.d, 0,
                                          _NO_ROWS.data_ptr(), _NO_ROWS.data_ptr(), pp, lop, 0, cap, 0,
                                          lay.scaling, out + r * ow, bf16_pv=pv)

            logits = self._rows(tokens, list(range(pos, pos + n)), keys_of)
            self._finish_dynamic(after)
        layers = cache.layers

        def undo(kept: int) -> None:
            if not 0 <= kept <= n:
                raise ValueError(f"undo: kept {kept} of {n} rows")
            for cl in layers:
                cl.keys, cl.values = cl.keys[:, :, :pos + kept], cl.values[:, :, :pos + kept]

        return logits, undo

    def _latent(self, cache, pos: int, n: int):
        """MLA: the writer of rows ``pos .. pos + n - 1`` into the latent cache (each row through its
        layer's own ``update``, as the model's attention writes it), or None when the cache does not
        hold exactly the positions before ``pos`` or has no room for the rows."""
        static = self._static(cache)
        for cl in cache.layers:
            if static:
                if int(cl.cumulative_length) != pos or pos + n > int(cl.max_cache_len):
                    return None
            elif cl.keys.shape[-2] != pos:
                return None
        layers = cache.layers

        def kv(idx, r, c_kv, k_pe):
            keys, values = layers[idx].update(c_kv, k_pe)
            seen = pos + r + 1
            return keys[0, 0, :seen], values[0, 0, :seen], None, 0, seen

        return kv

    def _latent_pages(self, tokens: list[int], positions: list[int], tables: list[list[int]], pool) -> torch.Tensor:
        """``step_pages`` of an MLA model: row r's latent written into its slot of the page pool's
        latent / rope-key tensors, then read in place by its block table (the attention reads the
        pool's rows through it: no copy of the row's keys)."""
        stores = self.pages_of(pool)
        ps = int(pool.page_size)
        books = []
        for t, p in zip(tables, positions):
            if len(t) * ps < p + 1:
                raise ValueError(f"block table of {len(t)} pages holds no slot for position {p}")
            books.append(torch.tensor(t[: p // ps + 1], dtype=torch.int64))

        def kv(idx, r, c_kv, k_pe):
            lat, rk = stores[idx]
            p = positions[r]
            slot = int(books[r][p // ps]) * ps + p % ps
            lat[slot].copy_(c_kv.reshape(-1))
            rk[slot].copy_(k_pe.reshape(-1))
            return lat, rk, books[r], ps, p + 1

        with self._lock:
            return self._rows(tokens, positions, kv)

    def _latent_rows(self, tokens: list[int], pos: int, cache):
        """``step_rows`` of an MLA model: each row's latent written and attended in order."""
        n = len(tokens)
        with self._lock:
            kv = self._latent(cache, pos, n)
            if kv is None:
                return None
            logits = self._rows(tokens, list(range(pos, pos + n)), kv)
        layers = cache.layers

        static = self._static(cache)

        def undo(kept: int) -> None:
            if not 0 <= kept <= n:
                raise ValueError(f"undo: kept {kept} of {n} rows")
            for cl in layers:
                if static:
                    cl.cumulative_length.fill_(pos + kept)
                else:
                    cl.keys, cl.values = cl.keys[:, :, :pos + kept], cl.values[:, :, :pos + kept]

        return logits, undo

    def step_pages(self, tokens: list[int], positions: list[int], tables: list[list[int]], pool) -> torch.Tensor:
        """Logits ``[N, vocab]`` of ``tokens[r]`` at ``positions[r]`` appended to the sequence whose
        block table (new page included) is ``tables[r]`` in ``pool``; its K/V rows are written into
        the pages.  ``pages_of(pool)`` must have been checked."""
        if self.mla:
            return self._latent_pages(tokens, positions, tables, pool)
        ptrs = self.pages_of(pool)
        offsets = [0]
        for t in tables:
            offsets.append(offsets[-1] + len(t))
        pages = torch.tensor([p for t in tables for p in t], dtype=torch.int64)
        offs = torch.tensor(offsets, dtype=torch.int64)
        pos_t = torch.tensor(positions, dtype=torch.int64)
        los = {}
        for w in {lay.window for lay in self.layers}:
            los[w] = (pos_t - w + 1).clamp(min=0) if w > 0 else torch.zeros_like(pos_t)
        n, ps, pv = len(tokens), int(pool.page_size), self._pv_bf16

        def keys_of(lay, q, cos, sin, out):
            kp, vp = ptrs[lay.idx]
            self._ops.attend_rows(self._cpuinfer, q, n, lay.hq, lay.hkv, lay.d, lay.qk_ptr, lay.qk_eps, cos, sin, kp,
                                  vp, lay.hkv * lay.d, lay.d, ps, pages.data_ptr(), offs.data_ptr(), pos_t.data_ptr(),
                                  los[lay.window].data_ptr(), 0, 0, 0, lay.scaling, out, bf16_pv=pv)

        with self._lock:
            return self._rows(tokens, positions, keys_of)

    @property
    def _pv_bf16(self) -> bool:
        """The prompt flash kernel's P V precision (``KT_FLASH_ATTN``), which the step's attention
        takes too, so that a token gets the same bits read as a prompt row or as a decode row (the
        keys of an answer that a later prompt finds in the prefix cache, a preempted request)."""
        mode = os.environ.get("KT_FLASH_ATTN")
        if self._pv_mode is None or self._pv_mode[0] != mode:
            from ..operators.cpu_attention import flash_mode

            self._pv_mode = (mode, bool(flash_mode()))
        return self._pv_mode[1]

    def _rows(self, tokens: list[int], positions: list[int], attend) -> torch.Tensor:
        """The layer loop of every step: embeddings, per layer q/k/v over the rows, ``attend(layer,
        qkv, cos, sin, out)`` (norms, RoPE, the cache write and the attention of each row, wherever
        its keys live), o_proj, the residuals fused with the next norms, the MLP or MoE, the head."""
        n, H, ops = len(tokens), self.hidden, self._ops
        x, h, a = self.x.rows(n), self.h.rows(n), self.a.rows(n)
        self._embed(tokens, x)
        rope = {}
        # MLA: the rotary module's tables (V2 complex, V3 cos / sin) of each row, one call per row
        pe = [self.rotary(x[:1][None], torch.tensor([[p]], dtype=torch.long)) for p in positions] if self.mla else None
        for lt in ([] if self.mla else self.layer_types):
            if n == 1 or n * self._rope_width[lt] <= self._rope_rows_max:
                cos, sin = self._rope(x[:1][None], torch.tensor([positions], dtype=torch.long), lt)
                rope[lt] = (cos.reshape(n, -1).float().contiguous(), sin.reshape(n, -1).float().contiguous())
            else:  # one call per row: bits that never depend on the rows beside it
                cs, sn = [], []
                for p in positions:
                    cos, sin = self._rope(x[:1][None], torch.tensor([[p]], dtype=torch.long), lt)
                    cs.append(cos.reshape(-1))
                    sn.append(sin.reshape(-1))
                rope[lt] = (torch.stack(cs).float().contiguous(), torch.stack(sn).float().contiguous())
        xp, hp, ap = x.data_ptr(), h.data_ptr(), a.data_ptr()
        first = self.layers[0]
        ops.rms_norm(xp, first.in_norm[2], hp, n, H, 0, first.in_norm[1])
        n_layers = len(self.layers)
        for i, lay in enumerate(self.layers):
            if lay.mla is not None:  # attend: the latent cache's writer (_latent)
                lay.mla(n, h, pe, attend, a, self.mla_bufs, ops)
            else:
                q = lay.qkv.rows(n, h, self.qkv.rows(n, lay.qkv.out_features))
                cos, sin = lay.rope_rows(n, q, *rope[lay.layer_type], ops)
                o_att = self.att.rows(n, lay.hq * lay.d)
                attend(lay, q.data_ptr(), cos, sin, o_att.data_ptr())
                lay.o.rows(n, o_att, a)
            if lay.gemma:
                ops.residual_norm(xp, ap, lay.post_attn_norm[2], lay.post_attn_norm[1], lay.pre_mlp_norm[2],
                                  lay.pre_mlp_norm[1], hp, n, H)
            else:
                ops.residual_norm(xp, ap, 0, 0.0, lay.pre_mlp_norm[2], lay.pre_mlp_norm[1], hp, n, H)
            if lay.moe is not None:
                m = lay.moe(n, h)
            elif lay.mlp_module is None:
                m = lay.down.rows(n, lay.gate_up.rows(n, h, self.mid.rows(n, lay.gate_up.out_features)),
                                  self.m.rows(n))
            else:
                m = lay.mlp_module(h.view(1, n, H))
                m = (m[0] if isinstance(m, tuple) else m).reshape(n, H).float().contiguous()
            nxt = self.layers[i + 1].in_norm if i + 1 < n_layers else self.final_norm
            if lay.gemma:
                ops.residual_norm(xp, m.data_ptr(), lay.post_mlp_norm[2], lay.post_mlp_norm[1], nxt[2], nxt[1], hp,
                                  n, H)
            else:
                ops.residual_norm(xp, m.data_ptr(), 0, 0.0, nxt[2], nxt[1], hp, n, H)
        if self.keep_hidden:
            self.last_hidden = (list(positions), h.clone())
        logits = self.head.rows(n, h, torch.empty(n, self.head.out_features))
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits


def decode_step_for(model) -> DecodeStep | None:
    """The model's ``DecodeStep``, built on first use (``None`` where the model is not served)."""
    step = model.__dict__.get("_kt_decode_step", False)
    if step is False:
        step = DecodeStep.build(model)
        model.__dict__["_kt_decode_step"] = step
    return step
