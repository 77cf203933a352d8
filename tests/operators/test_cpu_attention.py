"""``kt_sdpa`` (operators/cpu_attention.py): transformers' attention modules on the project's flash
kernel for prompt chunks, transformers' sdpa for everything else.

Bars: an injected tiny Qwen3-MoE (head_dim 64 so that the kernel serves it) against the unmodified
transformers model, relative to the largest logit: 1e-4 with ``KT_FLASH_ATTN=fp32`` (the bar of
the other parity tests; measured 6e-7), 5e-2 by default (probabilities and values on bf16 pairs;
measured 2.1e-2 on this random model -- on the real Gemma-3-270M every mode is as close to
llama.cpp's logits as transformers' sdpa, tests/generation/test_real_model.py); a prompt
prefilled in chunks of 7 against the whole prompt in one call, 1e-5 (measured: bitwise equal).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import ktransformers.operators.cpu_attention as ca
from ktransformers import load_model
from ktransformers.kernels import flash_attention_supported

needs_kernel = pytest.mark.skipif(not flash_attention_supported(), reason="the CPU tier in force has no AVX512-BF16")


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from ktransformers.util.tiny_models import write_tiny_model

    d = tmp_path_factory.mktemp("tiny-qwen3-moe-d64")
    write_tiny_model("qwen3_moe", d, seed=0, head_dim=64)
    return d


@pytest.fixture
def spy(monkeypatch):
    calls = {"flash": 0, "sdpa": 0}
    flash, sdpa = ca.flash_attention, ca.sdpa_attention_forward

    def f(*a, **k):
        calls["flash"] += 1
        return flash(*a, **k)

    def s(*a, **k):
        calls["sdpa"] += 1
        return sdpa(*a, **k)

    monkeypatch.setattr(ca, "flash_attention", f)
    monkeypatch.setattr(ca, "sdpa_attention_forward", s)
    return calls


BAR = {"fp32": 1e-4, "1": 5e-2}


@needs_kernel
@pytest.mark.parametrize("mode", ["fp32", "1"])
def test_injected_model_prefill_on_the_kernel_matches_hf(qwen_dir, spy, mode, monkeypatch):
    monkeypatch.setenv("KT_FLASH_ATTN", mode)
    model = load_model(qwen_dir, model_path=qwen_dir)
    assert model.config._attn_implementation == ca.NAME
    hf = AutoModelForCausalLM.from_pretrained(qwen_dir, dtype=torch.float32)
    assert hf.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
        got = model(ids).logits
    assert spy["flash"] == model.config.num_hidden_layers
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    print(f"KT_FLASH_ATTN={mode}: max |logit - hf| / max |hf| = {err:.2e}")
    assert err <= BAR[mode]


@needs_kernel
@pytest.mark.parametrize("mode", ["fp32", "1"])
def test_chunked_prefill_after_a_prefix_matches_one_call(qwen_dir, spy, mode, monkeypatch):
    from ktransformers.generation import Generator

    monkeypatch.setenv("KT_FLASH_ATTN", mode)
    model = load_model(qwen_dir, model_path=qwen_dir)
    ids = [int(i) for i in torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(2))]
    whole = Generator(model, None, chunk_size=64)
    ref = whole.prefill(ids, whole.new_cache(48))
    n = spy["flash"]
    chunked = Generator(model, None, chunk_size=7)
    got = chunked.prefill(ids, chunked.new_cache(48))
    # 6 chunks of 7 tokens and one of 5, every layer on the kernel
    assert spy["flash"] - n == 6 * model.config.num_hidden_layers
    err = (got - ref).abs().max().item() / ref.abs().max().item()
    print(f"KT_FLASH_ATTN={mode}: chunks of 7 vs one call {err:.2e}")
    assert err <= (1e-5 if mode == "fp32" else 1e-2)


@needs_kernel
def test_what_goes_to_sdpa(qwen_dir, spy, monkeypatch):
    model = load_model(qwen_dir, model_path=qwen_dir)
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids)                                   # a batch of two: sdpa
        model(ids[:1, :1])                           # one token: the kernel (a prompt chunk of one)
        n = model.config.num_hidden_layers
        assert spy["flash"] == n and spy["sdpa"] == n
        monkeypatch.setenv("KT_FLASH_ATTN", "0")
        model(ids[:1])                               # switched off: sdpa
    assert spy["flash"] == n and spy["sdpa"] == 2 * n


def test_mask_that_is_not_causal_goes_to_sdpa():
    q = torch.randn(1, 4, 5, 64)
    k = torch.randn(1, 2, 8, 64)
    v = torch.randn(1, 2, 8, 64)
    pos = {"position_ids": torch.arange(3, 8)[None]}
    module = torch.nn.Module().eval()
    causal = ca._visible(3, 5, 8, 0)[None, None]
    with torch.no_grad():
        expect = None if not flash_attention_supported() else (3, 0, 0)
        assert ca.flash_eligible(module, q, k, v, causal, 0.0, None, pos) == expect
        padded = causal.clone()
        padded[..., 0] = False                      # a padding column
        assert ca.flash_eligible(module, q, k, v, padded, 0.0, None, pos) is None
        assert ca.flash_eligible(module, q, k, v, causal, 0.0, None, {"position_ids": torch.arange(5)[None]}) is None
        assert ca.flash_eligible(module, q, k, v, causal, 0.0, None, dict(pos, s_aux=torch.zeros(4))) is None
        assert ca.flash_eligible(module, q, k, v, causal.float(), 0.0, None, pos) is None
    # training mode, or gradients wanted: the kernel has no backward
    assert ca.flash_eligible(module.train(), q, k, v, causal, 0.0, None, pos) is None
    assert ca.flash_eligible(module.eval(), q.requires_grad_(), k, v, causal, 0.0, None, pos) is None


def test_a_mask_changed_in_place_is_checked_again():
    q, k = torch.randn(1, 4, 5, 64), torch.randn(1, 2, 8, 64)
    pos = {"position_ids": torch.arange(3, 8)[None]}
    module = torch.nn.Module().eval()
    mask = ca._visible(3, 5, 8, 0)[None, None].clone()
    with torch.no_grad():
        if flash_attention_supported():
            assert ca.flash_eligible(module, q, k, k.clone(), mask, 0.0, None, pos) == (3, 0, 0)
        mask[..., 1] = False  # the same tensor, now with a padding column
        assert ca.flash_eligible(module, q, k, k.clone(), mask, 0.0, None, pos) is None


@needs_kernel
def test_one_kv_head_cut_from_a_concatenation_takes_the_kernel():
    """Gemma-3's sliding layers hand k and v [1, 1, S, D] whose (unused) head strides differ."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 40, 64, generator=g)
    k2 = torch.randn(1, 1, 40, 128, generator=g)[..., :64]  # token stride 128, head stride 5120
    v2 = torch.randn(1, 1, 40, 128, generator=g)[..., :64]
    v2 = v2.as_strided(v2.shape, (v2.stride(0), 7, v2.stride(2), 1))  # another head stride, one head
    assert k2.stride() != v2.stride()
    module = torch.nn.Module().eval()
    pos = {"position_ids": torch.arange(40)[None], "sliding_window": 16}
    mask = ca._visible(0, 40, 40, 16)[None, None]
    with torch.no_grad():
        assert ca.flash_eligible(module, q, k2, v2, mask, 0.0, None, pos) == (0, 16, 0)
        out, _ = ca.kt_sdpa_attention(module, q, k2, v2, mask, scaling=0.125, **pos)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k2.expand(1, 4, 40, 64), v2.expand(1, 4, 40, 64),
                                                               attn_mask=mask, scale=0.125).transpose(1, 2)
    assert (out - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def test_models_that_branch_on_the_name_keep_sdpa(tiny_model_dir):
    d = tiny_model_dir("deepseek_v32")
    model = load_model(d, model_path=d)
    assert model.config._attn_implementation == "sdpa"
