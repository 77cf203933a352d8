"""The one decode step on GLM-4-MoE (generation/decode_step.py: GQA with partial rotary, attention
biases and optional q/k norms; the sigmoid, group-limited router of DeepSeek-V3 in ``_MoE`` with the
shared experts; the dense first layers) against the model's own forward and the unmodified
transformers model.

Tiny random GLM-4-MoE models loaded through the shipped Glm4Moe-cpu rules (F32 weights on the CPU
kernels): GLM-4.5-like (q/k norms, attention biases, half the head rotated, two router groups) and
GLM-4.5-Air-like (no q/k norms, one router group), plus a full-rotary one (the kernel's own RoPE).

Tolerances:
* the step against the model's own forward on the same cache (the injected ``KMoEBlock``, the
  model's attention on the CPU linears): within 1e-5 x max|logits| every step, static and dynamic
  caches, and the cache entries the step writes within 1e-5 of the forward's;
* against the unmodified transformers model, teacher-forced on the step's own greedy tokens: within
  1e-4 x max|logits|, and the greedy tokens equal transformers' own wherever its top-1 margin exceeds
  that.
Speculative verify rows: tests/generation/test_speculative.py; MTP: tests/generation/test_mtp.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ktransformers.generation.decode_step import DecodeStep
from ktransformers.optimize_rules import RULES_DIR

from .step_checks import check_greedy_against_transformers, step_against_own_forward, tiny_pair

CASES = {
    "glm45": {},
    "air": dict(use_qk_norm=False, n_group=1, topk_group=1),
    "full_rotary": dict(partial_rotary_factor=1.0, attention_bias=False),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("glm_step")


def pair(case: str, root: Path):
    return tiny_pair(root / case, "glm4_moe", RULES_DIR / "Glm4Moe-cpu.yaml", **CASES[case])


@pytest.mark.parametrize("case", list(CASES))
def test_the_step_serves_glm4_moe(case, root):
    _, model = pair(case, root)
    step = DecodeStep.build(model)
    assert step is not None and not step.mla
    cfg = model.config
    rot = int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0))
    for i, lay in enumerate(step.layers):
        assert lay.rot == rot and lay.d == cfg.head_dim
        assert (lay.qkv.bias is not None) == bool(cfg.attention_bias)
        assert (lay.qk_norm is not None) == bool(cfg.use_qk_norm)
        if i < cfg.first_k_dense_replace:  # the dense first layers: gate/up + down on the kernels
            assert lay.gate_up is not None and lay.moe is None
        else:  # router, routed experts and shared experts in the step, not the block's forward
            assert lay.moe is not None and lay.mlp_module is None
            assert lay.moe.deepseek is not None and lay.moe.deepseek["bias"] is not None
            assert lay.moe.shared is not None
            assert lay.moe.deepseek["n_group"] == cfg.n_group


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("case", list(CASES))
def test_step_equals_the_models_own_forward(case, kind, root):
    worst, ca, cb, n = step_against_own_forward(pair(case, root)[1], kind)
    for la, lb in zip(ca.layers, cb.layers):  # keys (partially roped) and values as the attention writes them
        for a, b in ((la.keys, lb.keys), (la.values, lb.values)):
            a, b = a[:, :, :n], b[:, :, :n]
            assert a.shape == b.shape
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-5 * a.abs().max().item())
    assert worst <= 1e-5, f"{case}/{kind}: the step is off the model's own forward by {worst:.2e} x max|logits|"


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_logits_match_transformers(case, root):
    check_greedy_against_transformers(*pair(case, root), case)


def test_fuzz_rotary_widths_are_served_or_refused_by_name(root):
    """Any rotary width is either served (even, 2 .. head_dim: the rotated part roped before the
    kernel, or the kernel's own RoPE at full width) or refused with one ``Unsupported`` line naming
    the rotary width (``build`` then returns None and the model's own forward decodes)."""
    pytest.importorskip("hypothesis")
    from hypothesis import given
    from hypothesis import strategies as st

    from ktransformers.generation.decode_step import Unsupported, _Layer
    from tests.fuzzing import fuzz_settings

    _, model = pair("glm45", root)

    @fuzz_settings(200, deadline=None, derandomize=True)
    @given(st.integers(-40, 80))
    def check(rot):
        lay = _Layer(model.model.layers[0], 0, model.config, False)
        d, qk = lay.d, lay.qk_ptr
        try:
            lay.partial_rotary(rot)
        except Unsupported as e:
            assert "\n" not in str(e) and "rotary width" in str(e), str(e)
            assert not (rot % 2 == 0 and 2 <= rot <= d)
            assert lay.rot == d and lay.qk_ptr == qk  # left as it was
            return
        assert rot % 2 == 0 and 2 <= rot <= d and lay.rot == rot
        assert lay.qk_ptr == (qk if rot == d else 0)  # partial: the q/k norm moves before the kernel

    check()


def test_a_rotary_width_the_step_cannot_split_takes_the_generic_forward(root, monkeypatch):
    """A rotary module wider than the head (no rotate-half split of it): ``build`` returns None, so
    the model's own forward decodes; explicit widths are refused by name."""
    from ktransformers.generation.decode_step import Unsupported, _Layer

    _, model = pair("glm45", root)
    lay = _Layer(model.model.layers[0], 0, model.config, False)
    for rot in (7, 0, 18):
        with pytest.raises(Unsupported, match="rotary width"):
            lay.partial_rotary(rot)
    lay.partial_rotary(lay.d)  # full width: the kernel's own RoPE
    assert lay.rot == lay.d and lay.qk_ptr != 0
    monkeypatch.setattr(model.model.rotary_emb, "inv_freq", torch.ones(lay.d))  # cos / sin twice the head wide
    assert DecodeStep.build(model) is None
