"""Qwen3-Next through the shipped rules: gated-DeltaNet linear attention (fused in_proj_qkvz /
in_proj_ba projections on KLinearCPU, the conv and the delta rule token by token in C++ --
operators/cpu_linear_attention.py --, the recurrent and conv state in the cache) and gated full
attention (its transformers forward); the routed experts run on every expert backend, the
gated shared expert beside them, against the unmodified transformers model.  fp32 / bf16 parity of
the shipped CPU rules runs in tests/generation/test_parity.py (the tiny config is in TINY_CONFIGS).
Measured on the tiny model (max |Δ| relative to max |logit|):

============================  ======================================================
rules / backend               logits
============================  ======================================================
Qwen3Next-cpu (llamafile F32) 3.7e-6 (24 tokens), 16 greedy tokens identical
KExpertsTorch                 3.9e-6, 16 greedy tokens identical
AMXBF16                       3.6e-3
AMXInt8                       24 tokens: median 7.2e-3, one routing flip 8.5e-2
bf16 model (llamafile)        7.1e-3 vs transformers in bf16 (test_parity's 2e-2); transformers'
                              own bf16 run is 17 % off its fp32 run on this random DeltaNet layer
============================  ======================================================

GGUF (llama.cpp's ``qwen3next``: the DeltaNet projections split and reordered, ``ssm_a =
-exp(A_log)``, norms as ``w + 1``): tests/operators/test_qwen3_next_gguf.py.
"""

from __future__ import annotations

import pytest
import torch

from ktransformers import load_model
from ktransformers.optimize_rules import RULES_DIR

from .family_checks import (BACKEND_SWAPS, assert_moe_block_on_cpu_kernels, assert_server_serves_one_at_a_time,
                            check_expert_backend, check_gpu_rules_cross_device_parity, generator_greedy,
                            load_with_picked_rules, model_with_backend, rel_err)

ARCH = "qwen3_next"
CPU_RULES = RULES_DIR / "Qwen3Next-cpu.yaml"
# backend -> (rule text change, tolerance relative to max |logit|)
BACKENDS = {
    "llamafile": ("", "", 1e-4),
    **BACKEND_SWAPS,
}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # hf: the shared fixture (conftest.py)


def test_load_model_picks_the_qwen3_next_rules(tiny_model_dir):
    cfg, model = load_with_picked_rules(tiny_model_dir(ARCH), "Qwen3NextForCausalLM", "Qwen3Next")
    linear, full, sparse = 0, 0, 0
    for i, layer in enumerate(model.model.layers):
        if cfg.layer_types[i] == "linear_attention":
            attn = layer.linear_attn
            assert type(attn).__name__ == "Qwen3NextGatedDeltaNet"
            for leaf in ("in_proj_qkvz", "in_proj_ba", "out_proj"):
                assert getattr(attn, leaf).generate_op.name == "KLinearCPU", leaf
            linear += 1
        else:
            assert type(layer.self_attn).__name__ == "Qwen3NextAttention"
            assert layer.self_attn.q_proj.generate_op.name == "KLinearCPU"
            full += 1
        if i in cfg.mlp_only_layers:
            assert type(layer.mlp).__name__ == "Qwen3NextMLP" and layer.mlp.down_proj.generate_op.name == "KLinearCPU"
            continue
        sparse += 1
        assert_moe_block_on_cpu_kernels(layer.mlp, "Qwen3NextTopKRouter", "shared_expert.up_proj")
    assert linear and full and sparse  # every branch of the family present in the tiny model


def test_gated_shared_expert_in_the_block(tiny_model_dir, hf):
    """The placed block (routed on the CPU kernels + sigmoid-gated shared expert) equals the model's."""
    d = tiny_model_dir(ARCH)
    model = load_model(d, model_path=d, allow_unmatched=False)
    i = next(i for i in range(len(model.model.layers)) if i not in hf.config.mlp_only_layers)
    ref_block = hf.model.layers[i].mlp
    x = torch.randn(1, 7, hf.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_block(x)
        got = model.model.layers[i].mlp(x)
        shared = torch.sigmoid(ref_block.shared_expert_gate(x)) * ref_block.shared_expert(x)
    assert rel_err(got, ref) <= 1e-5
    assert shared.abs().max() > 1e-3  # the gated shared expert contributes


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_expert_backends(backend, tiny_model_dir, hf):
    old, new, tol = BACKENDS[backend]
    model = model_with_backend(tiny_model_dir(ARCH), CPU_RULES, (old, new))
    # AMXInt8: int8 weights flip the router's choice at a near tie (the last of 24 positions here,
    # 8.5e-2): the typical position is held to the tolerance, the worst one only to a sane bound
    check_expert_backend(model, hf, tol, int8_worst=0.25 if backend == "AMXInt8" else None)


def test_generator_carries_the_linear_attention_state(tiny_model_dir, hf):
    """The project's engine (chunked prefill of 5 tokens, then decode): the DeltaNet recurrent and
    conv state carries across the prefill chunks and the decode steps in the cache, the tokens equal
    transformers' greedy ones."""
    d = tiny_model_dir(ARCH)
    ours, ref = generator_greedy(load_model(d, model_path=d), hf, d, 5, min_prompt=3 * 5)
    assert ours == ref


def test_continuous_batching_refuses_it_by_name(tiny_model_dir):
    """The paged batching runner cannot hold the linear-attention state: NotPageable, naming why
    (the server then serves one request at a time)."""
    from ktransformers.generation.paged import BatchRunner, NotPageable

    d = tiny_model_dir(ARCH)
    with pytest.raises(NotPageable, match="linear-attention"):
        BatchRunner(load_model(d, model_path=d), page_size=4, num_pages=4)


def test_server_falls_back_to_one_request_at_a_time(tiny_model_dir, caplog):
    assert_server_serves_one_at_a_time(tiny_model_dir(ARCH), caplog, "linear-attention")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CPU+GPU rule files)")
def test_gpu_rules_cross_device_parity(tiny_model_dir, hf):
    check_gpu_rules_cross_device_parity(tiny_model_dir(ARCH), hf)  # picks Qwen3Next.yaml


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text"])
def test_deltanet_layers_run_token_by_token(tiny_model_dir, arch, monkeypatch):
    """Every gated-DeltaNet layer (Qwen3-Next's fused projections, Qwen3.5's split ones) takes the
    token-by-token CPU forward (operators/cpu_linear_attention.py), whose prompt logits match the
    unmodified model's (its chunked delta rule: another grouping of the same sums,
    within 1e-4 of max |logit|); ``KT_FAST_DELTANET=0`` runs transformers' forward."""
    from transformers import AutoModelForCausalLM

    from ktransformers.operators import cpu_linear_attention as LA

    d = tiny_model_dir(arch)
    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours = load_model(d, model_path=d)
    layers = [m for m in ours.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    assert layers and all(hasattr(m, "_kt_original_forward") for m in layers)
    calls = []
    real = LA.gated_delta_rule
    monkeypatch.setattr(LA, "gated_delta_rule", lambda *a, **k: calls.append(1) or real(*a, **k))
    ids = torch.randint(3, 200, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = ours(ids).logits, ref(ids).logits
    assert len(calls) == len(layers)
    assert rel_err(got, want) < 1e-4
    monkeypatch.setenv("KT_FAST_DELTANET", "0")
    with torch.no_grad():
        ours(ids)
    assert len(calls) == len(layers)  # transformers' forward: no new call
