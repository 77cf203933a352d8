"""A lean batched decode step over the page pool: N sequences, one new token each, in one pass.

The generic ``BatchRunner`` step runs the transformers forward per layer (module hops, ~40 torch
ops, mask and index building per step); on a small model that Python/dispatch cost is the whole
step.  ``BatchDecodeStep`` does the same arithmetic for the decode-only step (every sequence
contributes one token, the steady state of serving) with the weights bound once, the way
``generation/decode_step.py``'s ``DecodeStep`` does for one sequence, and with its per-layer pieces
(``_Layer``: the projections as ``LinearGroupKernel`` s, the norm weights):

* per layer for the N rows: q/k/v in one kernel call over N rows (input quantised once), then
  ``cpuinfer_ext.paged_ops.decode_attention`` (csrc/paged_attention.cpp): q/k norms, RoPE at each
  row's own position, the new K/V into the row's page slot, and each query head over its own
  sequence's pages (sliding window for the window layers, GQA), threaded over (row, head);
* o_proj over N rows, the residual + next norm fused (Gemma's sandwich norms included), gate/up +
  activation in one call and down, or the MoE block called once with all N rows (the CPU experts
  group the tokens per expert), and the head over N rows.

Served: the families of ``DecodeStep`` (Llama / Mistral / Qwen2 / Qwen3 / Gemma-3 text, Qwen3-MoE /
Qwen2-MoE attention with their MoE block as a module) with every projection on the CPU linear
kernels and an fp32 CPU page pool; up to ``max_rows`` rows (the linears' prefill threshold: above
it the generic forward would pick their prefill op).  MLA (latent pages) and everything else take
the generic forward (``BatchDecodeStep.build`` returns ``None``).
"""

from __future__ import annotations

import logging
import math

import torch

from .decode_step import Unsupported, _cpu_kernel, _Layer, _norm_weight, _Proj, lean_parts
from .devices import module_device

log = logging.getLogger("ktransformers.batch_decode")


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
            if self.t.numel() < n * self.width:
                self.t = torch.empty(n * self.width)
                self._views.clear()
            v = self._views[(n, width)] = self.t[: n * width].view(n, width)
        return v


class BatchDecodeStep:
    """See the module docstring.  ``step(tokens, positions, tables) -> logits [N, vocab]`` (fp32,
    a fresh tensor: callers may keep rows across steps)."""

    def __init__(self, model, pool):
        config, gemma, backbone, lm_head = lean_parts(model)
        self.embed = backbone.embed_tokens
        if module_device(self.embed).type != "cpu":
            raise Unsupported("embeddings off the CPU")
        self.rotary = backbone.rotary_emb
        self.gemma_rope = gemma  # Gemma-3's rotary module takes the layer type
        self.hidden = H = int(config.hidden_size)
        self.vocab = int(config.vocab_size)
        self.layers = []
        linears = [lm_head]
        for i, layer in enumerate(backbone.layers):
            lay = _Layer(layer, i, config, gemma)
            attn = layer.self_attn
            # the window the layer's own forward passes to its attention (Mistral: the config's)
            w = attn.sliding_window if hasattr(attn, "sliding_window") else getattr(config, "sliding_window", None)
            lay.window = int(w or 0)
            lay.moe = None if lay.gate_up is not None else layer.mlp  # called as a module on all rows
            k, v = pool.tensors.get(f"layers.{i}.key"), pool.tensors.get(f"layers.{i}.value")
            if k is None or v is None:
                raise Unsupported(f"layer {i}: no key/value pages (latent pages take the generic step)")
            for t in (k, v):
                if (t.dtype is not torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                        or tuple(t.shape[1:]) != (lay.hkv, lay.d)):
                    raise Unsupported(f"layer {i}: pages are not fp32 CPU [slots, {lay.hkv}, {lay.d}]")
            if lay.d % 2:
                raise Unsupported(f"layer {i}: odd head_dim")
            lay.k_ptr, lay.v_ptr = k.data_ptr(), v.data_ptr()
            lay.qk_ptr, lay.qk_eps = (lay.qk_norm[2], lay.qk_norm[1]) if lay.qk_norm is not None else (0, 0.0)
            linears += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
            if lay.gate_up is not None:
                linears += [layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
            self.layers.append(lay)
        self.final_norm = _norm_weight(backbone.norm, gemma)
        self.head = _Proj([lm_head])
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.max_rows = _rows_limit(linears)
        self.page_size = pool.page_size
        self.layer_types = sorted({lay.layer_type for lay in self.layers})
        probe = torch.zeros(1, 1, H), torch.zeros(1, 1, dtype=torch.long)
        for lt in self.layer_types:
            cos = self._rope(*probe, lt)[0]
            if any(cos.shape[-1] != lay.d for lay in self.layers if lay.layer_type == lt):
                raise Unsupported(f"{lt}: rotary width {cos.shape[-1]} is not the head_dim (partial rotary)")
        self._cpuinfer = self.layers[0].qkv._pool
        from .. import cpuinfer_ext

        self._ops = cpuinfer_ext.decode_ops
        self._paged = cpuinfer_ext.paged_ops
        self.x, self.h, self.a, self.m = _Buf(H), _Buf(H), _Buf(H), _Buf(H)
        self.qkv = _Buf(max(lay.qkv.group.out_features for lay in self.layers))
        self.att = _Buf(max(lay.hq * lay.d for lay in self.layers))
        self.mid = _Buf(max([lay.gate_up.group.out_features for lay in self.layers if lay.gate_up is not None],
                            default=1))

    @classmethod
    def build(cls, model, pool) -> "BatchDecodeStep | None":
        try:
            return cls(model, pool)
        except Unsupported as e:
            log.debug("lean batched decode step not used: %s", e)
            return None

    def accepts(self, n_rows: int) -> bool:
        """Whether a decode-only step of ``n_rows`` sequences can take this path (no autograd)."""
        return 1 <= n_rows <= self.max_rows and not torch.is_grad_enabled()

    def _rope(self, x, pos_t, layer_type):
        return self.rotary(x, pos_t, layer_type) if self.gemma_rope else self.rotary(x, pos_t)

    @staticmethod
    def _linear(proj: _Proj, n: int, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        proj._call(proj._pool, n, x.data_ptr(), out.data_ptr())
        if proj.bias is not None:
            out.add_(proj.bias)
        return out

    def step(self, tokens: list[int], positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Logits ``[N, vocab]`` of ``tokens[r]`` at ``positions[r]`` appended to the sequence whose
        block table (new page included) is ``tables[r]``; its K/V rows are written into the pages."""
        n, H, ops, paged = len(tokens), self.hidden, self._ops, self._paged
        lin = self._linear
        pos_t = torch.tensor([positions], dtype=torch.long)
        offsets = [0]
        for t in tables:
            offsets.append(offsets[-1] + len(t))
        pages = torch.tensor([p for t in tables for p in t], dtype=torch.long)
        offs = torch.tensor(offsets, dtype=torch.long)
        pos_flat = pos_t[0]
        pages_p, offs_p, pos_p = pages.data_ptr(), offs.data_ptr(), pos_flat.data_ptr()
        x, h, a, m = self.x.rows(n), self.h.rows(n), self.a.rows(n), self.m.rows(n)
        x.copy_(self.embed(torch.tensor([tokens], dtype=torch.long)).reshape(n, H))
        rope = {}
        for lt in self.layer_types:
            cos, sin = self._rope(x[None], pos_t, lt)
            rope[lt] = (cos.reshape(n, -1).float().contiguous(), sin.reshape(n, -1).float().contiguous())
        xp, hp, ap = x.data_ptr(), h.data_ptr(), a.data_ptr()
        first = self.layers[0]
        ops.rms_norm(xp, first.in_norm[2], hp, n, H, 0, first.in_norm[1])
        n_layers = len(self.layers)
        for i, lay in enumerate(self.layers):
            q = lin(lay.qkv, n, h, self.qkv.rows(n, lay.qkv.group.out_features))
            cos, sin = rope[lay.layer_type]
            o_att = self.att.rows(n, lay.hq * lay.d)
            paged.decode_attention(self._cpuinfer, q.data_ptr(), n, lay.hq, lay.hkv, lay.d, lay.qk_ptr, lay.qk_eps,
                                   cos.data_ptr(), sin.data_ptr(), lay.k_ptr, lay.v_ptr, self.page_size, pages_p,
                                   offs_p, pos_p, lay.window, lay.scaling, o_att.data_ptr())
            lin(lay.o, n, o_att, a)
            if lay.gemma:
                paged.residual_norm_rows(xp, ap, lay.post_attn_norm[2], lay.post_attn_norm[1], lay.pre_mlp_norm[2],
                                         lay.pre_mlp_norm[1], hp, n, H)
            else:
                paged.residual_norm_rows(xp, ap, 0, 0.0, lay.pre_mlp_norm[2], lay.pre_mlp_norm[1], hp, n, H)
            if lay.moe is None:
                mid = self.mid.rows(n, lay.gate_up.group.out_features)
                out = lin(lay.down, n, lin(lay.gate_up, n, h, mid), m)
            else:
                out = lay.moe(h.view(1, n, H))
                out = (out[0] if isinstance(out, tuple) else out).reshape(n, H).float().contiguous()
            nxt = self.layers[i + 1].in_norm if i + 1 < n_layers else self.final_norm
            if lay.gemma:
                paged.residual_norm_rows(xp, out.data_ptr(), lay.post_mlp_norm[2], lay.post_mlp_norm[1], nxt[2],
                                         nxt[1], hp, n, H)
            else:
                paged.residual_norm_rows(xp, out.data_ptr(), 0, 0.0, nxt[2], nxt[1], hp, n, H)
        logits = lin(self.head, n, h, torch.empty(n, self.head.group.out_features))
        if self.softcap is not None:
            logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits


__all__ = ["BatchDecodeStep"]
