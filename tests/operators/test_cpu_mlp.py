"""Fused gated MLPs (operators/cpu_mlp.py) against the modules' own forward.

Bars: the injected model's prompt logits with and without the fusion, 2e-5 of the largest logit
(the kernel's SiLU / GELU-tanh against torch's: fp32 rounding); a prompt's MLP rows against the
same rows one at a time, and the decode step's fused gate / up call against the prompt's rows:
equal bits (the row's path does not depend on how many rows come with it)."""

from __future__ import annotations

import pytest
import torch

from ktransformers import load_model
from ktransformers.util.tiny_models import write_tiny_model


@pytest.fixture(scope="module", params=["qwen3", "gemma3_text"])
def model(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(f"tiny-{request.param}")
    write_tiny_model(request.param, d, seed=0)
    return load_model(d, model_path=d)


def _mlps(model):
    return [layer.mlp for layer in model.model.layers]


def test_every_dense_mlp_is_fused(model):
    assert all(hasattr(m, "_kt_gate_up") for m in _mlps(model))


def test_logits_match_the_unfused_forward(model, monkeypatch):
    ids = torch.randint(0, model.config.vocab_size, (1, 33), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        fused = model(input_ids=ids).logits
        monkeypatch.setenv("KT_FUSED_MLP", "0")
        plain = model(input_ids=ids).logits
    err = (fused - plain).abs().max().item() / plain.abs().max().item()
    assert err < 2e-5, err


def test_rows_are_the_same_bits_alone_and_together(model):
    mlp = _mlps(model)[0]
    x = torch.randn(1, 70, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        together = mlp(x)
        alone = torch.cat([mlp(x[:, t:t + 1]) for t in range(70)], dim=1)
    assert torch.equal(together, alone)


def test_decode_step_rows_equal_prompt_rows(model):
    from ktransformers.generation.decode_step import _Proj

    mlp = _mlps(model)[1]
    act = "gelu_tanh" if "gemma" in model.config.model_type else "silu"
    proj = _Proj([mlp.gate_proj, mlp.up_proj], glu=act)
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    h = torch.empty(5, proj.out_features)
    proj.rows(5, x.contiguous(), h)
    with torch.inference_mode():
        mlp.down_proj, keep = torch.nn.Identity(), mlp.down_proj  # read the fused gate / up rows
        try:
            got = mlp(x[None])[0]
        finally:
            mlp.down_proj = keep
    assert torch.equal(got, h)


def test_fallbacks_run_the_modules_own_forward(model, monkeypatch):
    mlp = _mlps(model)[0]
    calls = []
    own = mlp._kt_original_forward

    def spy(x):
        calls.append(1)
        return own(x)

    monkeypatch.setattr(mlp, "_kt_original_forward", spy)
    x = torch.randn(1, 4, model.config.hidden_size)
    with torch.no_grad():
        mlp(x.double().float())  # fused
        assert calls == []
        mlp(x.bfloat16())  # another dtype
        monkeypatch.setenv("KT_FUSED_MLP", "0")
        mlp(x)
        monkeypatch.delenv("KT_FUSED_MLP")
    mlp(x.requires_grad_())  # autograd
    assert len(calls) == 3
