"""One-pass RMSNorm (operators/cpu_norm.py) against the modules' own forward: within 1e-5
relative (fp32, a different summation order), switched only for the formulas it reproduces."""

from __future__ import annotations

import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from ktransformers import load_model
from ktransformers.operators.cpu_norm import use_fast_norms


class ScaledRMSNorm(torch.nn.Module):
    """Not an RMSNorm formula the fast path knows: keeps its own forward."""

    def __init__(self, n):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(n))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return 2.0 * self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_fast_norm_matches_the_module_and_skips_unknown_formulas():
    mods = {"qwen": Qwen3MoeRMSNorm(128, eps=1e-6), "gemma": Gemma3RMSNorm(128, eps=1e-6), "other": ScaledRMSNorm(128)}
    for m in mods.values():
        with torch.no_grad():
            m.weight.copy_(torch.rand(128) - 0.5)
    x = torch.randn(2, 37, 8, 128)
    with torch.no_grad():
        ref = {k: m(x) for k, m in mods.items()}
    holder = torch.nn.ModuleDict(mods)
    assert use_fast_norms(holder) == 2
    assert mods["qwen"]._kt_norm_formula == "w" and mods["gemma"]._kt_norm_formula == "1+w"
    assert not hasattr(mods["other"], "_kt_norm_formula")
    with torch.no_grad():
        for k, m in mods.items():
            got = m(x)
            assert ((got - ref[k]).norm() / ref[k].norm()).item() < 1e-5, k
            # each row alone gives the same bits as inside the batch (one fixed order per row)
            assert torch.equal(m(x[:1, :3].contiguous()), got[:1, :3]), k
    # gradients wanted, or a non-contiguous input: the module's own forward
    xg = x.clone().requires_grad_()
    mods["qwen"](xg).sum().backward()
    assert xg.grad is not None
    xt = x.transpose(1, 2)
    with torch.no_grad():
        assert torch.equal(mods["qwen"](xt), mods["qwen"]._kt_original_forward(xt))
        mods["qwen"].train()  # training mode: the original even without gradients
        assert torch.equal(mods["qwen"](x), mods["qwen"]._kt_original_forward(x))


def test_injected_model_norms_switched(tiny_model_dir):
    d = tiny_model_dir("qwen3_moe")
    model = load_model(d, model_path=d)
    norms = [m for m in model.modules() if "RMSNorm" in type(m).__name__]
    assert norms and all(getattr(m, "_kt_norm_formula", None) == "w" for m in norms)


def test_fast_norm_rows_are_the_same_bits_in_any_layout_and_count():
    """A prompt's rows, a transposed view normed in its storage order
    (Gemma's q / k norms), a strided slice (copied first) and one row at a time: equal bits."""
    m = Gemma3RMSNorm(256, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(torch.rand(256) - 0.5)
    assert use_fast_norms(torch.nn.ModuleDict({"n": m})) == 1
    storage = torch.randn(1, 300, 4, 256)
    view = storage.transpose(1, 2)  # [1, 4, 300, 256], not contiguous
    with torch.no_grad():
        whole = m(storage)
        seen = m(view)
        sliced = m(view[:, :, ::3])
        single = torch.cat([m(storage[:, t:t + 1]) for t in range(300)], dim=1)
    assert seen.shape == view.shape and seen.stride() == view.stride()  # normed in place of the layout
    assert torch.equal(seen, whole.transpose(1, 2))
    assert torch.equal(whole, single)
    assert torch.equal(sliced, whole.transpose(1, 2)[:, :, ::3])
