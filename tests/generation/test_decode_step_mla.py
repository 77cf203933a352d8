"""The one decode step on DeepSeek MLA models (generation/decode_step.py: ``_MLA`` and the DeepSeek
MoE block in ``_MoE``) against the model's own forward and the unmodified transformers model.

Tiny random DeepSeek-V2 (no q_lora, complex RoPE, greedy softmax router, two shared experts) and V3
(q_lora, interleaved RoPE, grouped sigmoid router with correction bias), plus a Moonlight-like V3
(no q_lora, YaRN, rotate-half RoPE) and a V2-Chat-like V2 (q_lora, YaRN, group-limited router),
each with a dense first layer, loaded through the shipped -cpu rules (F32 weights on the CPU kernels).

Tolerances:
* the step against the model's own forward on the same cache (the injected ``KDeepseekV2Attention``
  and ``KMoEBlock``): within 1e-5 x max|logits| every step, static and dynamic caches (the norms run
  in C++ here, in torch there);
* against the unmodified transformers model, teacher-forced on the step's own greedy tokens: within
  1e-4 x max|logits| (the bar of tests/operators/test_mla_attention.py), and the greedy tokens equal
  transformers' own wherever its top-1 margin exceeds that;
* the deepseek2-tiny fixture's llama.cpp GGUFs (when present) decoded by the step against
  llama.cpp's logits: the fixture's bar (mean |diff| <= 0.05, median per-position max <= 0.2).
The page pool's MLA rows: tests/generation/test_batch_decode_lean.py; speculative verify:
tests/generation/test_speculative.py; routes: tests/generation/test_route_invariance.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ktransformers
from ktransformers.generation import Generator, SamplingParams
from ktransformers.generation.decode_step import DecodeStep, decode_step_for

from .step_checks import (check_greedy_against_transformers, prefilled_cache, prompt, step_against_own_forward,
                          tiny_pair)
from .test_invariance import _NoText

# the tiny MLA variants (V2, V3, Moonlight-like, V2-Chat-like) and their rule files: one table
from tests.operators.test_mla_attention import CASES, RULES  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ds_step")


def pair(case: str, root: Path):
    arch, rule, over = CASES[case]
    return tiny_pair(root / case, arch, RULES / rule, **over)


_prompt = prompt


@pytest.mark.parametrize("case", list(CASES))
def test_the_step_serves_mla_and_the_deepseek_moe(case, root):
    _, model = pair(case, root)
    step = DecodeStep.build(model)
    assert step is not None and step.mla
    cfg = model.config
    assert all(lay.mla is not None for lay in step.layers)
    assert (step.layers[0].mla.q_b is None) == (cfg.q_lora_rank is None)
    for i, lay in enumerate(step.layers):
        if i < cfg.first_k_dense_replace:  # the dense first layers: gate/up + down on the kernels
            assert lay.gate_up is not None and lay.moe is None
        else:  # router, routed experts and shared experts in the step, not the block's forward
            assert lay.moe is not None and lay.mlp_module is None
            assert lay.moe.deepseek is not None and lay.moe.shared is not None
            assert (lay.moe.deepseek["bias"] is not None) == (cfg.model_type == "deepseek_v3")


@pytest.mark.parametrize("kind", ["static", "dynamic"])
@pytest.mark.parametrize("case", list(CASES))
def test_step_equals_the_models_own_forward(case, kind, root):
    worst, ca, cb, n = step_against_own_forward(pair(case, root)[1], kind)
    for la, lb in zip(ca.layers, cb.layers):  # the latent cache as the model's attention leaves it
        assert int(la.get_seq_length()) == int(lb.get_seq_length()) == n
        for a, b in ((la.keys, lb.keys), (la.values, lb.values)):
            assert a.shape == b.shape
            assert torch.allclose(a[:, :, :n], b[:, :, :n], rtol=1e-5, atol=1e-5 * a.abs().max().item())
    assert worst <= 1e-5, f"{case}/{kind}: the step is off the model's own forward by {worst:.2e} x max|logits|"


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_tokens_and_logits_match_transformers(case, root):
    check_greedy_against_transformers(*pair(case, root), case)


@pytest.mark.parametrize("case", ["v2", "v3"])
def test_speculative_verify_is_the_plain_answer(case, root):
    """Prompt lookup on a copying prompt: the verify rows (``step_rows``) give the plain answer."""
    import numpy as np

    _, model = pair(case, root)
    run = [int(i) for i in np.random.default_rng(5).integers(3, 300, 16)]
    prompt = run * 3 + run[:8]
    params = SamplingParams(max_new_tokens=32)
    _, want, _ = Generator(model, _NoText()).generate(prompt, params)
    g = Generator(model, _NoText(), speculative="ngram", draft_max=5)
    _, got, _ = g.generate(prompt, params)
    assert got == want
    assert g.last_stats.drafted_tokens > 0


def test_unserved_cache_states_take_the_generic_forward(root):
    _, model = pair("v3", root)
    step = decode_step_for(model)
    g = Generator(model, _NoText())
    ids = _prompt()
    with torch.inference_mode():
        cache = prefilled_cache(step, g, ids, 2)
        assert step.step(5, len(ids) + 1, cache) is None  # not the next position
        assert step.step_rows([5, 6, 7], len(ids), cache) is None  # no room for three rows
        assert step.step(5, len(ids), cache) is not None
        assert step.step(5, len(ids) + 1, cache) is not None
        assert step.step(5, len(ids) + 2, cache) is None  # the cache is full
    assert not step.accepts(cache)  # outside inference mode (autograd may be recording)


FIX = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "deepseek2-tiny"


@pytest.mark.skipif(not (FIX / "hf" / "config.json").is_file(), reason=f"fixture {FIX} not present")
@pytest.mark.parametrize("quant", ["Q8_0", "Q4_K_M"])
def test_llama_cpp_gguf_decoded_by_the_step_matches_llama_cpp(quant):
    """The deepseek2-tiny fixture's llama.cpp GGUFs (DeepSeek-V3 architecture: q_lora, interleaved
    RoPE, grouped sigmoid router with correction bias, dense first layer; kv_b_proj rebuilt from
    attn_k_b / attn_v_b; embeddings read in place), the shipped -cpu rules: the first 8 tokens read
    by the prompt forward, every later one by the decode step; its logits against llama.cpp's on
    the same tokens, to the fixture's bar (mean |diff| <= 0.05, median per-position max <= 0.2; the
    kernels quantise activations to int8 as llama.cpp does)."""
    import json

    import numpy as np

    model = ktransformers.load_model(FIX / f"{quant}.gguf", model_path=FIX / "hf",
                                     rules=RULES / "DeepSeek-V3-Chat-cpu.yaml")
    step = DecodeStep.build(model)
    assert step is not None and step.mla and all(lay.moe is not None for lay in step.layers[1:])
    assert step.embed_rows is not None  # the GGUF embedding rows read in place
    ids = json.loads((FIX / "tokens.json").read_text())["token_ids"]
    g = Generator(model, _NoText())
    with torch.inference_mode():
        cache = g.new_cache(len(ids))
        rows = [g.prefill(ids[:8], cache)[0]]
        for pos in range(8, len(ids)):
            assert step.accepts(cache)
            rows.append(step.step(ids[pos], pos, cache)[0].clone())
    got = torch.stack(rows).numpy()
    ref = np.load(FIX / f"{quant}.logits.npy")[7:]
    d = np.abs(got - ref)
    mean_abs, med_pos_max = float(d.mean()), float(np.median(d.max(axis=1)))
    print(f"{quant}: mean abs {mean_abs:.4f}, median per-position max {med_pos_max:.4f}, max {d.max():.4f}")
    assert mean_abs <= 0.05 and med_pos_max <= 0.2, (quant, mean_abs, med_pos_max)
