"""Injected models equal the unmodified transformers model (the independent reference).

fp32: max |Δlogits| ≤ 1e-4 × max|logits| and 16 greedy tokens identical.
bf16: both models in bf16; max |Δlogits| ≤ 2e-2 × max|logits| (bf16 has 8 mantissa bits and
the reference operators group expert tokens in another order). Greedy tokens are compared
teacher-forced on the reference's 8-token continuation, at every step where the reference's
top-1 margin exceeds that tolerance: a near tie may go either way on another ISA tier (the
kernels sum in another order), a clear winner may not.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from ktransformers import load_model
from ktransformers.util.tiny_models import TINY_CONFIGS, VISION_ARCHS

from tests.operators.family_checks import assert_greedy_equal, check_gpu_rules_cross_device_parity, prompt_ids

# vision-language families take images with the text: their parity is in tests/multimodal/
ARCHS = [a for a in TINY_CONFIGS if a not in VISION_ARCHS]


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_logits_and_greedy_match_hf(arch, tiny_model_dir):
    d = tiny_model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    model = load_model(d, model_path=d, allow_unmatched=False)
    assert model.kt_plan.injected(), "the shipped rules inject operators"
    ids = prompt_ids()
    with torch.no_grad():
        ref = hf(ids).logits
        got = model(ids).logits
    scale = ref.abs().max().item()
    assert (got - ref).abs().max().item() <= 1e-4 * scale
    assert_greedy_equal(model, hf, ids)


# sparse-attention families: their bf16 check replays the reference's top-k keys and experts
# (tests/operators/test_deepseek_v32.py), two bf16 models each choosing for itself differ by the flips
BF16_ARCHS = [a for a in ARCHS if a not in ("deepseek_v32", "glm_moe_dsa")]


@pytest.mark.parametrize("arch", BF16_ARCHS)
def test_bf16_close_to_hf_bf16(arch, tiny_model_dir):
    d = tiny_model_dir(arch)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    model = load_model(d, model_path=d, dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    ids = prompt_ids()
    with torch.no_grad():
        ref = hf(ids).logits.float()
        got = model(ids).logits.float()
    tol = 2e-2 * ref.abs().max().item()
    assert (got - ref).abs().max().item() <= tol
    _assert_greedy_agrees_where_clear(model, hf, ids[:, :4], steps=8, tol=tol)


def _assert_greedy_agrees_where_clear(model, hf, prompt, steps, tol):
    """Teacher-forced on the reference's greedy continuation: top-1 agrees wherever the
    reference's margin over its runner-up exceeds ``tol``; at least half the steps must be
    clear, so the check cannot pass vacuously."""
    seq = hf.generate(prompt, max_new_tokens=steps, do_sample=False)
    with torch.no_grad():
        ref = hf(seq).logits[0, prompt.shape[1] - 1 : -1].float()
        got = model(seq).logits[0, prompt.shape[1] - 1 : -1].float()
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > tol
    assert clear.sum().item() >= steps // 2, f"only {clear.sum().item()} of {steps} steps have a clear winner"
    want = seq[0, prompt.shape[1]:]
    bad = [i for i in range(steps) if clear[i] and got[i].argmax().item() != want[i].item()]
    assert not bad, f"greedy token differs at clear steps {bad}"


def test_fixture_qwen3moe_matches_recorded_hf_logits(fixtures_dir, monkeypatch):
    """The shared fixture (bf16 on disk, fp32 model) through the shipped CPU rules, the prompt's
    attention on the flash kernel in fp32 (its default bf16 P x V is tested in
    tests/operators/test_cpu_attention.py)."""
    import json

    monkeypatch.setenv("KT_FLASH_ATTN", "fp32")
    d = fixtures_dir / "qwen3moe-tiny"
    ids = torch.tensor([json.loads((d / "tokens.json").read_text())["token_ids"]])
    model = load_model(d / "hf", model_path=d / "hf", allow_unmatched=False)
    with torch.no_grad():
        got = model(ids).logits[0].numpy()
    ref = np.load(d / "hf_logits.npy")
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


@pytest.mark.parametrize("rules", ["Dense-cpu.yaml", "plain-head"])
def test_tied_embeddings_share_one_copy(rules, tiny_model_dir):
    """Tied lm_head: one copy in memory, whether the head is an injected op or a plain Linear."""
    from ktransformers.optimize_rules import RULES_DIR

    d = tiny_model_dir("gemma3_text")
    if rules == "plain-head":
        model = load_model(d, model_path=d, rules="- match: {name: '^model$'}\n  replace: {class: default, device: cpu}\n")
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        model = load_model(d, model_path=d, rules=RULES_DIR / rules)
        head = model.lm_head.generate_op._weight_array
        assert head.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_inject_into_own_script(tiny_model_dir):
    """Usage 3: the user's own transformers script, build on meta, inject, generate."""
    from transformers import AutoConfig

    from ktransformers import build_model, inject

    d = tiny_model_dir("qwen3_moe")
    config = AutoConfig.from_pretrained(d)
    model = build_model(config)
    assert model.lm_head.weight.device.type == "meta"
    model = inject(model, "ktransformers/optimize_rules/Qwen3Moe-cpu.yaml", d)
    out = model.generate(prompt_ids()[:, :3], max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


def test_model_built_under_meta_device_gets_its_buffers(tiny_model_dir):
    """Built with ``torch.device('meta')`` (rotary tables on meta too): recomputed at load."""
    from transformers import AutoConfig

    from ktransformers import inject

    d = tiny_model_dir("llama")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))
    assert model.model.rotary_emb.inv_freq.device.type == "meta"
    model = inject(model, "ktransformers/optimize_rules/Dense-cpu.yaml", d)
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        assert torch.allclose(model(prompt_ids()).logits, hf(prompt_ids()).logits, atol=1e-5)


def test_leftover_meta_tensors_are_named(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    from ktransformers.errors import WeightError

    d = tiny_model_dir("llama")
    sd = load_file(d / "model.safetensors")
    del sd["model.layers.1.post_attention_layernorm.weight"]
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(WeightError, match="model.layers.1.post_attention_layernorm.weight' not found"):
        load_model(tmp_path, model_path=d)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CPU+GPU rule files)")
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "deepseek_v2"])
def test_gpu_rules_cross_device_parity(arch, tiny_model_dir):
    """Experts on the CPU, everything else on cuda:0: activations hop devices at the boundaries."""
    d = tiny_model_dir(arch)
    check_gpu_rules_cross_device_parity(d, AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval())
