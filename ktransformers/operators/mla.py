"""Multi-head latent attention (MLA) helpers: RoPE forms, the kv_b split, masked attention
over the latent (absorbed) or expanded keys, and KV-cache size arithmetic.

Shapes (DeepSeek-V2/V3 naming): ``H`` heads, ``nope = qk_nope_head_dim``, ``rope =
qk_rope_head_dim``, ``v = v_head_dim``, ``C = kv_lora_rank``.  The cache holds per layer
``c_kv [B, 1, S, C]`` (normed latent) and ``k_pe [B, 1, S, rope]`` (roped shared key).

``kv_b_proj.weight`` is ``[H * (nope + v), C]``; viewed as ``[H, nope + v, C]`` its first
``nope`` rows per head are the key up-projection ``W_UK [H, nope, C]`` and the rest the value
up-projection ``W_UV [H, v, C]``.  Then for one head::

    q_nope · k_nope = q_nope · (W_UK c) = (W_UKᵀ q_nope) · c      (absorb into the query)
    o = Σ p · (W_UV c) = W_UV (Σ p · c)                         (absorb into the output)

so decode attends directly over the cached latent: one shared "key" ``[c, k_pe]`` of width
``C + rope`` and one shared "value" ``c`` of width ``C`` for all heads (MQA-like).
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

# ------------------------------------------------------------------------------- RoPE


def rope_interleaved_cos_sin(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 ``rope_interleave``: pairs (x0,x1),(x2,x3)… rotated, output de-interleaved
    (evens-rotated then odds-rotated) exactly like transformers' ``apply_rotary_pos_emb_interleave``.
    ``x [B, h, S, d]``, ``cos/sin [B, S, d]`` (``cat(freqs, freqs)``)."""
    half = cos.shape[-1] // 2
    c = cos[..., :half].unsqueeze(1)
    s = sin[..., :half].unsqueeze(1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style RoPE (``rotate_half``) with ``cos/sin [B, S, d]``."""
    c = cos.unsqueeze(1)
    s = sin.unsqueeze(1)
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rot * s


def rope_complex(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2 complex form: ``freqs_cis [B, S, d/2]`` complex (already YaRN-scaled)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis.unsqueeze(1).to(xc.device)).flatten(3)
    return out.type_as(x)


def apply_mla_rope(q_pe, k_pe, position_embeddings, interleave: bool):
    """RoPE on ``q_pe [B,H,S,rope]`` and ``k_pe [B,1,S,rope]`` for either form of
    ``position_embeddings`` (complex tensor: V2; ``(cos, sin)``: V3)."""
    if isinstance(position_embeddings, torch.Tensor) and position_embeddings.is_complex():
        return rope_complex(q_pe, position_embeddings), rope_complex(k_pe, position_embeddings)
    cos, sin = position_embeddings
    cos = cos.to(q_pe.dtype)
    sin = sin.to(q_pe.dtype)
    fn = rope_interleaved_cos_sin if interleave else rope_half
    return fn(q_pe, cos, sin), fn(k_pe, cos, sin)


# --------------------------------------------------------------------------- kv_b split


def split_kv_b(kv_b_weight: torch.Tensor, num_heads: int, nope: int, v: int):
    """(W_UK [H, nope, C], W_UV [H, v, C]) as views of ``kv_b_proj.weight`` (no copy)."""
    C = kv_b_weight.shape[-1]
    w = kv_b_weight.view(num_heads, nope + v, C)
    return w[:, :nope, :], w[:, nope:, :]


# ------------------------------------------------------------------------------ masking


def build_chunk_mask(attention_mask, q_start: int, q_end: int, kv_len: int, q_len: int, valid_len: int):
    """Boolean keep-mask ``[B|1, 1, q_end-q_start, kv_len]`` or an additive float mask for one
    query chunk, or None for "no restriction beyond ``kv_len``".

    * ``attention_mask`` None: causal, aligned bottom-right: query ``i`` of this call sits at
      absolute position ``valid_len - q_len + i`` and sees keys ``<=`` that position.
    * 4-D mask (bool keep-mask, or additive float): sliced to the chunk and ``kv_len``.
    * 2-D padding mask ``[B, >=kv_len]`` (1 = real token): combined with the causal rule.
    """
    if attention_mask is None or attention_mask.dim() == 2:
        offset = valid_len - q_len
        qpos = torch.arange(q_start, q_end, device=_dev(attention_mask)) + offset
        kpos = torch.arange(kv_len, device=qpos.device)
        keep = (kpos[None, :] <= qpos[:, None])[None, None]
        if attention_mask is not None:
            pad = attention_mask[:, :kv_len].to(torch.bool)[:, None, None, :]
            keep = keep & pad
        elif q_end - q_start == 1 and kv_len <= offset + q_start + 1:
            return None  # a single query seeing every key
        return keep
    m = attention_mask[..., q_start:q_end, :kv_len] if attention_mask.shape[-2] > 1 else attention_mask[..., :kv_len]
    return m


def _dev(t):
    return t.device if t is not None else None


def apply_mask(scores: torch.Tensor, mask) -> torch.Tensor:
    """``scores`` fp32 ``[B,H,q,k]``; masked entries get the most negative finite value so a
    fully masked row (a left-pad query) stays finite (uniform) instead of NaN."""
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask.to(scores.device), torch.finfo(scores.dtype).min)
    return (scores + mask.to(device=scores.device, dtype=scores.dtype)).clamp_min(torch.finfo(scores.dtype).min)


# ---------------------------------------------------------------------------- attention


def absorbed_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale: float, mask) -> torch.Tensor:
    """Latent-space attention.  ``q_nope [B,H,q,nope]``, ``q_pe [B,H,q,rope]``,
    ``c_kv [B,1,S,C]``, ``k_pe [B,1,S,rope]``; returns ``[B,H,q,v]``."""
    q_abs = torch.matmul(q_nope, w_uk)  # [B,H,q,C]
    scores = torch.matmul(q_abs, c_kv.transpose(-1, -2))
    scores = scores + torch.matmul(q_pe, k_pe.transpose(-1, -2))
    scores = apply_mask(scores.float() * scale, mask)
    probs = torch.softmax(scores, dim=-1).to(c_kv.dtype)
    o_lat = torch.matmul(probs, c_kv)  # [B,H,q,C]
    return torch.matmul(o_lat, w_uv.transpose(-1, -2))  # [B,H,q,v]


def absorbed_decode_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale: float, mask) -> torch.Tensor:
    """Latent-space attention of ONE query token per row over that row's own latent (batched decode).
    ``q_nope [N,H,1,nope]``, ``q_pe [N,H,1,rope]``, ``c_kv [N,1,L,C]``, ``k_pe [N,1,L,rope]``, ``mask``
    None or ``[N,1,1,L]``; returns ``[N,H,1,v]``.  Same maths as ``absorbed_attention``, but the heads
    are the rows of one ``[H, L]`` score matrix per sequence and the absorptions are per-head ``bmm``s,
    so neither the latent nor ``W_UK``/``W_UV`` is broadcast (copied) over heads or rows."""
    q_abs = torch.bmm(q_nope[:, :, 0].transpose(0, 1), w_uk)  # [H,N,C]
    qa = q_abs.transpose(0, 1).unsqueeze(1)  # [N,1,H,C]
    qp = q_pe[:, :, 0].unsqueeze(1)  # [N,1,H,rope]
    scores = torch.matmul(qa, c_kv.transpose(-1, -2)) + torch.matmul(qp, k_pe.transpose(-1, -2))  # [N,1,H,L]
    scores = apply_mask(scores.float() * scale, mask)
    probs = torch.softmax(scores, dim=-1).to(c_kv.dtype)
    o_lat = torch.matmul(probs, c_kv)  # [N,1,H,C]
    o = torch.bmm(o_lat[:, 0].transpose(0, 1), w_uv.transpose(-1, -2))  # [H,N,v]
    return o.transpose(0, 1).unsqueeze(2)


# ------------------------------------------------- the CPU kernel: prompt and decode rows alike


def latent_kernel_serves(C: int, rope: int, *tensors: torch.Tensor) -> bool:
    """Whether :func:`latent_kernel_attention` serves these rows: fp32 CPU tensors without autograd,
    the prompt flash kernel on (``KT_FLASH_ATTN`` not ``0``), a tier that reads latent width ``C``
    and rope width ``rope`` (``kernels.mla_attention_supported``)."""
    from .cpu_attention import flash_mode

    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if any(t.dtype is not torch.float32 or t.device.type != "cpu" for t in tensors):
        return False
    if flash_mode() is None:
        return False
    from ..kernels.attention import mla_attention_supported

    return mla_attention_supported(C, rope)


def latent_kernel_attention(q_nope, q_pe, latent, rope_key, w_uk, w_uv_t, start: int, scale: float,
                            table=None, page_size: int = 0, out=None) -> torch.Tensor:
    """MLA of the rows ``q_nope [1, H, T, nope]`` / ``q_pe [1, H, T, rope]`` at positions ``start ..``
    over the latent rows ``latent [S, C]`` / ``rope_key [S, rope]`` (a cache's, or a page pool's with
    ``table``) on the CPU kernel (``kernels.mla_attention``): absorbed, one fma chain per product, the
    flash kernel's softmax.  A row's bits are the same read as a prompt row, in a chunk of any size,
    or as a decode row -- so a decoded answer read back as a prompt, or found in the prefix cache,
    gives the bits it was decoded with.  Returns ``[1, H, T, v]`` (a view of ``out [T, H, v]``)."""
    from ..kernels.attention import mla_attention
    from .cpu_threads import kernel_pool

    o = mla_attention(kernel_pool(), q_nope[0].transpose(0, 1), q_pe[0].transpose(0, 1), latent, rope_key, w_uk,
                      w_uv_t, start, scale, out=out, table=table, page_size=page_size)
    return o.transpose(0, 1).unsqueeze(0)


# ------------------------------------------------------------- chunk-invariant prompt rows

#: Query rows and keys are cut into blocks of this many positions, counted from position 0.
PROMPT_BLOCK = 64

_PROMPT_ROWS: contextvars.ContextVar[bool] = contextvars.ContextVar("kt_mla_prompt_rows", default=False)


@contextlib.contextmanager
def prompt_rows():
    """Within this context a one-token forward of ``KDeepseekV2Attention`` is a prompt row (the
    ``Generator`` reading a prompt in chunks of one), attended like any other prompt row by
    :func:`causal_prompt_attention`, not by the absorbed decode attention."""
    token = _PROMPT_ROWS.set(True)
    try:
        yield
    finally:
        _PROMPT_ROWS.reset(token)


def reading_prompt() -> bool:
    """Whether the current forward reads prompt rows (see :func:`prompt_rows`)."""
    return _PROMPT_ROWS.get()


def is_causal_mask(mask, start: int, q_len: int, kv_len: int) -> bool:
    """Whether ``mask`` (None, a 2-D padding mask, or a 4-D bool / additive mask over at least
    ``kv_len`` keys) lets query ``i`` (position ``start + i``) see exactly the keys ``<= start + i``
    of the ``kv_len`` cached ones."""
    if mask is None:
        return True
    if mask.dim() == 2:
        return mask.shape[-1] >= kv_len and bool(mask[:, :kv_len].to(torch.bool).all())
    if mask.dim() != 4 or mask.shape[-1] < kv_len or mask.shape[-2] != q_len or mask.shape[1] != 1:
        return False
    keep = mask[..., :kv_len] if mask.dtype == torch.bool else mask[..., :kv_len] == 0
    want = torch.arange(kv_len, device=mask.device)[None, :] <= torch.arange(start, start + q_len,
                                                                            device=mask.device)[:, None]
    return bool((keep == want).all())


def causal_prompt_attention(q_nope, q_pe, c_kv, k_pe, kv_b_weight, num_heads: int, scale: float, start: int,
                            absorbed: bool = False, block: int = PROMPT_BLOCK) -> torch.Tensor:
    """Causal MLA attention of prompt rows at positions ``start .. start+T-1`` over the latent keys
    ``0 .. start+T-1``, the same bits for a row whatever the chunk it comes in.

    ``q_nope [B,H,T,nope]``, ``q_pe [B,H,T,rope]``, ``c_kv [B,1,>=start+T,C]``, ``k_pe [B,1,>=start+T,rope]``,
    ``kv_b_weight [H*(nope+v), C]``; returns ``[B,H,T,v]``.

    Every product has a shape fixed by the row's position alone: the keys are expanded (``kv_b_proj``)
    in blocks of ``block`` latent rows from position 0 (the last one zero-padded); the queries go in
    blocks of ``block`` rows aligned to multiples of ``block`` (a chunk's partial blocks zero-padded),
    and block ``b`` attends to the keys ``0 .. (b+1)*block - 1`` (the diagonal block's future keys
    masked, so a padded key has probability 0): scores, softmax and value sums of one length and one
    shape whether the prompt came whole, in chunks, or after a cached prefix.  ``absorbed``: the
    scores against the latent (``W_UK`` into the query, ``W_UV`` after the sum), as
    :func:`absorbed_attention`, in the same blocks."""
    B, H, T, nope = q_nope.shape
    rope = q_pe.shape[-1]
    C = c_kv.shape[-1]
    v = kv_b_weight.shape[0] // num_heads - nope
    dt = c_kv.dtype
    end = start + T
    if T == 0:
        return q_nope.new_empty(B, H, 0, v)
    if c_kv.shape[-2] < end or k_pe.shape[-2] < end:
        raise ValueError(f"causal_prompt_attention: {c_kv.shape[-2]} cached keys, rows reach position {end}")
    first, last = start // block, (end - 1) // block
    Lp = (last + 1) * block
    lat = c_kv.new_zeros(B, Lp, C + rope)  # [c, k_pe] of the visible keys, zero past the chunk
    lat[:, :end, :C] = c_kv[:, 0, :end]
    lat[:, :end, C:] = k_pe[:, 0, :end].to(dt)
    w = kv_b_weight.to(dt)
    pe_t = lat[:, :, C:].transpose(1, 2)  # [B, rope, Lp]: the shared rope key, one product for all heads
    if absorbed:
        w3 = w.view(H, nope + v, C)
        w_uk, w_uv = w3[:, :nope], w3[:, nope:]
        lat_t = lat[:, :, :C].transpose(1, 2)  # [B, C, Lp]
    else:  # per-head keys and values, token-major as kv_b_proj writes them: [B, Lp, H, nope + v]
        kv = c_kv.new_empty(B, Lp, H, nope + v)
        for j in range(0, Lp, block):
            kv[:, j:j + block] = torch.nn.functional.linear(lat[:, j:j + block, :C], w).view(B, block, H, nope + v)
        k_nope = kv[..., :nope].permute(0, 2, 1, 3)  # [B, H, Lp, nope] views
        vals = kv[..., nope:].permute(0, 2, 1, 3)
    future = torch.ones(block, block, dtype=torch.bool, device=c_kv.device).triu_(1)
    out = q_nope.new_empty(B, H, T, v)
    lo_min = torch.finfo(torch.float32).min
    for b in range(first, last + 1):
        r0, r1 = b * block, (b + 1) * block
        lo, hi = max(start, r0), min(end, r1)
        qn = c_kv.new_zeros(B, H, block, nope)
        qp = c_kv.new_zeros(B, H, block, rope)
        qn[:, :, lo - r0:hi - r0] = q_nope[:, :, lo - start:hi - start]
        qp[:, :, lo - r0:hi - r0] = q_pe[:, :, lo - start:hi - start]
        rope_scores = torch.matmul(qp.view(B, H * block, rope), pe_t[:, :, :r1]).view(B, H, block, r1)
        if absorbed:
            qa = torch.matmul(qn, w_uk)  # [B, H, blk, C]
            scores = torch.matmul(qa.view(B, H * block, C), lat_t[:, :, :r1]).view(B, H, block, r1)
        else:
            scores = torch.matmul(qn, k_nope[:, :, :r1].transpose(-1, -2))  # [B, H, blk, r1]
        scores = (scores + rope_scores).float() * scale
        scores[..., r0:r1].masked_fill_(future, lo_min)
        probs = torch.softmax(scores, dim=-1).to(dt)
        if absorbed:
            o_lat = torch.matmul(probs.view(B, H * block, r1), lat[:, :r1, :C]).view(B, H, block, C)
            o = torch.matmul(o_lat, w_uv.transpose(-1, -2))
        else:
            o = torch.matmul(probs, vals[:, :, :r1])
        out[:, :, lo - start:hi - start] = o[:, :, lo - r0:hi - r0].to(out.dtype)
    return out


def expand_latent(c_kv, w_uk, w_uv):
    """``c_kv [B,1,S,C]`` -> (k_nope [B,H,S,nope], value [B,H,S,v])."""
    return torch.matmul(c_kv, w_uk.transpose(-1, -2)), torch.matmul(c_kv, w_uv.transpose(-1, -2))


def expanded_attention(q_nope, q_pe, k_nope, k_pe, value, scale: float, mask) -> torch.Tensor:
    """Ordinary per-head attention over expanded keys; returns ``[B,H,q,v]``."""
    scores = torch.matmul(q_nope, k_nope.transpose(-1, -2))
    scores = scores + torch.matmul(q_pe, k_pe.transpose(-1, -2))
    scores = apply_mask(scores.float() * scale, mask)
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    return torch.matmul(probs, value)


# --------------------------------------------------------------------------- cache size


def latent_cache_bytes_per_token(config, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """(latent bytes, expanded-equivalent bytes) of KV cache per token over all layers.

    Latent: ``kv_lora_rank + qk_rope_head_dim`` values per layer (what this attention and
    transformers 5.24's MLA cache store).  Expanded equivalent: full per-head keys
    (``nope + rope``) and values (``v``) for every head, as a conventional MHA cache would.
    """
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    elt = torch.empty((), dtype=dtype).element_size()
    layers = int(cfg.num_hidden_layers)
    latent = layers * (int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim)) * elt
    heads = int(cfg.num_attention_heads)
    expanded = layers * heads * (int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim) + int(cfg.v_head_dim)) * elt
    return latent, expanded
