"""KMoEGate against the transformers DeepSeek routers: same weights, same indices in the same
order (the routers use ``topk(sorted=False)``), ties included; V3 (sigmoid + correction bias,
grouped) and V2 (softmax; greedy and group_limited_greedy)."""

from __future__ import annotations

import pytest
import torch

from ktransformers.operators.gate import KMoEGate
from ktransformers.util.tiny_models import tiny_config


def make_router(arch: str, **over):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(arch, num_hidden_layers=2, **over)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    router = model.model.layers[1].mlp.gate
    gate = KMoEGate("model.layers.1.mlp.gate", None, cfg, router)
    return router, gate, cfg


def check(router, gate, x, exact_weights=True):
    """``exact_weights=False`` (V3): the gate takes each row's sigmoid on whole vectors (row
    invariance), where torch's elementwise loop over all T x E logits sends its last few through
    the scalar function -- at most 1 ulp apart, on the tiers where the counts leave such a tail."""
    with torch.no_grad():
        want = router(x)
        got = gate(x)
    assert torch.equal(want[0], got[0])
    assert torch.equal(want[2], got[2]), "expert indices (incl. order) differ"
    if exact_weights:
        assert torch.equal(want[1], got[1]), "routing weights differ"
    else:
        torch.testing.assert_close(got[1], want[1], rtol=2.5e-7, atol=0, msg="routing weights differ by > 2 ulp")
    assert got[2].dtype == torch.int64


V3_CASES = {
    "grouped": dict(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4),
    "one_group": dict(n_routed_experts=16, n_group=1, topk_group=1, num_experts_per_tok=6),  # Kimi-K2/Moonlight
    "no_norm": dict(n_routed_experts=8, n_group=2, topk_group=1, norm_topk_prob=False),
}
V2_CASES = {
    "greedy": dict(n_routed_experts=16, topk_method="greedy", num_experts_per_tok=6, routed_scaling_factor=1.0),
    "group_limited": dict(n_routed_experts=16, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                          num_experts_per_tok=4, routed_scaling_factor=16.0),
}


def _inputs(router, H, ties: bool):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(0, 0.3, generator=g)
        if hasattr(router, "e_score_correction_bias"):
            router.e_score_correction_bias.normal_(0, 0.05, generator=g)
        if ties:
            # duplicate rows: identical logits for several experts; exact zeros: identical sigmoid
            router.weight[1::2] = router.weight[0::2]
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias[1::2] = router.e_score_correction_bias[0::2]
    x = torch.randn(257, H, generator=g)
    if ties:
        x[:16] = 0.0  # every logit 0: all scores tie
    return x


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("case", list(V3_CASES))
def test_v3_router_matches_hf(case, ties):
    router, gate, cfg = make_router("deepseek_v3", **V3_CASES[case])
    x = _inputs(router, cfg.hidden_size, ties)
    check(router, gate, x, exact_weights=False)
    check(router, gate, x.to(torch.bfloat16).view(1, 257, -1), exact_weights=False)  # dtype and [B,S,H] input


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("case", list(V2_CASES))
def test_v2_router_matches_hf(case, ties):
    router, gate, cfg = make_router("deepseek_v2", **V2_CASES[case])
    x = _inputs(router, cfg.hidden_size, ties)
    check(router, gate, x)
    check(router, gate, x.to(torch.bfloat16).view(1, 257, -1))


def test_v2_group_limited_only_picks_kept_groups():
    router, gate, cfg = make_router("deepseek_v2", **V2_CASES["group_limited"])
    x = _inputs(router, cfg.hidden_size, False)
    with torch.no_grad():
        logits, w, idx = gate(x)
    per = cfg.n_routed_experts // cfg.n_group
    groups = idx // per
    assert max(len(set(r.tolist())) for r in groups) <= cfg.topk_group
    scores = logits.softmax(-1)
    assert torch.allclose(w, scores.gather(1, idx) * cfg.routed_scaling_factor)
