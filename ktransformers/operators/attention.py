"""DeepSeek multi-head latent attention with weight absorption: ``KDeepseekV2Attention``.

Serves every MLA model transformers builds with the DeepseekV2/V3 attention classes:
DeepSeek-V2, V2-Lite, V3, R1, Kimi-K2 and Moonlight (the last two are ``deepseek_v3``
configs), with and without ``q_lora_rank``.

* **Cache:** the latent, exactly as transformers 5.24 stores it: ``cache.update(c_kv, k_pe,
  layer_idx)`` with ``c_kv [B,1,S,kv_lora_rank]`` (normed) and ``k_pe [B,1,S,rope]`` (roped).
  Works with ``DynamicCache``, ``StaticCache`` and ``generate(cache_implementation="static")``.
* **Decode** (one query token) attends in latent space: ``W_UK`` is folded into the query and
  ``W_UV`` applied after the weighted sum, so no per-head keys or values are ever built.
* **Prefill** expands the latent to per-head keys/values (default) or stays absorbed
  (``absorb_for_prefill: true``).  On the CPU, with the causal mask (none, or the one transformers
  builds for these positions), a prompt row is attended by ``mla.causal_prompt_attention``: keys and
  queries in blocks of 64 positions counted from position 0, every product of a shape fixed by the
  row's position, so the cache and logits are the same bits whether the prompt is read whole, in
  chunks of any size (one token too, inside ``mla.prompt_rows()``, as the ``Generator`` reads it) or
  after a cached prefix.  Other masks (padding), autograd and CUDA tensors: the queries in chunks of
  ``chunk_size`` (reference spelling ``chunck_size`` accepted) so the score matrix stays
  ``[B, H, chunk, S]`` however long the prompt.
* RoPE: V2's complex ``freqs_cis`` and V3's ``(cos, sin)`` incl. ``rope_interleave``; the
  softmax scale is the original module's (``qk_head_dim**-0.5`` times YaRN ``mscale**2``).

The children (``q_a_proj`` … ``o_proj``) are the original's, possibly injected
``KTransformersLinear``s; they are called as modules.  Only ``kv_b_proj``'s dense weight is
read (lazily, on the first forward after loading, and again if its storage changes).
"""

from __future__ import annotations

import torch
from torch import nn

from .base import BaseInjectedModule, KwargSpec
from .kinds import MLA_ATTENTION
from .mla import (
    absorbed_attention,
    apply_mla_rope,
    build_chunk_mask,
    causal_prompt_attention,
    expand_latent,
    expanded_attention,
    is_causal_mask,
    latent_cache_bytes_per_token,
    latent_kernel_attention,
    latent_kernel_serves,
    reading_prompt,
    split_kv_b,
)
from .registry import register

DEFAULT_CHUNK_SIZE = 1000  # the reference system's default


def dense_linear_weight(linear: nn.Module) -> torch.Tensor:
    """The dense ``[out, in]`` weight behind ``linear`` (an ``nn.Linear`` or an injected linear)."""
    op = getattr(linear, "generate_op", None)
    if op is not None:
        dense = getattr(op, "dense_weight", None)
        if callable(dense):
            return dense()
        w = getattr(op, "weight", None)
        if isinstance(w, torch.Tensor):
            return w
    return linear.weight


def _storage_key(linear: nn.Module):
    op = getattr(linear, "generate_op", None)
    if op is None:
        w = linear.weight
        return (id(linear), w.data_ptr(), w.device, w.dtype)
    ts = tuple(v.data_ptr() for v in vars(op).values() if isinstance(v, torch.Tensor))
    return (id(op), ts)


@register("KDeepseekV2Attention")
class KDeepseekV2Attention(BaseInjectedModule):
    """Absorbed MLA for DeepSeek V2/V3/R1, Kimi-K2, Moonlight.

    kwargs: devices, ``chunk_size`` (prefill query chunk, default 1000), ``absorb_for_prefill``
    (unset: latent-space prompt rows where the CPU kernel serves them, expanded elsewhere; ``false``:
    expanded everywhere -- faster prompts at long context, but a decoded token and the same token
    read as a prompt then differ in the last bits; ``true``: latent-space everywhere).
    """

    REPLACES = (MLA_ATTENTION,)
    KWARGS = {
        "chunk_size": KwargSpec((int,), DEFAULT_CHUNK_SIZE, "prefill query chunk length"),
        "absorb_for_prefill": KwargSpec((bool,), None, "prompt rows attend in latent space too (default: on "
                                                       "the CPU kernel yes -- a decoded token then has the bits "
                                                       "it has read as a prompt --, elsewhere no)"),
    }

    def __init__(self, key, gguf_loader=None, config=None, orig_module=None, prefill_device=None,
                 generate_device=None, chunk_size=None, absorb_for_prefill=None, **kwargs):
        super().__init__(key, gguf_loader, config, orig_module, prefill_device, generate_device, **kwargs)
        o = orig_module
        size = int(chunk_size) if chunk_size is not None else DEFAULT_CHUNK_SIZE
        if size < 1:
            from ..errors import RuleError

            raise RuleError(f"{key}: chunk_size must be >= 1, got {size}")
        cfg = config if config is not None else o.config
        fields = dict(
            chunk_size=size,
            absorb_for_prefill=None if absorb_for_prefill is None else bool(absorb_for_prefill),
            absorb_decode=True,  # False: decode expands too (for measurements)
            layer_idx=o.layer_idx,
            num_heads=int(o.num_heads),
            q_lora_rank=o.q_lora_rank,
            kv_lora_rank=int(o.kv_lora_rank),
            qk_nope_head_dim=int(o.qk_nope_head_dim),
            qk_rope_head_dim=int(o.qk_rope_head_dim),
            qk_head_dim=int(o.qk_head_dim),
            v_head_dim=int(o.v_head_dim),
            scaling=float(o.scaling),
            rope_interleave=bool(getattr(cfg, "rope_interleave", True)),
            _absorb_key=None,
            _w_kvb=None,
            _w_uk=None,
            _w_uv=None,
        )
        for k, v in fields.items():
            object.__setattr__(self, k, v)

    # -- weights ------------------------------------------------------------------------
    def absorb_weights(self, device: torch.device, dtype: torch.dtype):
        """(W_UK [H,nope,C], W_UV [H,v,C]) on ``device``/``dtype``; recomputed when
        ``kv_b_proj``'s storage changed (weights are loaded after construction)."""
        key = (_storage_key(self.kv_b_proj), device, dtype)
        if key != self._absorb_key:
            w = dense_linear_weight(self.kv_b_proj)
            if w.device.type == "meta":
                raise RuntimeError(
                    f"{self.key}: kv_b_proj has no dense weight (not loaded yet, or its op keeps only quantized "
                    f"data); leave kv_b_proj a plain nn.Linear or give it KLinearTorch/KLinearFP8")
            w = w.to(device=device, dtype=dtype)
            w_uk, w_uv = split_kv_b(w, self.num_heads, self.qk_nope_head_dim, self.v_head_dim)
            object.__setattr__(self, "_w_kvb", w)
            object.__setattr__(self, "_w_uk", w_uk)
            object.__setattr__(self, "_w_uv", w_uv)
            object.__setattr__(self, "_absorb_key", key)
        return self._w_uk, self._w_uv

    def latent_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK ``[H, nope, C]``, W_UV transposed ``[H, C, v]``), fp32 contiguous on the CPU: the
        form the latent kernel (``mla.latent_kernel_attention``) reads; made once per ``kv_b_proj``
        storage."""
        w_uk, w_uv = self.absorb_weights(torch.device("cpu"), torch.float32)
        got = self.__dict__.get("_latent_w")
        if got is None or got[0] is not w_uk:
            got = (w_uk, w_uk.contiguous(), w_uv.transpose(-1, -2).contiguous())
            object.__setattr__(self, "_latent_w", got)
        return got[1], got[2]

    def kv_b_weight(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """``kv_b_proj``'s dense weight ``[H*(nope+v), C]`` on ``device``/``dtype`` (W_UK and W_UV's base)."""
        self.absorb_weights(device, dtype)
        return self._w_kvb

    def latent_cache_bytes_per_token(self, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
        return latent_cache_bytes_per_token(self.config, dtype)

    # -- forward ------------------------------------------------------------------------
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        B, q_len = hidden_states.shape[:-1]
        H = self.num_heads
        nope, rope = self.qk_nope_head_dim, self.qk_rope_head_dim
        mods = self._modules
        if self.q_lora_rank is None:
            q = mods["q_proj"](hidden_states)
        else:
            q = mods["q_b_proj"](mods["q_a_layernorm"](mods["q_a_proj"](hidden_states)))
        q = q.view(B, q_len, H, self.qk_head_dim).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)

        ckv = mods["kv_a_proj_with_mqa"](hidden_states)
        c_kv, k_pe = torch.split(ckv, [self.kv_lora_rank, rope], dim=-1)
        c_kv = mods["kv_a_layernorm"](c_kv).view(B, 1, q_len, self.kv_lora_rank)
        k_pe = k_pe.view(B, 1, q_len, rope)
        q_pe, k_pe = apply_mla_rope(q_pe, k_pe, position_embeddings, self.rope_interleave)

        if getattr(cache, "is_paged_batch", False):  # BatchRunner.step: latent pages, per-sequence attention
            o = cache.mla_attention(self, q_nope, q_pe, c_kv, k_pe)
            o = o.transpose(1, 2).reshape(B, q_len, H * self.v_head_dim).to(hidden_states.dtype)
            return mods["o_proj"](o), None

        if cache is not None:
            c_kv, k_pe = cache.update(c_kv, k_pe, self.layer_idx, kwargs=kwargs)
            valid = int(cache.get_seq_length(self.layer_idx))
            if valid < c_kv.shape[-2]:  # static cache: only the written prefix is real
                c_kv = c_kv[:, :, :valid]
                k_pe = k_pe[:, :, :valid]
        kv_len = c_kv.shape[-2]
        if attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[-1] < kv_len:
            raise ValueError(f"{self.key}: attention mask covers {attention_mask.shape[-1]} keys, cache holds {kv_len}")

        w_uk, w_uv = self.absorb_weights(c_kv.device, c_kv.dtype)
        q_nope = q_nope.to(c_kv.dtype)
        q_pe = q_pe.to(k_pe.dtype)
        prompt = q_len > 1 or reading_prompt()
        if (B == 1 and (self.absorb_for_prefill is not False if prompt else self.absorb_decode)
                and latent_kernel_serves(self.kv_lora_rank, rope, q_nope, q_pe, c_kv, k_pe)
                and is_causal_mask(attention_mask, kv_len - q_len, q_len, kv_len)):
            # prompt and decode rows alike on the CPU kernel: a row's bits whatever way it is read
            o = latent_kernel_attention(q_nope, q_pe, c_kv[0, 0], k_pe[0, 0], *self.latent_weights(),
                                        kv_len - q_len, self.scaling)
            o = o.transpose(1, 2).reshape(B, q_len, H * self.v_head_dim).to(hidden_states.dtype)
            return mods["o_proj"](o), None
        decoding = q_len == 1 and self.absorb_decode and not reading_prompt()
        training = torch.is_grad_enabled() and (q_nope.requires_grad or c_kv.requires_grad)
        if (not decoding and not training and c_kv.device.type == "cpu"
                and is_causal_mask(attention_mask, kv_len - q_len, q_len, kv_len)):
            # prompt rows (and verify chunks): the same bits for a row whatever the chunk it comes in
            o = causal_prompt_attention(q_nope, q_pe, c_kv, k_pe, self._w_kvb, H, self.scaling, kv_len - q_len,
                                        absorbed=bool(self.absorb_for_prefill))
            o = o.transpose(1, 2).reshape(B, q_len, H * self.v_head_dim).to(hidden_states.dtype)
            return mods["o_proj"](o), None
        absorbed = (q_len == 1 and self.absorb_decode) or bool(self.absorb_for_prefill)
        if not absorbed:
            k_nope_all, v_all = expand_latent(c_kv, w_uk, w_uv)

        outs = []
        step = self.chunk_size
        for s in range(0, q_len, step):
            e = min(s + step, q_len)
            # without an explicit mask the attention is causal: keys past the chunk are unseen
            hi = kv_len if attention_mask is not None else kv_len - q_len + e
            mask = build_chunk_mask(attention_mask, s, e, hi, q_len, kv_len)
            if absorbed:
                o = absorbed_attention(q_nope[:, :, s:e], q_pe[:, :, s:e], c_kv[:, :, :hi], k_pe[:, :, :hi],
                                       w_uk, w_uv, self.scaling, mask)
            else:
                o = expanded_attention(q_nope[:, :, s:e], q_pe[:, :, s:e], k_nope_all[:, :, :hi], k_pe[:, :, :hi],
                                       v_all[:, :, :hi], self.scaling, mask)
            outs.append(o)
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        o = o.transpose(1, 2).reshape(B, q_len, H * self.v_head_dim).to(hidden_states.dtype)
        return mods["o_proj"](o), None


__all__ = ["KDeepseekV2Attention", "dense_linear_weight", "latent_cache_bytes_per_token"]
