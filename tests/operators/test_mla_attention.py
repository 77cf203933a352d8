"""KDeepseekV2Attention (absorbed MLA, latent cache) against the unmodified transformers model.

Tiny random DeepSeek-V3 (q_lora, rope_interleave) and V2 (no q_lora, complex RoPE) models, plus
YaRN / non-interleaved / q_lora variants, loaded through the shipped -cpu rule files.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ktransformers
from ktransformers.operators.attention import KDeepseekV2Attention
from ktransformers.operators.mla import latent_cache_bytes_per_token
from ktransformers.util.tiny_models import write_tiny_model

RULES = Path(ktransformers.__file__).parent / "optimize_rules"
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.707, "rope_theta": 10000.0}

CASES = {
    "v3": ("deepseek_v3", "DeepSeek-V3-Chat-cpu.yaml", {}),
    "v2": ("deepseek_v2", "DeepSeek-V2-Lite-Chat-cpu.yaml", {}),
    # Moonlight-like: V3 classes without q_lora; plus YaRN mscale and the rotate_half RoPE layout
    "v3_noqlora_yarn_halfrope": ("deepseek_v3", "Moonlight-16B-A3B-cpu.yaml",
                                 dict(q_lora_rank=None, rope_interleave=False, rope_scaling=YARN)),
    # V2-Chat-like: q_lora, YaRN (complex freqs scaled), group-limited greedy softmax router
    "v2_qlora_yarn_glg": ("deepseek_v2", "DeepSeek-V2-Chat-cpu.yaml",
                          dict(q_lora_rank=16, rope_scaling=YARN, topk_method="group_limited_greedy", n_group=4,
                               topk_group=2, routed_scaling_factor=16.0)),
    # a latent the CPU kernel reads (kv_lora_rank a multiple of 64): prompt and decode rows of one
    # sequence go through kernels.mla_attention
    "v3_latent64": ("deepseek_v3", "DeepSeek-V3-Chat-cpu.yaml", dict(kv_lora_rank=64, qk_rope_head_dim=16)),
    "v2_latent64": ("deepseek_v2", "DeepSeek-V2-Lite-Chat-cpu.yaml", dict(kv_lora_rank=64, qk_rope_head_dim=16)),
}
LATENT = ["v3_latent64", "v2_latent64"]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


_MODELS: dict[str, tuple] = {}


def pair(case: str, tmp_root: Path):
    """(reference HF model, ktransformers model) for a case, built once per session."""
    if case not in _MODELS:
        arch, rule, over = CASES[case]
        d = tmp_root / case
        ref = write_tiny_model(arch, d, seed=3, **over)
        model = ktransformers.load_model(d, model_path=d, rules=RULES / rule)
        _MODELS[case] = (ref, model)
    return _MODELS[case]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ds_attn")


def attn_modules(model):
    return [m for m in model.modules() if isinstance(m, KDeepseekV2Attention)]


def set_attn(model, **kw):
    old = []
    for m in attn_modules(model):
        old.append({k: getattr(m, k) for k in kw})
        for k, v in kw.items():
            object.__setattr__(m, k, v)
    return old


def restore_attn(model, old):
    for m, kv in zip(attn_modules(model), old):
        for k, v in kv.items():
            object.__setattr__(m, k, v)


def close(a, b, rel=1e-4):
    scale = max(a.abs().max().item(), 1e-6)
    diff = (a - b).abs().max().item()
    assert diff <= rel * scale, f"max diff {diff:.3g} > {rel:g} x logit scale {scale:.3g}"


def ids_for(model, B=2, S=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.config.vocab_size, (B, S), generator=g)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_hf(case, root):
    ref, model = pair(case, root)
    assert len(attn_modules(model)) == model.config.num_hidden_layers
    ids = ids_for(model)
    with torch.no_grad():
        close(ref(ids).logits, model(ids).logits)


@pytest.mark.parametrize("case", LATENT)
def test_the_latent_kernel_matches_hf(case, root, monkeypatch):
    """One sequence (the kernel's rows): a 40-token prompt, then 6 tokens one at a time through the
    cache, against the unmodified model's logits; every call on the kernel."""
    from transformers import DynamicCache

    import ktransformers.operators.attention as attention
    from ktransformers.kernels import flash_attention_supported

    if not flash_attention_supported():
        pytest.skip("no AVX2 + FMA: the latent kernel does not run here")
    calls = []
    real = attention.latent_kernel_attention
    monkeypatch.setattr(attention, "latent_kernel_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref, model = pair(case, root)
    ids = ids_for(model, B=1, S=46, seed=5)
    with torch.no_grad():
        want = ref(ids).logits
        cache = DynamicCache(config=model.config)
        got = [model(ids[:, :40], cache=cache).logits]
        got += [model(ids[:, t:t + 1], cache=cache).logits for t in range(40, 46)]
    close(want, torch.cat(got, dim=1))
    assert len(calls) == 7 * model.config.num_hidden_layers, "some rows did not take the latent kernel"


def test_absorb_for_prefill_false_reads_prompts_expanded(root, monkeypatch):
    """``absorb_for_prefill: false``: prompt rows expanded (mla.causal_prompt_attention), decode rows
    still on the latent kernel; the logits stay the unmodified model's."""
    from transformers import DynamicCache

    import ktransformers.operators.attention as attention
    from ktransformers.kernels import flash_attention_supported

    if not flash_attention_supported():
        pytest.skip("no AVX2 + FMA: the latent kernel does not run here")
    calls = {"kernel": 0, "expanded": 0}
    kern, exp = attention.latent_kernel_attention, attention.causal_prompt_attention

    def count(name, fn):
        return lambda *a, **k: calls.__setitem__(name, calls[name] + 1) or fn(*a, **k)

    monkeypatch.setattr(attention, "latent_kernel_attention", count("kernel", kern))
    monkeypatch.setattr(attention, "causal_prompt_attention", count("expanded", exp))
    ref, model = pair("v3_latent64", root)
    ids = ids_for(model, B=1, S=22, seed=6)
    L = model.config.num_hidden_layers
    old = set_attn(model, absorb_for_prefill=False)
    try:
        with torch.no_grad():
            want = ref(ids).logits
            cache = DynamicCache(config=model.config)
            got = [model(ids[:, :20], cache=cache).logits]
            got += [model(ids[:, t:t + 1], cache=cache).logits for t in (20, 21)]
    finally:
        restore_attn(model, old)
    close(want, torch.cat(got, dim=1))
    assert calls == {"kernel": 2 * L, "expanded": L}, calls


@pytest.mark.parametrize("case", ["v3", "v2"] + LATENT)
@pytest.mark.parametrize("cache_impl", [None, "static"])
def test_greedy_generate_identical(case, cache_impl, root):
    ref, model = pair(case, root)
    ids = ids_for(model, B=1, S=10, seed=1)
    kw = dict(max_new_tokens=32, min_new_tokens=32, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    if cache_impl:
        kw["cache_implementation"] = cache_impl
    with torch.no_grad():
        want = ref.generate(ids, **kw)
        got = model.generate(ids, **kw)
    assert want.sequences.shape[1] == ids.shape[1] + 32
    assert torch.equal(want.sequences, got.sequences)
    # every decode step's logits too (tiny random models often keep the argmax under small errors)
    close(torch.stack(want.logits), torch.stack(got.logits))


def test_manual_static_cache_loop(root):
    """model(input_ids, cache=StaticCache(...), position_ids=...) step by step = HF full forward."""
    from transformers import StaticCache

    ref, model = pair("v3", root)
    ids = ids_for(model, B=1, S=20, seed=2)
    with torch.no_grad():
        full = ref(ids).logits
        cache = StaticCache(config=model.config, max_cache_len=32)
        P = 8
        out = model(input_ids=ids[:, :P], cache=cache, position_ids=torch.arange(P)[None])
        steps = [out.logits]
        for t in range(P, ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], cache=cache, position_ids=torch.tensor([[t]]))
            steps.append(out.logits)
    close(full, torch.cat(steps, dim=1))
    layer0 = cache.layers[0]
    assert layer0.keys.shape[-1] == model.config.kv_lora_rank
    assert layer0.values.shape[-1] == model.config.qk_rope_head_dim


@pytest.mark.parametrize("case", ["v3", "v2"])
def test_absorbed_and_expanded_prefill_agree(case, root):
    _, model = pair(case, root)
    ids = ids_for(model, seed=3)
    with torch.no_grad():
        expanded = model(ids).logits
        old = set_attn(model, absorb_for_prefill=True)
        try:
            absorbed = model(ids).logits
        finally:
            restore_attn(model, old)
    close(expanded, absorbed, rel=1e-5)


@pytest.mark.parametrize("absorb", [False, True])
def test_chunked_prefill_equals_single_pass(absorb, root):
    from transformers import DynamicCache

    ref, model = pair("v3", root)
    ids = ids_for(model, B=2, S=21, seed=4)
    with torch.no_grad():
        single = ref(ids).logits
        old = set_attn(model, chunk_size=7, absorb_for_prefill=absorb)  # 3 query chunks inside one call
        try:
            chunked = model(ids).logits
        finally:
            restore_attn(model, old)
        cache = DynamicCache(config=model.config)  # 3 calls through the cache
        parts = [model(ids[:, s:s + 7], cache=cache).logits for s in (0, 7, 14)]
    close(single, chunked)
    close(single, torch.cat(parts, dim=1))


@pytest.mark.parametrize("case", ["v3", "v2"])
def test_left_padding(case, root):
    ref, model = pair(case, root)
    ids = ids_for(model, B=2, S=12, seed=5)
    pad = model.config.pad_token_id or 0
    ids[0, :5] = pad
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.no_grad():
        want = ref(ids, attention_mask=mask).logits
        got = model(ids, attention_mask=mask).logits
        assert torch.isfinite(got).all()
        close(want[mask.bool()], got[mask.bool()])
        kw = dict(attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
        want, got = ref.generate(ids, **kw), model.generate(ids, **kw)
        assert torch.equal(want.sequences, got.sequences)
        close(torch.stack(want.logits), torch.stack(got.logits))


def test_latent_cache_is_what_is_stored(root):
    from transformers import DynamicCache

    _, model = pair("v2", root)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids_for(model, B=1, S=9), cache=cache)
    cfg = model.config
    for layer in cache.layers:
        assert tuple(layer.keys.shape) == (1, 1, 9, cfg.kv_lora_rank)
        assert tuple(layer.values.shape) == (1, 1, 9, cfg.qk_rope_head_dim)
    lat, exp = latent_cache_bytes_per_token(cfg, torch.float32)
    L, H = cfg.num_hidden_layers, cfg.num_attention_heads
    assert lat == L * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    assert exp == L * H * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 4
    stored = sum(l.keys[0, :, :1].numel() + l.values[0, :, :1].numel() for l in cache.layers) * 4
    assert stored == lat


def test_latent_cache_bytes_real_v3():
    from transformers import AutoConfig

    cfg = AutoConfig.for_model("deepseek_v3", num_hidden_layers=61, num_attention_heads=128, kv_lora_rank=512,
                               qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    lat, exp = latent_cache_bytes_per_token(cfg, torch.bfloat16)
    assert lat == 61 * 576 * 2 == 70272  # 68.6 KiB / token
    assert exp == 61 * 128 * 320 * 2 == 4997120  # 4.77 MiB / token: 71x more


def test_kwargs_and_alias(root):
    from ktransformers.optimize.rules import load_rules

    rules = load_rules([{"match": {"name": r"\.self_attn$"},
                         "replace": {"class": "KDeepseekV2Attention",
                                     "kwargs": {"chunck_size": 5, "absorb_for_prefill": True}}}])
    assert rules[0].replace_class is KDeepseekV2Attention
    from ktransformers.optimize import build_model, plan_model
    from ktransformers.optimize.inject import apply_plan

    _, model = pair("v3", root)
    skel = build_model(model.config)
    apply_plan(skel, plan_model(skel, rules))
    a = skel.model.layers[0].self_attn
    assert isinstance(a, KDeepseekV2Attention) and a.chunk_size == 5 and a.absorb_for_prefill


# ------------------------------------------------------------- chunk-invariant prompt rows

def _v2_lite_rows(L, heads=2, seed=0):
    """Random MLA inputs of DeepSeek-V2-Lite's head shapes (nope 128, rope 64, v 128, latent 512)."""
    g = torch.Generator().manual_seed(seed)
    nope, rope, v, C = 128, 64, 128, 512
    q = torch.randn(1, L, heads, nope + rope, generator=g).transpose(1, 2)  # the layout the forward gives
    q_nope, q_pe = torch.split(q, [nope, rope], dim=-1)
    c_kv = torch.randn(1, 1, L, C, generator=g)
    k_pe = torch.randn(1, 1, L, rope, generator=g)
    w = torch.randn(heads * (nope + v), C, generator=g) * 0.05
    return q_nope, q_pe, c_kv, k_pe, w, (nope + rope) ** -0.5


def _reference(q_nope, q_pe, c_kv, k_pe, w, scale, absorbed):
    from ktransformers.operators.mla import (absorbed_attention, build_chunk_mask, expand_latent, expanded_attention,
                                             split_kv_b)

    H, L = q_nope.shape[1], q_nope.shape[2]
    w_uk, w_uv = split_kv_b(w, H, q_nope.shape[-1], w.shape[0] // H - q_nope.shape[-1])
    mask = build_chunk_mask(None, 0, L, L, L, L)
    if absorbed:
        return absorbed_attention(q_nope, q_pe, c_kv, k_pe, w_uk, w_uv, scale, mask)
    k_nope, value = expand_latent(c_kv, w_uk, w_uv)
    return expanded_attention(q_nope, q_pe, k_nope, k_pe, value, scale, mask)


def test_fuzz_prompt_rows_are_chunk_invariant():
    """``causal_prompt_attention``: a prompt's rows read in any chunks (one row, a block's worth,
    across block edges) are bitwise the rows read whole, expanded and absorbed; whole, they match
    the plain masked attention to fp32 rounding; a chunk past the cached keys is one error line."""
    pytest.importorskip("hypothesis")
    from hypothesis import given
    from hypothesis import strategies as st

    from ktransformers.operators.mla import causal_prompt_attention
    from tests.fuzzing import fuzz_settings

    L = 150
    q_nope, q_pe, c_kv, k_pe, w, scale = _v2_lite_rows(L)
    whole = {a: causal_prompt_attention(q_nope, q_pe, c_kv, k_pe, w, 2, scale, 0, absorbed=a) for a in (False, True)}
    for a in (False, True):
        ref = _reference(q_nope, q_pe, c_kv, k_pe, w, scale, a)
        assert (whole[a] - ref).abs().max() <= 2e-5 * ref.abs().max(), a

    @fuzz_settings(25, deadline=None, derandomize=True)
    @given(st.lists(st.integers(1, 80), min_size=1, max_size=12), st.booleans(), st.booleans())
    def check(sizes, absorbed, tail):
        start = 0
        for n in sizes:
            end = min(start + n, L)
            keys = L if tail else end  # the keys cached so far, or with keys past the chunk (unseen)
            got = causal_prompt_attention(q_nope[:, :, start:end], q_pe[:, :, start:end], c_kv[:, :, :keys],
                                          k_pe[:, :, :keys], w, 2, scale, start, absorbed=absorbed)
            assert torch.equal(got, whole[absorbed][:, :, start:end]), (start, end, absorbed)
            start = end
            if start == L:
                break

    check()
    with pytest.raises(ValueError, match="causal_prompt_attention: 10 cached keys, rows reach position 12"):
        causal_prompt_attention(q_nope[:, :, :4], q_pe[:, :, :4], c_kv[:, :, :10], k_pe[:, :, :10], w, 2, scale, 8)
