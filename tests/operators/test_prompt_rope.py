"""Prompt RoPE on the one-pass kernel (operators/cpu_attention.py ``use_prompt_rope``,
kernels/attention.py ``rope_prompt``): bit for bit transformers' own rotate-half
``apply_rotary_pos_emb`` (the bar is equality, not a tolerance), only where that function is the
standard one, and the original function wherever the kernel does not apply."""

from __future__ import annotations

import importlib

import pytest
import torch

import ktransformers.operators.cpu_attention as ca
from ktransformers.kernels import cpu_infer
from ktransformers.kernels.attention import rope_prompt

STANDARD = ["llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mistral", "mixtral", "gemma2", "gemma3", "deepseek_v3",
            "qwen3_vl_moe"]


def _modeling(family):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _original(mod):
    fn = mod.apply_rotary_pos_emb
    return getattr(fn, "__wrapped__", fn) if getattr(fn, "_kt_prompt_rope", False) else fn


def _inputs(T, H=6, Hkv=2, D=64, seed=0, transposed=True):
    g = torch.Generator().manual_seed(seed)
    if transposed:  # transformers' layout: [1, T, H, D] storage seen as [1, H, T, D]
        q = torch.randn(1, T, H, D, generator=g).transpose(1, 2)
        k = torch.randn(1, T, Hkv, D, generator=g).transpose(1, 2)
    else:
        q, k = torch.randn(1, H, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
    ang = torch.randn(1, T, D // 2, generator=g) * 30
    ang = torch.cat([ang, ang], dim=-1)
    return q, k, ang.cos(), ang.sin()


@pytest.mark.parametrize("family", STANDARD)
def test_standard_families_are_recognised(family):
    assert ca._standard_rope(_modeling(family))


def test_other_rotary_functions_are_left_alone():
    # partial rotary, complex tables, another signature: never answered by the kernel
    for family in ("glm4_moe", "qwen3_next", "deepseek_v2", "gpt_oss", "phi3"):
        try:
            mod = _modeling(family)
        except ImportError:
            continue
        assert not ca._standard_rope(mod), family


@pytest.mark.parametrize("T", [1, 7, 512])
@pytest.mark.parametrize("transposed", [True, False])
def test_kernel_equals_transformers_bitwise(T, transposed):
    original = _original(_modeling("qwen3_moe"))
    q, k, cos, sin = _inputs(T, transposed=transposed)
    want_q, want_k = original(q, k, cos, sin)
    fast = ca._fast_rope(original)
    got_q, got_k = fast(q, k, cos, sin)
    assert got_q.shape == want_q.shape and got_k.shape == want_k.shape
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(rope_prompt(cpu_infer(), q, cos, sin), want_q)


def test_fallbacks_go_to_the_original(monkeypatch):
    calls = []
    original = _original(_modeling("llama"))

    def spy(*a):
        calls.append(1)
        return original(*a)

    fast = ca._fast_rope(spy)
    q, k, cos, sin = _inputs(5)
    fast(q.bfloat16(), k.bfloat16(), cos.bfloat16(), sin.bfloat16())  # not fp32
    fast(q.requires_grad_(), k, cos, sin)  # autograd
    q, k, cos, sin = _inputs(5)
    fast(q, k, cos[:, :, None], sin[:, :, None], 2)  # another unsqueeze_dim
    monkeypatch.setenv("KT_PROMPT_ROPE", "0")
    fast(q, k, cos, sin)
    assert len(calls) == 4
    monkeypatch.delenv("KT_PROMPT_ROPE")
    out = fast(q, k, cos, sin)
    assert len(calls) == 4 and torch.equal(out[0], original(q, k, cos, sin)[0])


def test_rope_prompt_rejects_bad_input():
    q, k, cos, sin = _inputs(4)
    with pytest.raises(ValueError, match="cos, sin"):
        rope_prompt(cpu_infer(), q, cos[:, :3], sin[:, :3])
    with pytest.raises(ValueError, match="float32"):
        rope_prompt(cpu_infer(), q.double(), cos, sin)
    with pytest.raises(ValueError, match="even"):
        rope_prompt(cpu_infer(), q[..., :63], cos[..., :63].contiguous(), sin[..., :63].contiguous())


def test_injected_model_uses_it_and_keeps_its_logits(tmp_path, monkeypatch):
    from ktransformers import load_model
    from ktransformers.util.tiny_models import write_tiny_model

    write_tiny_model("qwen3_moe", tmp_path, seed=0, head_dim=64)
    model = load_model(tmp_path, model_path=tmp_path)
    assert getattr(_modeling("qwen3_moe").apply_rotary_pos_emb, "_kt_prompt_rope", False)
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        fast = model(input_ids=ids).logits
        monkeypatch.setenv("KT_PROMPT_ROPE", "0")
        plain = model(input_ids=ids).logits
    assert torch.equal(fast, plain)
