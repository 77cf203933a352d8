"""Causal prompt attention on the CPU (``csrc/flash_attn*.cpp``: AVX512-BF16 and up, and AVX2 + FMA):
one pass over the keys each block of queries sees, online softmax, no score matrix in memory; fp32
throughout, or (``bf16_pv``, AVX512-BF16 tiers) the probability-times-value product on bf16 pairs,
~2e-3 relative error on the output.  The keys may sit in a cache tensor or in a page pool
(:func:`flash_attention_paged`): the same bits for a row either way, and whatever chunk it came in.
``bench/attention.py`` prints both next to torch's own CPU flash kernel.
"""

from __future__ import annotations

import torch

from .. import cpuinfer_ext as _ext
from .pool import CPUInfer


def flash_attention_supported() -> bool:
    """Whether the CPU tier in force runs :func:`flash_attention` (AVX2 + FMA and up)."""
    return bool(_ext.flash_attn_supported())


def same_kv_strides(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether k and v ``[B, Hkv, S, D]`` are read with the same head and token strides (the kernel
    takes one pair): a stride of a dimension of size 1 is never used, so it may differ (one KV head
    cut from a concatenation, Gemma-3's sliding layers)."""
    return (k.shape == v.shape and k.stride(2) == v.stride(2) and k.stride(3) == v.stride(3)
            and (k.shape[1] == 1 or k.stride(1) == v.stride(1)))


def flash_attention(pool: CPUInfer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                    scale: float, window: int = 0, out: torch.Tensor | None = None,
                    bf16_pv: bool = False, key_first: int = 0) -> torch.Tensor:
    """Causal attention of ``T`` queries at positions ``start .. start+T-1`` over the keys ``0 ..
    start+T-1`` (and, with ``window`` > 0, only the last ``window`` of them up to each query).

    ``q [1, H, T, D]``, ``k`` / ``v [1, Hkv, S, D]`` holding positions ``key_first ..`` (S >= start +
    T - key_first; slots past that are not read; ``key_first`` > 0: a sliding window that rolled, at
    most the first position a query sees),
    fp32 CPU tensors with a contiguous last dimension (any other strides); ``D`` a multiple of 64 up
    to 512, ``H`` a multiple of ``Hkv``.  Returns ``out [1, T, H, D]`` (transformers' attention output
    layout).  ``bf16_pv``: round probabilities and values to bf16 for the second product (faster;
    AVX512-BF16 tiers, ignored below them).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[0] != 1 or k.shape != v.shape or k.shape[0] != 1:
        raise ValueError(f"flash_attention: need q [1, H, T, D] and k, v [1, Hkv, S, D], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    _, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    lo = max(0, start - window + 1) if window else 0
    if (k.shape[3] != D or H % Hkv or D % 64 or D > 512 or start < 0 or start + T - key_first > S
            or not 0 <= key_first <= lo):
        raise ValueError(f"flash_attention: H {H} must be a multiple of Hkv {Hkv}, D {D} a multiple of 64 up to 512, "
                         f"keys {S} >= start {start} + T {T} - key_first {key_first}, key_first within 0 .. {lo}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(3) != 1:
            raise ValueError(f"flash_attention: {name} must be float32 on the CPU with a contiguous last dim")
    if not same_kv_strides(k, v):
        raise ValueError("flash_attention: k and v must have the same strides")
    if out is None:
        out = torch.empty(1, T, H, D, dtype=torch.float32)
    elif out.shape != (1, T, H, D) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"flash_attention: out must be a contiguous float32 [1, {T}, {H}, {D}]")
    _ext.flash_attn_prefill(pool._c, q.data_ptr(), q.stride(2), q.stride(1), k.data_ptr(), v.data_ptr(),
                            k.stride(1), k.stride(2), out.data_ptr(), H * D, D, H, Hkv, T, D, int(start),
                            int(window), float(scale), bool(bf16_pv), 0, 0, int(key_first))
    return out


def flash_attention_paged(pool: CPUInfer, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                          table: torch.Tensor, page_size: int, start: int, scale: float, window: int = 0,
                          out: torch.Tensor | None = None, bf16_pv: bool = False) -> torch.Tensor:
    """:func:`flash_attention` with the sequence's keys in a page pool: ``keys`` / ``values``
    ``[slots, Hkv, D]`` (contiguous fp32), key ``j`` at slot ``table[j // page_size] * page_size + j %
    page_size`` (``table``: int64 block table covering ``start + T`` keys).  The same bits as
    :func:`flash_attention` over the same keys in a cache: where the keys sit is only addressing."""
    if q.dim() != 4 or q.shape[0] != 1 or keys.dim() != 3 or keys.shape != values.shape:
        raise ValueError(f"flash_attention_paged: need q [1, H, T, D] and keys, values [slots, Hkv, D], got "
                         f"{tuple(q.shape)}, {tuple(keys.shape)}, {tuple(values.shape)}")
    _, H, T, D = q.shape
    Hkv = keys.shape[1]
    if (keys.shape[2] != D or H % Hkv or D % 64 or D > 512 or start < 0 or page_size < 1
            or table.dtype != torch.int64 or not table.is_contiguous() or table.numel() * page_size < start + T):
        raise ValueError(f"flash_attention_paged: H {H} must be a multiple of Hkv {Hkv}, D {D} a multiple of 64 up to "
                         f"512, and the int64 block table must cover start {start} + T {T} keys")
    for name, t in (("q", q), ("keys", keys), ("values", values)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError(f"flash_attention_paged: {name} must be float32 on the CPU with a contiguous last dim")
    if not (keys.is_contiguous() and values.is_contiguous()):
        raise ValueError("flash_attention_paged: keys and values must be contiguous page pools")
    used = table[: -(-(start + T) // page_size)]
    if int(used.min()) < 0 or int(used.max()) >= keys.shape[0] // page_size:
        raise ValueError(f"flash_attention_paged: a page id of the block table is outside the pool's "
                         f"{keys.shape[0] // page_size} pages")
    if out is None:
        out = torch.empty(1, T, H, D, dtype=torch.float32)
    elif tuple(out.shape[-3:]) != (T, H, D) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"flash_attention_paged: out must be a contiguous float32 [.., {T}, {H}, {D}]")
    _ext.flash_attn_prefill(pool._c, q.data_ptr(), q.stride(2), q.stride(1), keys.data_ptr(), values.data_ptr(),
                            D, Hkv * D, out.data_ptr(), H * D, D, H, Hkv, T, D, int(start), int(window), float(scale),
                            bool(bf16_pv), table.data_ptr(), int(page_size))
    return out


def mla_attention_supported(kv_lora_rank: int, rope: int) -> bool:
    """Whether the CPU tier in force runs :func:`mla_attention` for these widths (AVX2 + FMA and up;
    ``kv_lora_rank`` a multiple of 64 up to 512, ``rope`` a positive multiple of 8: 512 and 64 on
    DeepSeek-V2/V3 and Kimi)."""
    return bool(_ext.mla_attention_supported(int(kv_lora_rank), int(rope)))


def mla_attention(pool: CPUInfer, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                  rope_key: torch.Tensor, w_uk: torch.Tensor, w_uv_t: torch.Tensor, start: int, scale: float,
                  out: torch.Tensor | None = None, table: torch.Tensor | None = None,
                  page_size: int = 0) -> torch.Tensor:
    """Multi-head latent attention in latent space of ``T`` query rows at positions ``start ..
    start+T-1`` over the latent keys ``0 .. start+T-1`` (causal).

    ``q_nope [T, H, nope]``, ``q_pe [T, H, R]`` (fp32, contiguous last dim, any row / head strides);
    ``latent [S, C]`` and ``rope_key [S, R]`` (rows of the cache, or page-pool slots with ``table`` /
    ``page_size``); ``w_uk [H, nope, C]`` and ``w_uv_t [H, C, v]`` contiguous.  Per head: the query
    ``[q_nope W_UK | q_pe]``, softmax of ``scale`` times its dot with ``[c_j | r_j]``, the weighted
    latent times ``W_UV^T``.  Returns ``out [T, H, v]``.  A row's bits depend on its own query and
    keys only: not on ``T``, the chunk it came in, the threads, or cache vs pages (``csrc/flash_attn.h``)."""
    if q_nope.dim() != 3 or q_pe.dim() != 3 or latent.dim() != 2 or rope_key.dim() != 2 or w_uk.dim() != 3 \
            or w_uv_t.dim() != 3:
        raise ValueError(f"mla_attention: need q_nope [T, H, nope], q_pe [T, H, R], latent [S, C], rope_key [S, R], "
                         f"w_uk [H, nope, C], w_uv_t [H, C, v]; got {tuple(q_nope.shape)}, {tuple(q_pe.shape)}, "
                         f"{tuple(latent.shape)}, {tuple(rope_key.shape)}, {tuple(w_uk.shape)}, {tuple(w_uv_t.shape)}")
    T, H, nope = q_nope.shape
    R, C, v = q_pe.shape[2], latent.shape[1], w_uv_t.shape[2]
    if (tuple(q_pe.shape[:2]) != (T, H) or rope_key.shape[1] != R or tuple(w_uk.shape) != (H, nope, C)
            or tuple(w_uv_t.shape[:2]) != (H, C) or T < 1 or start < 0):
        raise ValueError(f"mla_attention: shapes disagree (q_nope {tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, "
                         f"latent {tuple(latent.shape)}, rope_key {tuple(rope_key.shape)}, w_uk {tuple(w_uk.shape)}, "
                         f"w_uv_t {tuple(w_uv_t.shape)}, start {start})")
    if not mla_attention_supported(C, R):
        raise ValueError(f"mla_attention: latent width {C} / rope width {R} not served on this tier "
                         f"(need AVX2 + FMA, C a multiple of 64 up to 512, R a positive multiple of 8)")
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("latent", latent), ("rope_key", rope_key), ("w_uk", w_uk),
                    ("w_uv_t", w_uv_t)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError(f"mla_attention: {name} must be float32 on the CPU with a contiguous last dim")
    if not (w_uk.is_contiguous() and w_uv_t.is_contiguous()):
        raise ValueError("mla_attention: w_uk and w_uv_t must be contiguous")
    pages = 0
    if table is not None:
        if page_size < 1 or table.dtype != torch.int64 or not table.is_contiguous() \
                or table.numel() * page_size < start + T:
            raise ValueError(f"mla_attention: the int64 block table must cover start {start} + T {T} keys")
        used = table[: -(-(start + T) // page_size)]
        if int(used.min()) < 0 or int(used.max()) >= min(latent.shape[0], rope_key.shape[0]) // page_size:
            raise ValueError("mla_attention: a page id of the block table is outside the pool")
        pages = table.data_ptr()
    elif min(latent.shape[0], rope_key.shape[0]) < start + T:
        raise ValueError(f"mla_attention: {min(latent.shape[0], rope_key.shape[0])} cached keys, rows reach "
                         f"position {start + T}")
    if out is None:
        out = torch.empty(T, H, v, dtype=torch.float32)
    elif tuple(out.shape) != (T, H, v) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"mla_attention: out must be float32 [{T}, {H}, {v}] with a contiguous last dim")
    _ext.mla_attention(pool._c, q_nope.data_ptr(), q_nope.stride(0), q_nope.stride(1), q_pe.data_ptr(),
                       q_pe.stride(0), q_pe.stride(1), latent.data_ptr(), latent.stride(0), rope_key.data_ptr(),
                       rope_key.stride(0), w_uk.data_ptr(), w_uv_t.data_ptr(), out.data_ptr(), out.stride(0),
                       out.stride(1), T, H, nope, C, R, v, int(start), float(scale), pages, int(page_size if pages else 0))
    return out


def rope_prompt(pool: CPUInfer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of a prompt's q or k: ``x [1, H, T, D]`` (fp32 CPU, contiguous
    last dim, any head / token strides: transformers' transposed view) with ``cos`` / ``sin [1, T, D]``
    -> ``[1, H, T, D]``, a view of fresh ``[1, T, H, D]`` storage.  Bit for bit transformers'
    ``x * cos + rotate_half(x) * sin`` (a product each, then a sum), in one pass on the pool."""
    if x.dim() != 4 or x.shape[0] != 1 or cos.shape != (1, x.shape[2], x.shape[3]) or sin.shape != cos.shape:
        raise ValueError(f"rope_prompt: need x [1, H, T, D] and cos, sin [1, T, D], got {tuple(x.shape)}, "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    _, H, T, D = x.shape
    for name, t in (("x", x), ("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError(f"rope_prompt: {name} must be float32 on the CPU with a contiguous last dim")
    if D % 2 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError(f"rope_prompt: D {D} must be even and cos, sin contiguous")
    out = torch.empty(1, T, H, D, dtype=torch.float32)
    _ext.decode_ops.rope_prompt(pool._c, x.data_ptr(), T, H, D, x.stride(2), x.stride(1), cos.data_ptr(),
                                sin.data_ptr(), out.data_ptr())
    return out.transpose(1, 2)


def _f32(name: str, t: torch.Tensor, shape: tuple | None = None) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float32 CPU tensor, got {t.dtype} on {t.device}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")


def causal_conv_silu(pool: CPUInfer, x: torch.Tensor, w: torch.Tensor, T: int) -> torch.Tensor:
    """A gated-DeltaNet layer's causal depthwise conv and SiLU for its last ``T`` inputs: ``x [C, L]``
    (channel-major: the cache's earlier inputs then the chunk's, ``L >= T + K - 1``), ``w [C, K]``
    -> ``[T, C]``.  Each output is the K taps added in order, the same bits whatever the chunk."""
    _f32("x", x)
    C, L = x.shape
    _f32("w", w)
    if w.dim() != 2 or w.shape[0] != C:
        raise ValueError(f"causal_conv_silu: w {tuple(w.shape)} does not match x {tuple(x.shape)}")
    K = w.shape[1]
    if T < 1 or L < T + K - 1:
        raise ValueError(f"causal_conv_silu: {L} inputs cannot give {T} outputs of a {K}-tap conv")
    out = torch.empty(T, C, dtype=torch.float32)
    _ext.decode_ops.conv_silu(pool._c, x.data_ptr(), C, L, w.data_ptr(), K, T, out.data_ptr())
    return out


def gated_delta_rule(pool: CPUInfer, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, state: torch.Tensor, hk: int, dk: int) -> torch.Tensor:
    """The gated delta rule token by token (transformers' recurrent form, fp32), the state updated in place.

    ``qkv [T, C]``: per token the conv's output, q ``[hk, dk]`` then k ``[hk, dk]`` then v ``[hv, dv]``;
    ``b`` / ``a [T, hv]`` (beta = sigmoid(b), decay = exp(-exp(A_log) * softplus(a + dt_bias))),
    ``state [hv, dk, dv]`` -> out ``[T, hv, dv]``.  q and k are L2-normed per head and q scaled by
    dk^-0.5 inside.  A token's output and state are the same operations in the same order whether it
    comes alone or in a chunk of any size."""
    _f32("qkv", qkv)
    T, C = qkv.shape
    hv, dk_s, dv = state.shape
    _f32("state", state)
    if dk_s != dk or hk < 1 or hv % hk or C != 2 * hk * dk + hv * dv:
        raise ValueError(f"gated_delta_rule: qkv [{T}, {C}] does not hold {hk} key heads of {dk} and "
                         f"the state's {hv} value heads of {dv}")
    for name, t in (("b", b), ("a", a)):
        if (t.dtype != torch.float32 or t.device.type != "cpu" or tuple(t.shape) != (T, hv) or t.stride(1) != 1):
            raise ValueError(f"gated_delta_rule: {name} must be float32 [{T}, {hv}] with contiguous rows")
    _f32("A_log", A_log, (hv,))
    _f32("dt_bias", dt_bias, (hv,))
    out = torch.empty(T, hv, dv, dtype=torch.float32)
    _ext.decode_ops.gated_delta_rule(pool._c, qkv.data_ptr(), T, C, hk, hv, dk, dv, b.data_ptr(), b.stride(0),
                                     a.data_ptr(), a.stride(0), A_log.data_ptr(), dt_bias.data_ptr(),
                                     state.data_ptr(), out.data_ptr())
    return out


__all__ = ["causal_conv_silu", "flash_attention", "flash_attention_paged", "flash_attention_supported",
           "gated_delta_rule", "mla_attention", "mla_attention_supported", "rope_prompt"]
